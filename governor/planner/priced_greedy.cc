#include "governor/planner/priced_greedy.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

namespace bgl::plan {

namespace {

// What a unit contributes under one of its options. `mem` excludes block inputs (M0).
struct Terms {
  double mem = 0, local = 0, d2h = 0, h2d = 0, host = 0;
};

// One way to move a unit: a strategy for each of its operators, and what it costs.
struct Option {
  std::vector<Strategy> strategies;  // in the order of Unit::ops
  Terms terms;
};

struct Unit {
  std::vector<int> ops;
  std::vector<int> tensors;     // the movable tensors its operators save (no block inputs)
  std::vector<Option> options;  // options[0]: keep
};

// One step along a unit's hull: from option `from` to option `to`.
struct Step {
  int unit = 0, from = 0, to = 0;
  double dmem = 0, dc = 0;
};

// The units of one chunk at one load factor, and the greedy over them.
class Model {
 public:
  Model(const CostEvaluator& eval, double r, double budget, const MitigationOptions& options,
        const Pinned* pinned)
      : eval_(eval), g_(eval.graph()), options_(options), pinned_(pinned) {
    const HardwareProfile& hw = eval.hw();
    const size_t n = g_.ops.size(), nt = g_.tensors.size();
    base_limit_ = budget - g_.M0(r);
    slack_ = 1e-9 * std::max(1.0, budget);
    limit_ = base_limit_ + slack_;
    host_slack_ = 1e-9 * std::max(1.0, options.host_limit_bytes);
    host_limit_ = options.host_limit_bytes < 0 ? -1 : options.host_limit_bytes + host_slack_;
    forward_window_ = hw.copy_overlap * g_.ForwardTime(r);
    backward_window_ = hw.copy_overlap * g_.BackwardTime(r);
    forward_s_.resize(n);
    for (size_t o = 0; o < n; ++o) forward_s_[o] = hw.RerunTime(g_.ops[o].ForwardTime(r));
    tensors_.resize(nt);
    for (size_t t = 0; t < nt; ++t) {
      const SavedTensor& x = g_.tensors[t];
      TensorCost& y = tensors_[t];
      y.bytes = x.Bytes(r);
      y.fp8_bytes = CostEvaluator::Fp8Bytes(y.bytes, x.dtype);
      y.fp8_s = 2 * hw.fp8_cast.Time(y.bytes);
      y.d2h_s = hw.offload.Time(y.bytes);
      y.h2d_s = hw.reload.Time(y.bytes);
      y.copy_host_s = hw.CopyHostTime();
    }
    // Units: the movable operators joined by the movable tensors they save.
    std::vector<int> parent(n);
    std::iota(parent.begin(), parent.end(), 0);
    auto find = [&](int x) {
      while (parent[x] != x) x = parent[x] = parent[parent[x]];
      return x;
    };
    for (const SavedTensor& x : g_.tensors) {
      if (x.block_input) continue;
      for (size_t i = 1; i < x.savers.size(); ++i) parent[find(x.savers[i])] = find(x.savers[0]);
    }
    std::vector<int> index(n, -1);
    unit_of_.assign(n, -1);
    for (size_t o = 0; o < n; ++o) {
      // Allowed(kOffload) is "saves something movable" (recompute may be ruled out alone).
      if (!eval.Allowed(static_cast<int>(o), Strategy::kOffload)) continue;  // nothing movable
      const int root = find(static_cast<int>(o));
      if (index[root] < 0) {
        index[root] = static_cast<int>(units_.size());
        units_.emplace_back();
      }
      unit_of_[o] = index[root];
      units_[index[root]].ops.push_back(static_cast<int>(o));
    }
    for (size_t t = 0; t < nt; ++t) {
      const SavedTensor& x = g_.tensors[t];
      if (x.block_input || x.savers.empty()) continue;
      units_[unit_of_[x.savers[0]]].tensors.push_back(static_cast<int>(t));
    }
    dropped_.assign(nt, 0);
    rerun_.assign(n, 0);
    strategy_.assign(n, Strategy::kKeep);
    for (Unit& u : units_) {
      Options(u);
      if (!u.options.empty()) Add(keep_, u.options[0].terms, 1);
    }
  }

  // Whether every unit has an option (pinned strategies can leave none).
  bool Complete() const {
    for (const Unit& u : units_) {
      if (u.options.empty()) return false;
    }
    return true;
  }

  // Plans a hair below the budget and the host limit instead of a hair above them.
  void Tighten() {
    limit_ = base_limit_ - slack_;
    if (host_limit_ >= 0) host_limit_ = std::max(0.0, options_.host_limit_bytes - host_slack_);
  }

