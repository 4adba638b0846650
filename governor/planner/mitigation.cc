#include "governor/planner/mitigation.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "base/units.h"
#include "governor/planner/layer_search.h"
#include "governor/planner/operator_dp.h"
#include "governor/planner/priced_greedy.h"

namespace bgl::plan {

Assignment FullRecompute(const CostEvaluator& eval) {
  Assignment a(eval.graph().ops.size(), Strategy::kKeep);
  for (size_t o = 0; o < a.size(); ++o) {
    if (eval.Allowed(static_cast<int>(o), Strategy::kRecompute)) a[o] = Strategy::kRecompute;
  }
  return a;
}

namespace {

constexpr Strategy kMitigations[] = {Strategy::kRecompute, Strategy::kOffload, Strategy::kFp8};

// The labels the downgrade's operator DP (ReplanAfterGate) spreads over the operators not run
// yet. 20,000 (issue 43, planner_first_answer_study gate-reference 4343 100): the pinned optima
// proven there are met within 1.5x but one (2.12x); 64 labels per cut left 8.3x.
constexpr int kDowngradeLabels = 20000;
// Fewer labels per cut than this and the downgrade's DP does not run (ReplanAfterGate).
constexpr int kMinDowngradeLabels = 16;
// The searches again below the best plan so far where a front was thinned (issue 43).
constexpr int kDowngradePasses = 4;

using Partners = std::vector<std::vector<int>>;

// Savers that share a tensor with each operator: a move applies to the ones still keeping it,
// so a tensor with several consumers moves as one (otherwise the move is a conflict or saves
// nothing, and the greedy could never drop the MoE input or the attention output).
Partners FindPartners(const StageGraph& g) {
  const size_t n = g.ops.size();
  Partners partners(n);
  for (size_t o = 0; o < n; ++o) {
    for (int t : g.ops[o].saves) {
      for (int other : g.tensors[t].savers) {
        if (other != static_cast<int>(o) &&
            std::find(partners[o].begin(), partners[o].end(), other) == partners[o].end()) {
          partners[o].push_back(other);
        }
      }
    }
  }
  return partners;
}

// Sets `s` on operator o and on those partners that may use it (with `keeping_only`, only the
// partners that still keep their tensors).
Assignment Move(const CostEvaluator& eval, const Partners& partners, Assignment a, size_t o,
                Strategy s, bool keeping_only) {
  a[o] = s;
  for (int other : partners[o]) {
    if ((!keeping_only || a[other] == Strategy::kKeep) && eval.Allowed(other, s)) a[other] = s;
  }
  return a;
}

// Local search: switch one operator (alone or with its partners) to any strategy, keep the
// switch that lowers the overhead most while the budget still holds. Undoes choices the budget
// no longer needs and swaps an exposed strategy for a hidden one.
void Refine(const CostEvaluator& eval, double r, double budget, const MitigationOptions& options,
            const Partners& partners, MitigationResult& result) {
  const size_t n = eval.graph().ops.size();
  for (int pass = 0; pass < 4 * static_cast<int>(n); ++pass) {
    bool improved = false;
    double best_saving = 1e-12;
    AssignmentCost best_cost;
    Assignment best_assignment;
    for (size_t o = 0; o < n; ++o) {
      for (Strategy s : kAllStrategies) {
        if (s == result.assignment[o] || !options.Permits(s) ||
            !eval.Allowed(static_cast<int>(o), s)) {
          continue;
        }
        for (bool group : {false, true}) {
          if (group && partners[o].empty()) continue;
          Assignment trial = result.assignment;
          trial[o] = s;
          if (group) trial = Move(eval, partners, std::move(trial), o, s, /*keeping_only=*/false);
          const AssignmentCost c = eval.Evaluate(trial, r);
          const double saving = result.cost.exposed_s - c.exposed_s;
          if (!c.conflict && c.device_bytes <= budget && options.HostFits(c.host_bytes) &&
              saving > best_saving) {
            improved = true;
            best_saving = saving;
            best_cost = c;
            best_assignment = std::move(trial);
          }
        }
      }
    }
    if (!improved) break;
    result.assignment = std::move(best_assignment);
    result.cost = best_cost;
    ++result.refinements;
  }
}

// Ties (issue 22): of the assignments with the same exposed overhead, one that moves fewer bytes
// off the device. Where copies hide under compute an offload costs nothing, and an answer that
// offloads everything hideable (the operator DP's fronts keep the least memory first) is as
// cheap as one that offloads only what the budget needs, while it moves several times the bytes
// and holds as much more pinned host memory. One sweep switches mitigated operators (with the
// partners that share their tensors) back to keep, those saving the most bytes first, while the
// budget, the host limit and the overhead hold: afterwards no single switch back fits. A label
// that moves nothing (a partner keeps the tensor) goes back to keep too.
void KeepWhatFits(const CostEvaluator& eval, double r, double budget,
                  const MitigationOptions& options, const Partners& partners,
                  MitigationResult& result) {
  const StageGraph& g = eval.graph();
  std::vector<std::pair<double, size_t>> order;
  for (size_t o = 0; o < g.ops.size(); ++o) {
    if (result.assignment[o] == Strategy::kKeep) continue;
    double bytes = 0;
    for (int t : g.ops[o].saves) bytes += g.tensors[t].Bytes(r);
    order.emplace_back(-bytes, o);
  }
  std::sort(order.begin(), order.end());
  for (const auto& [neg_bytes, o] : order) {
    if (result.assignment[o] == Strategy::kKeep) continue;  // kept with a partner already
    // Kept without a conflict, o's tensors come back in full precision: at least what they
    // save now must fit the slack (skips the evaluations that cannot fit).
    double back = 0;
    for (int t : g.ops[o].saves) {
      const SavedTensor& st = g.tensors[t];
      const Placement p = eval.TensorPlacement(result.assignment, t);
      if (p == Placement::kFp8) {
        back += st.Bytes(r) - CostEvaluator::Fp8Bytes(st.Bytes(r), st.dtype);
      } else if (p == Placement::kHost || p == Placement::kDropped) {
        back += st.Bytes(r);
      }
    }
    if (back > budget - result.cost.device_bytes) continue;
    for (bool group : {false, true}) {
      if (group && partners[o].empty()) continue;
      Assignment trial = result.assignment;
      trial[o] = Strategy::kKeep;
      if (group) {
        for (int other : partners[o]) trial[other] = Strategy::kKeep;
      }
      const AssignmentCost c = eval.Evaluate(trial, r);
      if (!c.conflict && c.device_bytes <= budget && options.HostFits(c.host_bytes) &&
          c.device_bytes >= result.cost.device_bytes &&
          c.exposed_s <= result.cost.exposed_s + 1e-12) {
        result.assignment = std::move(trial);
        result.cost = c;
        break;
      }
    }
  }
}

// GreedyMitigation over the graph's `partners` (FindPartners), which the caller found once.
MitigationResult Greedy(const CostEvaluator& eval, double r, double budget,
                        const MitigationOptions& options, const Partners& partners,
                        std::vector<Assignment>* trajectory) {
  const StageGraph& g = eval.graph();
  const size_t n = g.ops.size();
  MitigationResult result;
  result.budget = budget;
  result.assignment.assign(n, Strategy::kKeep);
  result.cost = eval.Evaluate(result.assignment, r);
  if (trajectory) trajectory->push_back(result.assignment);
  // dropped[o][s]: candidate (o, s) was rejected for a conflict and is never retried.
  std::vector<std::array<bool, kStrategyCount>> dropped(n);
  for (auto& d : dropped) d.fill(false);
  auto move = [&](Assignment a, size_t o, Strategy s, bool keeping_only) {
    return Move(eval, partners, std::move(a), o, s, keeping_only);
  };

  while (result.cost.device_bytes > budget) {
    // Re-evaluate every remaining candidate on the current assignment. Each operator offers its
    // roofline-best strategy: most bytes saved per second of added overhead, at this size. An
    // operator already stored as FP8 may still move to offload or recompute.
    const double need = result.cost.device_bytes - budget;
    // One candidate move (operator op to strategy s) and what it gives; op < 0: none yet.
    struct Candidate {
      int op = -1;
      Strategy s = Strategy::kKeep;
      double gain = 0, overhead = 0;
      AssignmentCost cost;
      Assignment assignment;
    };
    Candidate best;
    bool best_finishes = false;
    for (size_t o = 0; o < n; ++o) {
      const Strategy current = result.assignment[o];
      if (current == Strategy::kRecompute || current == Strategy::kOffload) continue;
      Candidate op;
      double op_rate = -1;
      for (Strategy s : kMitigations) {
        if (s == current || !options.Permits(s) || !eval.Allowed(static_cast<int>(o), s)) {
          continue;
        }
        if (dropped[o][static_cast<int>(s)]) continue;
        Assignment trial = move(result.assignment, o, s, /*keeping_only=*/true);
        const AssignmentCost c = eval.Evaluate(trial, r);
        // Past the host limit the candidate is unavailable (issue 14).
        if (!options.HostFits(c.host_bytes)) continue;
        const double gain = result.cost.device_bytes - c.device_bytes;
        const double overhead = std::max(0.0, c.exposed_s - result.cost.exposed_s);
        const double rate = gain / std::max(overhead, 1e-9);
        if (gain > 0 && rate > op_rate) {
          op = Candidate{static_cast<int>(o), s, gain, overhead, c, std::move(trial)};
          op_rate = rate;
        }
      }
      if (op.op < 0) continue;
      // Largest gain first (ties: smaller overhead); but once single moves can finish the job,
      // take the cheapest of those rather than the biggest.
      const bool finishes = op.gain >= need;
      bool better;
      if (best.op < 0)
        better = true;
      else if (finishes != best_finishes)
        better = finishes;
      else if (finishes)
        better =
            op.overhead < best.overhead || (op.overhead == best.overhead && op.gain > best.gain);
      else
        better = op.gain > best.gain || (op.gain == best.gain && op.overhead < best.overhead);
      if (better) {
        best = std::move(op);
        best_finishes = finishes;
      }
    }
    if (best.op < 0) break;
    ++result.rounds;
    if (best.cost.conflict) {
      // Skip rather than undo: the earlier choice it conflicts with had the larger gain.
      dropped[best.op][static_cast<int>(best.s)] = true;
      ++result.rejected_conflicts;
      continue;
    }
    result.assignment = std::move(best.assignment);
    result.cost = best.cost;
    if (trajectory) trajectory->push_back(result.assignment);
  }

  if (result.cost.device_bytes > budget) {
    result.assignment = FullRecompute(eval);
    result.cost = eval.Evaluate(result.assignment, r);
    result.fallback_full_recompute = true;
  }

  if (options.refine) Refine(eval, r, budget, options, partners, result);
  if (trajectory && options.refine) trajectory->push_back(result.assignment);
  // The local search may have changed the fallback's plan: then it is no full recompute.
  if (result.fallback_full_recompute && result.refinements > 0) {
    result.fallback_full_recompute = result.assignment == FullRecompute(eval);
  }
  result.fits = result.cost.device_bytes <= budget;
  return result;
}

}  // namespace

MitigationResult GreedyMitigation(const CostEvaluator& eval, double r, double budget,
                                  const MitigationOptions& options,
                                  std::vector<Assignment>* trajectory) {
  return Greedy(eval, r, budget, options, FindPartners(eval.graph()), trajectory);
}

Result<MitigationResult> SelectMitigation(const CostEvaluator& eval, double r, double budget,
                                          const MitigationOptions& options) {
  const double m0 = eval.graph().M0(r);
  if (!(budget >= m0)) {
    return InvalidArgument("budget " + FormatBytes(budget) + " is below M0 = " + FormatBytes(m0) +
                           " (activation memory under full recompute); no plan can meet it");
  }
  const size_t n = eval.graph().ops.size();
  const Partners partners = FindPartners(eval.graph());  // once: every step below moves with them
  if (options.fast && n <= static_cast<size_t>(options.max_dp_ops)) {
    // The anytime path's first answer (issues 23, 43): the priced candidates (priced_greedy.h),
    // then the operator DP on a small front below their cost; the cheaper one.
    MitigationResult quick;
    quick.budget = budget;
    bool found = false;
    if (options.fast_priced) {
      if (std::optional<Assignment> priced = PricedGreedy(eval, r, budget, options)) {
        quick.assignment = std::move(*priced);
        quick.cost = eval.Evaluate(quick.assignment, r);
        found = true;
      }
    }
    // Nothing is cheaper than no overhead: the DP has nothing to add. Such an answer stays a first
    // answer all the same (only the DP's own proof marks one exact, as before issue 43): the
    // refinement cannot beat it, and the hosts see a miss on a large chunk as before.
    if (!found || quick.cost.exposed_s > 0) {
      const double bound = found ? quick.cost.exposed_s : std::numeric_limits<double>::infinity();
      std::optional<OperatorDpResult> dp =
          OperatorDp(eval, r, budget, bound, options, options.fast_dp_states);
      if (dp) {
        quick.assignment = std::move(dp->assignment);
        quick.cost = eval.Evaluate(quick.assignment, r);
        quick.from_operator_dp = true;
        quick.exact = dp->exact;
        found = true;
      }
    }
    if (found) {
      quick.first_answer = !quick.exact;
      if (!quick.cost.conflict && quick.cost.device_bytes <= budget) {
        KeepWhatFits(eval, r, budget, options, partners, quick);
      }
      quick.fits = quick.cost.device_bytes <= budget;
      return quick;
    }
  }
  MitigationResult result = Greedy(eval, r, budget, options, partners, nullptr);
  // The priced candidates (issue 43) as a second bound: cheaper than the greedy's answer on most
  // multi-layer chunks, so the searches below start lower.
  if (options.priced_bound && result.cost.exposed_s > 0) {
    if (std::optional<Assignment> priced = PricedGreedy(eval, r, budget, options)) {
      MitigationResult alt = result;
      alt.assignment = std::move(*priced);
      alt.cost = eval.Evaluate(alt.assignment, r);
      alt.refinements = 0;
      if (alt.cost.exposed_s < result.cost.exposed_s) {
        result = std::move(alt);
        result.fallback_full_recompute = false;
      }
    }
  }
  // The greedy is the bound: the layer search's answer replaces it only when it is cheaper. A
  // greedy answer without overhead is already optimal.
  if (options.layer_search && result.cost.exposed_s > 0 &&
      eval.graph().ops.size() <= static_cast<size_t>(options.max_layer_search_ops)) {
    std::optional<Assignment> found = LayerSearch(eval, r, budget, result.cost.exposed_s, options);
    if (found) {
      MitigationResult alt = result;
      alt.assignment = std::move(*found);
      alt.cost = eval.Evaluate(alt.assignment, r);
      if (!alt.cost.conflict && alt.cost.device_bytes <= budget &&
          options.HostFits(alt.cost.host_bytes)) {
        if (options.refine) Refine(eval, r, budget, options, partners, alt);
        if (alt.cost.exposed_s < result.cost.exposed_s) {
          result = std::move(alt);
          result.fallback_full_recompute = false;
          result.from_layer_search = true;
        }
      }
    }
  }
  // The operator DP (operator_dp.h) over the whole chunk, below the best answer so far: exact
  // while its fronts stay under their cap, so the copy windows fill across layers and operators.
  if (options.operator_dp && result.cost.exposed_s > 0 &&
      n <= static_cast<size_t>(options.max_dp_ops)) {
    std::optional<OperatorDpResult> dp =
        OperatorDp(eval, r, budget, result.cost.exposed_s, options);
    if (dp) {
      MitigationResult alt = result;
      alt.assignment = std::move(dp->assignment);
      alt.cost = eval.Evaluate(alt.assignment, r);
      alt.refinements = 0;
      if (!dp->exact && options.refine) {
        Refine(eval, r, budget, options, partners, alt);
      }
      if (!alt.cost.conflict && alt.cost.device_bytes <= budget &&
          options.HostFits(alt.cost.host_bytes) && alt.cost.exposed_s < result.cost.exposed_s) {
        result = std::move(alt);
        result.fallback_full_recompute = false;
        result.from_layer_search = false;
        result.from_operator_dp = true;
      }
      result.exact = dp->exact;  // nothing cheaper than the answer exists
    }
  } else if (result.cost.exposed_s <= 0) {
    result.exact = true;
  }
  if (!result.cost.conflict && result.cost.device_bytes <= budget &&
      !result.fallback_full_recompute) {
    KeepWhatFits(eval, r, budget, options, partners, result);
  }
  result.fits = result.cost.device_bytes <= budget;
  return result;
}

MitigationResult ReplanAfterGate(const CostEvaluator& eval, const Assignment& planned,
                                 int gate_layer, double observed_r, double budget,
                                 double host_limit_bytes, const MitigationOptions& allowed,
                                 const std::vector<Assignment>* warm, const GateSearch& search) {
  const StageGraph& g = eval.graph();
  MitigationResult result;
  result.budget = budget;
  result.assignment = planned;
  result.cost = eval.Evaluate(planned, observed_r);
  auto over_host = [&](const AssignmentCost& c) {
    return host_limit_bytes >= 0 && c.host_bytes > host_limit_bytes;
  };
  if (result.cost.device_bytes <= budget && !over_host(result.cost)) {
    result.fits = true;
    return result;
  }
  // The fixed rule (before issue 43): operators of the gate's layer and after that `pick`
  // selects go to recompute: the MoE blocks when the plan no longer fits, then the offloads when
  // the host grant is exceeded.
  MitigationResult rule = result;
  auto downgrade = [&](auto pick) {
    for (size_t o = 0; o < g.ops.size(); ++o) {
      if (g.ops[o].layer >= gate_layer && pick(o) && allowed.allow_recompute &&
          eval.Allowed(static_cast<int>(o), Strategy::kRecompute)) {
        rule.assignment[o] = Strategy::kRecompute;
      }
    }
    rule.cost = eval.Evaluate(rule.assignment, observed_r);
  };
  if (rule.cost.device_bytes > budget) {
    downgrade([&](size_t o) { return IsMoeBlock(g.ops[o].kind); });
    rule.fallback_full_recompute = true;
  }
  if (over_host(rule.cost)) {
    downgrade([&](size_t o) { return rule.assignment[o] == Strategy::kOffload; });
  }
  rule.fits = rule.cost.device_bytes <= budget;
  // The plan (issue 43): the operators the forward has not run yet (the gate's layer from its
  // first MoE-block operator on, every later layer) planned again at the observed load with the
  // priced candidates, the others pinned; offload, FP8 and recompute weighed at the calibrated
  // costs, a tensor shared with an operator that ran placed as that one placed it. The cheaper
  // of the plan and the rule.
  Pinned pins;
  pins.strategies = planned;
  pins.pinned.assign(g.ops.size(), 1);
  bool moe_seen = false;
  for (size_t o = 0; o < g.ops.size(); ++o) {
    const Operator& op = g.ops[o];
    moe_seen |= op.layer == gate_layer && IsMoeBlock(op.kind);
    if (op.layer > gate_layer || (op.layer == gate_layer && moe_seen)) pins.pinned[o] = 0;
  }
  // What the planner may use (a run that keeps FP8 out must not get it from a revision).
  MitigationOptions options;
  options.allow_recompute = allowed.allow_recompute;
  options.allow_offload = allowed.allow_offload;
  options.allow_fp8 = allowed.allow_fp8;
  options.host_limit_bytes = host_limit_bytes;
  MitigationResult best = rule;
  bool best_fits = rule.fits && !over_host(rule.cost);
  auto consider = [&](Assignment plan) {
    const AssignmentCost c = eval.Evaluate(plan, observed_r);
    if (!c.conflict && c.device_bytes <= budget && !over_host(c) &&
        (!best_fits || c.exposed_s < best.cost.exposed_s)) {
      best = result;
      best.assignment = std::move(plan);
      best.cost = c;
      best.fits = best_fits = true;
    }
  };
  if (std::optional<Assignment> plan = PricedGreedy(eval, observed_r, budget, options, &pins)) {
    consider(std::move(*plan));
  }
  // The warm plans at the observed load, the operators that ran as they ran: where the copy
  // windows decide, a whole-chunk search finds what the priced candidates miss.
  for (size_t w = 0; warm != nullptr && w < warm->size(); ++w) {
    if ((*warm)[w].size() != planned.size()) continue;
    Assignment plan = (*warm)[w];
    bool permitted = true;
    for (size_t o = 0; o < plan.size(); ++o) {
      if (pins.pinned[o]) plan[o] = planned[o];
      permitted &= options.Permits(plan[o]);
    }
    if (permitted) consider(std::move(plan));
  }
  // The operator DP over the rest of the chunk (operator_dp.h), the operators that ran pinned,
  // below the best so far: it trades keeps, offloads and recomputes across the operators not run
  // yet where the copy windows decide, which the priced candidates and a warm plan of the whole
  // chunk miss (issue 43: the worst downgrades at 9.4x the pinned optimum traded a keep and an
  // offload at once). Its fronts hold kDowngradeLabels / (operators not run yet) labels per cut,
  // at least 16 and at most the full search's 2,048, so its time stays bounded at any gate.
  // Where it had to thin a front it searches again, up to kDowngradePasses times, below the best
  // plan so far: the labels that cannot beat that plan (their terms and a lower bound of what
  // the operators before their cut must still add) are cut before the fronts are thinned, so the
  // thinning drops fewer of those that can (the worst downgrades, 2-3.6x the pinned optimum
  // where one search's thinning dropped the optimum's label, docs/planner.md). Where a plan fits
  // already, the searches are priced (GateSearch): at most search.share of the exposed overhead
  // they could remove, in labels at search.seconds_per_label each.
  int labels = 0;
  double search_s = 0;
  bool cut = false;
  if (!best_fits || best.cost.exposed_s > 0) {
    int free_ops = 0;
    for (char pinned_op : pins.pinned) free_ops += pinned_op ? 0 : 1;
    int states = std::clamp(kDowngradeLabels / std::max(1, free_ops), kMinDowngradeLabels, 2048);
    int searches = 1 + kDowngradePasses;
    if (best_fits && search.share > 0 && search.seconds_per_label > 0) {
      const double affordable = search.share * best.cost.exposed_s / search.seconds_per_label;
      if (affordable < states) {
        cut = true;
        states = affordable < kMinDowngradeLabels ? 0 : static_cast<int>(affordable);
        searches = 1;
      } else if (affordable < static_cast<double>(states) * searches) {
        cut = true;
        searches = static_cast<int>(affordable / states);
      }
    }
    const double bound = best_fits ? best.cost.exposed_s : std::numeric_limits<double>::infinity();
    if (states > 0) {
      const auto start = std::chrono::steady_clock::now();
      std::optional<OperatorDpResult> dp =
          OperatorDp(eval, observed_r, budget, bound, options, states, &pins);
      int ran = 1;
      bool exact = dp && dp->exact;
      if (dp) consider(std::move(dp->assignment));
      for (; ran < searches && !exact && best_fits && best.cost.exposed_s > 0; ++ran) {
        std::optional<OperatorDpResult> again =
            OperatorDp(eval, observed_r, budget, best.cost.exposed_s, options, states, &pins);
        if (!again) {  // nothing cheaper
          ++ran;
          break;
        }
        exact = again->exact;
        consider(std::move(again->assignment));
      }
      search_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      labels = states * ran;
    }
  }
  best.search_labels = labels;
  best.search_s = search_s;
  best.search_cut = cut;
  return best;
}

}  // namespace bgl::plan
