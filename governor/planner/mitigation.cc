#include "governor/planner/mitigation.h"

#include <algorithm>
#include <array>
#include <limits>
#include <string>

#include "governor/planner/units.h"

namespace bgl::plan {

Assignment FullRecompute(const CostEvaluator& eval) {
  Assignment a(eval.graph().ops.size(), Strategy::kKeep);
  for (size_t o = 0; o < a.size(); ++o) {
    if (eval.Allowed(static_cast<int>(o), Strategy::kRecompute)) a[o] = Strategy::kRecompute;
  }
  return a;
}

namespace {

bool Permitted(const MitigationOptions& opt, Strategy s) {
  switch (s) {
    case Strategy::kRecompute:
      return opt.allow_recompute;
    case Strategy::kOffload:
      return opt.allow_offload;
    case Strategy::kFp8:
      return opt.allow_fp8;
    case Strategy::kKeep:
      return true;
  }
  return false;
}

constexpr Strategy kMitigations[] = {Strategy::kRecompute, Strategy::kOffload, Strategy::kFp8};

}  // namespace

Result<MitigationResult> SelectMitigation(const CostEvaluator& eval, double r, double budget,
                                          const MitigationOptions& options) {
  const StageGraph& g = eval.graph();
  const double m0 = g.M0(r);
  if (!(budget >= m0)) {
    return InvalidArgument("budget " + FormatBytes(budget) + " is below M0 = " + FormatBytes(m0) +
                           " (activation memory under full recompute); no plan can meet it");
  }
  const size_t n = g.ops.size();
  MitigationResult result;
  result.budget = budget;
  result.assignment.assign(n, Strategy::kKeep);
  result.cost = eval.Evaluate(result.assignment, r);
  // dropped[o][s]: candidate (o, s) was rejected for a conflict and is never retried.
  std::vector<std::array<bool, kStrategyCount>> dropped(n);
  for (auto& d : dropped) d.fill(false);
  std::vector<int> applied;

  while (result.cost.device_bytes > budget) {
    // Re-evaluate every remaining candidate on the current assignment. Each operator offers its
    // roofline-best strategy: most bytes saved per second of added overhead, at this size.
    int best_op = -1;
    Strategy best_s = Strategy::kKeep;
    double best_gain = 0, best_overhead = 0;
    AssignmentCost best_cost;
    for (size_t o = 0; o < n; ++o) {
      if (result.assignment[o] != Strategy::kKeep) continue;
      int op_s = -1;
      double op_gain = 0, op_overhead = 0, op_rate = -1;
      AssignmentCost op_cost;
      for (Strategy s : kMitigations) {
        if (!Permitted(options, s) || !eval.Allowed(static_cast<int>(o), s)) continue;
        if (dropped[o][static_cast<int>(s)]) continue;
        result.assignment[o] = s;
        const AssignmentCost c = eval.Evaluate(result.assignment, r);
        result.assignment[o] = Strategy::kKeep;
        const double gain = result.cost.device_bytes - c.device_bytes;
        const double overhead = std::max(0.0, c.exposed_s - result.cost.exposed_s);
        const double rate = gain / std::max(overhead, 1e-9);
        if (gain > 0 && rate > op_rate) {
          op_s = static_cast<int>(s);
          op_gain = gain;
          op_overhead = overhead;
          op_rate = rate;
          op_cost = c;
        }
      }
      if (op_s < 0) continue;
      if (op_gain > best_gain ||
          (op_gain == best_gain && best_op >= 0 && op_overhead < best_overhead)) {
        best_op = static_cast<int>(o);
        best_s = static_cast<Strategy>(op_s);
        best_gain = op_gain;
        best_overhead = op_overhead;
        best_cost = op_cost;
      }
    }
    if (best_op < 0) break;
    ++result.rounds;
    if (best_cost.conflict) {
      // Skip rather than undo: the earlier choice it conflicts with had the larger gain.
      dropped[best_op][static_cast<int>(best_s)] = true;
      ++result.rejected_conflicts;
      continue;
    }
    result.assignment[best_op] = best_s;
    result.cost = best_cost;
    applied.push_back(best_op);
  }

  if (result.cost.device_bytes > budget) {
    result.assignment = FullRecompute(eval);
    result.cost = eval.Evaluate(result.assignment, r);
    result.fallback_full_recompute = true;
    applied.clear();
  }

  if (options.refine && !applied.empty()) {
    // Undo choices that the budget no longer needs, most expensive first.
    bool changed = true;
    while (changed) {
      changed = false;
      int undo = -1;
      double undo_saving = 0;
      AssignmentCost undo_cost;
      for (int o : applied) {
        if (result.assignment[o] == Strategy::kKeep) continue;
        const Strategy was = result.assignment[o];
        result.assignment[o] = Strategy::kKeep;
        const AssignmentCost c = eval.Evaluate(result.assignment, r);
        result.assignment[o] = was;
        const double saving = result.cost.exposed_s - c.exposed_s;
        if (!c.conflict && c.device_bytes <= budget && saving > undo_saving) {
          undo = o;
          undo_saving = saving;
          undo_cost = c;
        }
      }
      if (undo >= 0) {
        result.assignment[undo] = Strategy::kKeep;
        result.cost = undo_cost;
        changed = true;
      }
    }
  }
  result.fits = result.cost.device_bytes <= budget;
  return result;
}

MitigationResult ReplanAfterGate(const CostEvaluator& eval, const Assignment& planned,
                                 int gate_layer, double observed_r, double budget) {
  const StageGraph& g = eval.graph();
  MitigationResult result;
  result.budget = budget;
  result.assignment = planned;
  result.cost = eval.Evaluate(planned, observed_r);
  if (result.cost.device_bytes > budget) {
    for (size_t o = 0; o < g.ops.size(); ++o) {
      const Operator& op = g.ops[o];
      if (op.layer >= gate_layer && IsMoeBlock(op.kind) &&
          eval.Allowed(static_cast<int>(o), Strategy::kRecompute)) {
        result.assignment[o] = Strategy::kRecompute;
      }
    }
    result.cost = eval.Evaluate(result.assignment, observed_r);
    result.fallback_full_recompute = true;
  }
  result.fits = result.cost.device_bytes <= budget;
  return result;
}

}  // namespace bgl::plan