  // A unit state: the option of each unit, and the chunk's terms under it.
  struct State {
    std::vector<int> option;
    Terms total;
  };

  double Cost(const Terms& t) const {
    return t.local + std::max(0.0, t.d2h - forward_window_) +
           std::max(0.0, t.h2d - backward_window_);
  }
  bool CopiesHidden(const Terms& t) const {
    return t.d2h <= forward_window_ && t.h2d <= backward_window_;
  }

  // The greedy at copy prices (mu_d, mu_h) per second: up to two states within the limit.
  void Greedy(double mu_d, double mu_h, std::vector<State>& out) const {
    auto price = [&](const Terms& t) { return t.local + mu_d * t.d2h + mu_h * t.h2d; };
    std::vector<Step> steps;
    for (size_t u = 0; u < units_.size(); ++u) {
      const std::vector<Option>& opts = units_[u].options;
      int cur = 0;
      for (;;) {
        int best = -1;
        double best_slope = 0;
        for (size_t k = 0; k < opts.size(); ++k) {
          const double dmem = opts[cur].terms.mem - opts[k].terms.mem;
          if (dmem <= 0) continue;
          const double slope = (price(opts[k].terms) - price(opts[cur].terms)) / dmem;
          if (best < 0 || slope < best_slope ||
              (slope == best_slope && opts[k].terms.mem < opts[best].terms.mem)) {
            best = static_cast<int>(k);
            best_slope = slope;
          }
        }
        if (best < 0) break;
        steps.push_back({static_cast<int>(u), cur, best, opts[cur].terms.mem - opts[best].terms.mem,
                         price(opts[best].terms) - price(opts[cur].terms)});
        cur = best;
      }
    }
    // Cheapest per byte saved first; ties: the larger saving.
    std::sort(steps.begin(), steps.end(), [](const Step& a, const Step& b) {
      const double x = a.dc * b.dmem, y = b.dc * a.dmem;
      if (x != y) return x < y;
      if (a.dmem != b.dmem) return a.dmem > b.dmem;
      return a.unit < b.unit;
    });
    State s;
    s.option.assign(units_.size(), 0);
    s.total = keep_;
    std::vector<char> frozen(units_.size(), 0);
    std::vector<int> applied;
    for (size_t i = 0; i < steps.size() && s.total.mem > limit_; ++i) {
      const Step& st = steps[i];
      if (frozen[st.unit] || s.option[st.unit] != st.from) continue;
      if (!HostFits(s, st.unit, st.to)) {
        frozen[st.unit] = 1;  // its later steps start from this one
        continue;
      }
      Switch(s, st.unit, st.to);
      applied.push_back(static_cast<int>(i));
    }
    if (s.total.mem > limit_) return;
    // The last step may have saved more than the budget needs: undo the dearest steps that
    // still fit, or replace the last step by the cheapest single move that meets the budget.
    State filled = s;
    UndoFill(steps, applied, filled);
    out.push_back(std::move(filled));
    if (applied.empty()) return;
    const Step& last = steps[applied.back()];
    Switch(s, last.unit, last.from);
    applied.pop_back();
    int best_unit = -1, best_option = -1;
    double best_cost = 0;
    for (size_t u = 0; u < units_.size(); ++u) {
      const std::vector<Option>& opts = units_[u].options;
      const Terms& cur = opts[s.option[u]].terms;
      for (size_t k = 0; k < opts.size(); ++k) {
        const Terms& to = opts[k].terms;
        if (to.mem >= cur.mem || s.total.mem - cur.mem + to.mem > limit_) continue;
        if (!HostFits(s, static_cast<int>(u), static_cast<int>(k))) continue;
        Terms t = s.total;
        Add(t, cur, -1);
        Add(t, to, 1);
        const double c = Cost(t);
        if (best_unit < 0 || c < best_cost) {
          best_unit = static_cast<int>(u);
          best_option = static_cast<int>(k);
          best_cost = c;
        }
      }
    }
    if (best_unit < 0) return;
    Switch(s, best_unit, best_option);
    UndoFill(steps, applied, s);
    out.push_back(std::move(s));
  }

  // Local search in the model: the single switch, or the pair of switches (one unit giving up
  // bytes, another taking them), that lowers the cost most while the budget and the host limit
  // hold, until none does (at most `passes` switches).
  void Improve(State& s, int passes) const {
    const size_t nu = units_.size();
    // A switch of one unit and what it changes.
    struct Move {
      int unit, option;
      Terms delta;
    };
    std::vector<Move> saving;  // the switches that free bytes, most bytes first
    for (int pass = 0; pass < passes; ++pass) {
      saving.clear();
      for (size_t v = 0; v < nu; ++v) {
        const std::vector<Option>& ov = units_[v].options;
        const Terms& cv = ov[s.option[v]].terms;
        for (size_t j = 0; j < ov.size(); ++j) {
          if (ov[j].terms.mem >= cv.mem) continue;
          Move m{static_cast<int>(v), static_cast<int>(j), ov[j].terms};
          Add(m.delta, cv, -1);
          saving.push_back(m);
        }
      }
      std::sort(saving.begin(), saving.end(),
                [](const Move& x, const Move& y) { return x.delta.mem < y.delta.mem; });
      double best = Cost(s.total) - 1e-12;
      int bu = -1, bk = -1, bv = -1, bj = -1;
      for (size_t u = 0; u < nu; ++u) {
        const std::vector<Option>& ou = units_[u].options;
        const Terms& cu = ou[s.option[u]].terms;
        for (size_t k = 0; k < ou.size(); ++k) {
          if (static_cast<int>(k) == s.option[u]) continue;
          Terms t = s.total;
          Add(t, cu, -1);
          Add(t, ou[k].terms, 1);
          if (host_limit_ >= 0 && t.host > host_limit_) continue;
          if (t.mem <= limit_) {
            const double c = Cost(t);
            if (c < best) {
              best = c;
              bu = static_cast<int>(u), bk = static_cast<int>(k), bv = -1;
            }
            continue;
          }
          // Over the budget: another unit must give up the difference.
          for (const Move& m : saving) {
            if (t.mem + m.delta.mem > limit_) break;  // the rest free fewer bytes
            if (m.unit == static_cast<int>(u)) continue;
            Terms w = t;
            Add(w, m.delta, 1);
            if (host_limit_ >= 0 && w.host > host_limit_) continue;
            const double c = Cost(w);
            if (c < best) {
              best = c;
              bu = static_cast<int>(u), bk = static_cast<int>(k);
              bv = m.unit, bj = m.option;
            }
          }
        }
      }
      if (bu < 0) return;
      Switch(s, bu, bk);
      if (bv >= 0) Switch(s, bv, bj);
    }
  }

  // The assignment of a state: every operator outside a unit keeps.
  Assignment ToAssignment(const State& s) const {
    Assignment a(g_.ops.size(), Strategy::kKeep);
    for (size_t o = 0; pinned_ != nullptr && o < a.size(); ++o) {
      if (pinned_->pinned[o]) a[o] = pinned_->strategies[o];
    }
    for (size_t u = 0; u < units_.size(); ++u) {
      const Option& x = units_[u].options[s.option[u]];
      for (size_t i = 0; i < x.strategies.size(); ++i) a[units_[u].ops[i]] = x.strategies[i];
    }
    return a;
  }

 private:
  struct TensorCost {
    double bytes = 0, fp8_bytes = 0, fp8_s = 0, d2h_s = 0, h2d_s = 0, copy_host_s = 0;
  };

  static void Add(Terms& to, const Terms& x, double sign) {
    to.mem += sign * x.mem;
    to.local += sign * x.local;
    to.d2h += sign * x.d2h;
    to.h2d += sign * x.h2d;
    to.host += sign * x.host;
  }
  void Switch(State& s, int u, int to) const {
    Add(s.total, units_[u].options[s.option[u]].terms, -1);
    Add(s.total, units_[u].options[to].terms, 1);
    s.option[u] = to;
  }
  bool HostFits(const State& s, int u, int to) const {
    if (host_limit_ < 0) return true;
    const double host =
        s.total.host - units_[u].options[s.option[u]].terms.host + units_[u].options[to].terms.host;
    return host <= host_limit_;
  }
  void UndoFill(const std::vector<Step>& steps, const std::vector<int>& applied, State& s) const {
    for (size_t i = applied.size(); i-- > 0;) {
      const Step& st = steps[applied[i]];
      if (s.option[st.unit] != st.to || s.total.mem + st.dmem > limit_) continue;
      if (!HostFits(s, st.unit, st.from)) continue;
      Switch(s, st.unit, st.from);
    }
  }

  // The unit's options: every conflict-free combination of its operators' strategies when there
  // are at most kEnumerated, else each strategy for all of them (an operator that may not take it
  // recomputes, or keeps) and those with one operator changed. Options another option dominates
  // (no more bytes, seconds or host bytes) are dropped; keep-all is options[0].
  void Options(Unit& u) {
    constexpr size_t kEnumerated = 256;
    const size_t k = u.ops.size();
    std::vector<std::vector<Strategy>> choices(k);
    size_t count = 1;
    for (size_t i = 0; i < k; ++i) {
      const int o = u.ops[i];
      if (pinned_ != nullptr && pinned_->pinned[o]) {
        choices[i].push_back(pinned_->strategies[o]);
      } else {
        for (Strategy x : kAllStrategies) {
          if (options_.Permits(x) && eval_.Allowed(o, x)) choices[i].push_back(x);
        }
      }
      count = std::min(kEnumerated + 1, count * choices[i].size());
    }
    // The combinations, k strategies each, flat; keep-all first.
    std::vector<Strategy>& flat = combos_;
    flat.clear();
    if (count <= kEnumerated) {
      std::vector<size_t> digit(k, 0);
      for (;;) {
        for (size_t i = 0; i < k; ++i) flat.push_back(choices[i][digit[i]]);
        size_t i = 0;
        for (; i < k && ++digit[i] == choices[i].size(); ++i) digit[i] = 0;
        if (i == k) break;
      }
    } else {
      for (size_t i = 0; i < k; ++i) flat.push_back(choices[i][0]);  // keep, or the pinned one
      for (Strategy x : kAllStrategies) {
        std::vector<Strategy> c(k);
        for (size_t i = 0; i < k; ++i) {
          const auto& ci = choices[i];
          c[i] = std::find(ci.begin(), ci.end(), x) != ci.end() ? x
                 : std::find(ci.begin(), ci.end(), Strategy::kRecompute) != ci.end()
                     ? Strategy::kRecompute
                     : ci[0];
        }
        flat.insert(flat.end(), c.begin(), c.end());
        for (size_t i = 0; i < k; ++i) {
          for (Strategy y : choices[i]) {
            if (y == c[i]) continue;
            flat.insert(flat.end(), c.begin(), c.end());
            flat[flat.size() - k + i] = y;
          }
        }
      }
    }
    const size_t combos = flat.size() / k;
    std::vector<Terms>& terms = terms_;
    std::vector<char> valid(combos, 0);
    terms.resize(combos);
    for (size_t c = 0; c < combos; ++c) valid[c] = Measure(u, &flat[c * k], terms[c]);
    // Combination 0 is keep-all (pinned operators as pinned): it stays whatever else ties with it.
    for (size_t i = 0; i < combos; ++i) {
      if (!valid[i]) continue;
      bool dominated = false;
      for (size_t j = 0; j < combos && !dominated && i > 0; ++j) {
        if (j == i || !valid[j]) continue;
        const Terms &a = terms[j], &b = terms[i];
        const bool no_worse = a.mem <= b.mem && a.local <= b.local && a.d2h <= b.d2h &&
                              a.h2d <= b.h2d && a.host <= b.host;
        const bool equal = a.mem == b.mem && a.local == b.local && a.d2h == b.d2h &&
                           a.h2d == b.h2d && a.host == b.host;
        dominated = no_worse && (!equal || j < i);
      }
      if (!dominated) {
        u.options.push_back({std::vector<Strategy>(flat.begin() + static_cast<long>(i * k),
                                                   flat.begin() + static_cast<long>((i + 1) * k)),
                             terms[i]});
      }
    }
  }

  // The unit's terms under `strategies`, every other unit kept; false on a conflict.
  bool Measure(const Unit& u, const Strategy* strategies, Terms& terms) {
    terms = Terms();
    for (size_t i = 0; i < u.ops.size(); ++i) strategy_[u.ops[i]] = strategies[i];
    std::vector<int>& pending = pending_;
    pending.clear();
    bool conflict = false;
    for (int t : u.tensors) {
      unsigned mask = 0;
      for (int s : g_.tensors[t].savers) {
        const Strategy x = strategy_[s];
        if (x != Strategy::kRecompute) mask |= 1u << static_cast<unsigned>(x);
      }
      const TensorCost& y = tensors_[t];
      if ((mask & (mask - 1)) != 0) {
        conflict = true;
      } else if (mask == 0) {
        dropped_[t] = 1;
        pending.push_back(t);
      } else if (mask & (1u << static_cast<unsigned>(Strategy::kOffload))) {
        terms.d2h += y.d2h_s;
        terms.h2d += y.h2d_s;
        terms.local += y.copy_host_s;
        terms.host += y.bytes;
      } else if (mask & (1u << static_cast<unsigned>(Strategy::kFp8))) {
        terms.mem += y.fp8_bytes;
        terms.local += y.fp8_s;
      } else {
        terms.mem += y.bytes;
      }
    }
    if (conflict) pending.clear();
    // The recompute closure: producers of dropped tensors rerun, and so, recursively, do the
    // producers of their inputs that nothing retains.
    std::vector<int>& reran = reran_;
    reran.clear();
    while (!pending.empty()) {
      const int t = pending.back();
      pending.pop_back();
      const int q = g_.tensors[t].producer;
      if (q < 0 || rerun_[q]) continue;
      rerun_[q] = 1;
      reran.push_back(q);
      terms.local += forward_s_[q];
      for (int in : g_.ops[q].inputs) {
        const SavedTensor& x = g_.tensors[in];
        const bool retained =
            x.block_input || x.producer < 0 || (!x.savers.empty() && !dropped_[in]);
        if (!retained && !rerun_[x.producer]) pending.push_back(in);
      }
    }
    for (int q : reran) rerun_[q] = 0;
    for (int t : u.tensors) dropped_[t] = 0;
    return !conflict;
  }

  const CostEvaluator& eval_;
  const StageGraph& g_;
  const MitigationOptions& options_;
  const Pinned* pinned_;  // null: nothing pinned
  double base_limit_ = 0, slack_ = 0, limit_ = 0, host_slack_ = 0, host_limit_ = -1;
  double forward_window_ = 0, backward_window_ = 0;
  std::vector<double> forward_s_;
  std::vector<TensorCost> tensors_;
  std::vector<Unit> units_;
  std::vector<int> unit_of_;
  Terms keep_;  // every unit kept
  std::vector<char> dropped_, rerun_;
  std::vector<Strategy> strategy_;    // scratch for Measure: every operator outside it keeps
  std::vector<int> pending_, reran_;  // scratch for Measure
  std::vector<Strategy> combos_;      // scratch for Options
  std::vector<Terms> terms_;          // scratch for Options
};

}  // namespace

namespace {

// The model's candidates, cheapest by the model first (the cheapest also improved, first).
std::vector<Model::State> Candidates(const Model& model, const Deadline* deadline) {
  std::vector<Model::State> states;
  model.Greedy(0, 0, states);
  bool exposed = false;
  for (const Model::State& s : states) exposed |= !model.CopiesHidden(s.total);
  if (exposed) {
    // Full exposure, and the copy price at which the offloads just fit their windows.
    model.Greedy(1, 1, states);
    double lo = 0, hi = 1;
    for (int i = 0; i < 10; ++i) {
      if (deadline != nullptr) deadline->Check();
      const double mid = 0.5 * (lo + hi);
      const size_t before = states.size();
      model.Greedy(mid, mid, states);
      bool hidden = states.size() > before;
      for (size_t k = before; k < states.size(); ++k) hidden &= model.CopiesHidden(states[k].total);
      (hidden ? hi : lo) = mid;
    }
  }
  std::stable_sort(states.begin(), states.end(), [&](const Model::State& a, const Model::State& b) {
    return model.Cost(a.total) < model.Cost(b.total);
  });
  if (!states.empty() && model.Cost(states[0].total) > 0) {
    Model::State improved = states[0];
    model.Improve(improved, 8);
    states.insert(states.begin(), std::move(improved));
  }
  return states;
}

}  // namespace

std::optional<Assignment> PricedGreedy(const CostEvaluator& eval, double r, double budget,
                                       const MitigationOptions& options, const Pinned* pinned) {
  Model model(eval, r, budget, options, pinned);
  if (!model.Complete()) return std::nullopt;
  // The model adds bytes in another order than the evaluator: a candidate exactly at the budget
  // may be a hair over it there. Then the candidates are made again a hair below the budget.
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (attempt == 1) model.Tighten();
    const std::vector<Model::State> states = Candidates(model, eval.deadline());
    std::optional<Assignment> best;
    double best_cost = 0;
    bool over = false;
    std::vector<Assignment> seen;
    constexpr size_t kChecked = 3;
    for (size_t i = 0; i < states.size() && seen.size() < kChecked; ++i) {
      Assignment a = model.ToAssignment(states[i]);
      if (std::find(seen.begin(), seen.end(), a) != seen.end()) continue;
      seen.push_back(a);
      const AssignmentCost c = eval.Evaluate(a, r);
      if (c.conflict) continue;
      if (c.device_bytes > budget || !options.HostFits(c.host_bytes)) {
        over = true;
        continue;
      }
      if (!best || c.exposed_s < best_cost) {
        best_cost = c.exposed_s;
        best = std::move(a);
      }
    }
    if (best || !over) return best;
  }
  return std::nullopt;
}

}  // namespace bgl::plan
