#include "governor/planner/layer_search.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <utility>

namespace bgl::plan {

namespace {

// Operators linked through a tensor other than a block input (its producer, savers and
// readers) share a block: the tensor's placement and the recompute closure never cross blocks.
std::vector<std::vector<int>> Blocks(const StageGraph& g) {
  std::vector<int> parent(g.ops.size());
  std::iota(parent.begin(), parent.end(), 0);
  auto find = [&](int x) {
    while (parent[x] != x) x = parent[x] = parent[parent[x]];
    return x;
  };
  std::vector<int> first(g.tensors.size(), -1);  // an operator touching each tensor
  auto link = [&](int t, int op) {
    if (g.tensors[t].block_input) return;
    if (first[t] < 0) {
      first[t] = op;
    } else {
      parent[find(op)] = find(first[t]);
    }
  };
  for (size_t o = 0; o < g.ops.size(); ++o) {
    for (int t : g.ops[o].inputs) link(t, static_cast<int>(o));
    for (int t : g.ops[o].saves) link(t, static_cast<int>(o));
  }
  for (size_t t = 0; t < g.tensors.size(); ++t) {
    if (g.tensors[t].producer >= 0) link(static_cast<int>(t), g.tensors[t].producer);
  }
  std::vector<std::vector<int>> blocks;
  std::vector<int> index(g.ops.size(), -1);
  for (size_t o = 0; o < g.ops.size(); ++o) {
    const int root = find(static_cast<int>(o));
    if (index[root] < 0) {
      index[root] = static_cast<int>(blocks.size());
      blocks.emplace_back();
    }
    blocks[index[root]].push_back(static_cast<int>(o));
  }
  return blocks;
}

// The operators of one block (in graph order) and the tensors they touch, as a graph of its own.
// Tensors produced outside the block are block inputs or have no producer in the chunk.
StageGraph Subgraph(const StageGraph& g, const std::vector<int>& ops) {
  std::vector<int> op_map(g.ops.size(), -1);
  for (size_t i = 0; i < ops.size(); ++i) op_map[ops[i]] = static_cast<int>(i);
  std::vector<int> tensor_map(g.tensors.size(), -1);
  StageGraph sub;
  sub.layers = 1;
  sub.forward_window_scale = g.forward_window_scale;
  sub.backward_window_scale = g.backward_window_scale;
  auto map_tensor = [&](int t) {
    if (tensor_map[t] < 0) {
      SavedTensor copy = g.tensors[t];
      copy.savers.clear();
      copy.producer = copy.producer >= 0 ? op_map[copy.producer] : -1;
      tensor_map[t] = static_cast<int>(sub.tensors.size());
      sub.tensors.push_back(std::move(copy));
    }
    return tensor_map[t];
  };
  for (int o : ops) {
    Operator op = g.ops[o];
    for (int& t : op.inputs) t = map_tensor(t);
    for (int& t : op.saves) t = map_tensor(t);
    sub.ops.push_back(std::move(op));
  }
  // Graph order is kept, so producers still run before their savers.
  (void)sub.Finalize();
  return sub;
}

// Same operators and tensors up to names: the blocks of replicated layers.
bool SameShape(const StageGraph& a, const StageGraph& b) {
  if (a.ops.size() != b.ops.size() || a.tensors.size() != b.tensors.size()) return false;
  for (size_t i = 0; i < a.ops.size(); ++i) {
    const Operator &x = a.ops[i], &y = b.ops[i];
    if (x.kind != y.kind || x.forward_s != y.forward_s || x.backward_s != y.backward_s ||
        x.scales_with_load != y.scales_with_load || x.fp8_allowed != y.fp8_allowed ||
        x.recompute_allowed != y.recompute_allowed || x.inputs != y.inputs || x.saves != y.saves) {
      return false;
    }
  }
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const SavedTensor &x = a.tensors[i], &y = b.tensors[i];
    if (x.bytes != y.bytes || x.dtype != y.dtype || x.producer != y.producer ||
        x.scales_with_load != y.scales_with_load || x.block_input != y.block_input) {
      return false;
    }
  }
  return true;
}

// What one block contributes under one of its assignments. `mem` excludes block inputs.
struct Terms {
  double mem = 0;    // device bytes
  double local = 0;  // recompute + FP8 seconds
  double d2h = 0;    // offload copy seconds
  double h2d = 0;    // reload copy seconds
  double host = 0;   // offloaded bytes (compared only under a host limit)
};

double Overhead(const Terms& t, double forward_s, double backward_s) {
  return t.local + std::max(0.0, t.d2h - forward_s) + std::max(0.0, t.h2d - backward_s);
}

bool Dominates(const Terms& a, const Terms& b, bool with_host) {
  return a.mem <= b.mem && a.local <= b.local && a.d2h <= b.d2h && a.h2d <= b.h2d &&
         (!with_host || a.host <= b.host);
}

// Keeps the items no other item dominates (one of equal ones). T has a `terms` member.
template <typename T>
void ParetoPrune(std::vector<T>& items, bool with_host) {
  std::sort(items.begin(), items.end(), [](const T& a, const T& b) {
    if (a.terms.mem != b.terms.mem) return a.terms.mem < b.terms.mem;
    if (a.terms.local != b.terms.local) return a.terms.local < b.terms.local;
    if (a.terms.d2h != b.terms.d2h) return a.terms.d2h < b.terms.d2h;
    if (a.terms.h2d != b.terms.h2d) return a.terms.h2d < b.terms.h2d;
    return a.terms.host < b.terms.host;
  });
  size_t kept = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    bool dominated = false;
    for (size_t k = 0; k < kept && !dominated; ++k) {
      dominated = Dominates(items[k].terms, items[i].terms, with_host);
    }
    if (!dominated) {
      if (kept != i) items[kept] = std::move(items[i]);
      ++kept;
    }
  }
  items.resize(kept);
}

struct Candidate {
  Terms terms;
  Assignment assignment;  // over the block's operators
};

// Terms of a block's assignments for the enumeration: the cost model of CostEvaluator::Evaluate
// (placements, FP8 and copy rooflines, the recompute closure) with everything that does not
// depend on the assignment computed once and no allocation per call.
class BlockTermsEvaluator {
 public:
  BlockTermsEvaluator(const StageGraph& sub, const HardwareProfile& hw, double r) : sub_(sub) {
    tensors_.resize(sub.tensors.size());
    for (size_t t = 0; t < sub.tensors.size(); ++t) {
      const SavedTensor& x = sub.tensors[t];
      TensorTerms& y = tensors_[t];
      const double bytes = x.Bytes(r);
      y.bytes = bytes;
      y.fp8_bytes = CostEvaluator::Fp8Bytes(bytes, x.dtype);
      y.fp8_s = 2 * hw.fp8_cast.Time(bytes);
      y.d2h_s = hw.offload.Time(bytes);
      y.h2d_s = hw.reload.Time(bytes);
      y.copy_host_s = hw.CopyHostTime();
      y.always_retained = x.block_input || x.producer < 0;
    }
    forward_s_.resize(sub.ops.size());
    for (size_t o = 0; o < sub.ops.size(); ++o)
      forward_s_[o] = hw.RerunTime(sub.ops[o].ForwardTime(r));
    retained_.resize(sub.tensors.size());
    rerun_.resize(sub.ops.size());
  }

  // False on a conflict.
  bool Measure(const Assignment& a, Terms& out) {
    Terms terms;
    for (size_t t = 0; t < tensors_.size(); ++t) {
      const SavedTensor& x = sub_.tensors[t];
      const TensorTerms& y = tensors_[t];
      unsigned mask = 0;
      for (int s : x.savers) {
        if (a[s] != Strategy::kRecompute) mask |= 1u << static_cast<unsigned>(a[s]);
      }
      retained_[t] = y.always_retained || mask != 0;
      if (x.block_input || mask == 0) continue;
      if ((mask & (mask - 1)) != 0) return false;
      if (mask & (1u << static_cast<unsigned>(Strategy::kKeep))) {
        terms.mem += y.bytes;
      } else if (mask & (1u << static_cast<unsigned>(Strategy::kOffload))) {
        terms.d2h += y.d2h_s;
        terms.h2d += y.h2d_s;
        terms.local += y.copy_host_s;
        terms.host += y.bytes;
      } else {
        terms.mem += y.fp8_bytes;
        terms.local += y.fp8_s;
      }
    }
    std::fill(rerun_.begin(), rerun_.end(), 0);
    bool any = false;
    for (size_t o = 0; o < a.size(); ++o) {
      if (a[o] != Strategy::kRecompute) continue;
      for (int t : sub_.ops[o].saves) {
        if (!retained_[t] && sub_.tensors[t].producer >= 0) {
          rerun_[sub_.tensors[t].producer] = 1;
          any = true;
        }
      }
    }
    // Rerunning an operator regenerates the inputs nobody retains: to a fixed point.
    for (bool changed = any; changed;) {
      changed = false;
      for (size_t o = a.size(); o-- > 0;) {
        if (!rerun_[o]) continue;
        for (int u : sub_.ops[o].inputs) {
          const int p = sub_.tensors[u].producer;
          if (!retained_[u] && p >= 0 && !rerun_[p]) {
            rerun_[p] = 1;
            changed = true;
          }
        }
      }
    }
    if (any) {
      for (size_t o = 0; o < a.size(); ++o) {
        if (rerun_[o]) terms.local += forward_s_[o];
      }
    }
    out = terms;
    return true;
  }

 private:
  struct TensorTerms {
    double bytes = 0, fp8_bytes = 0, fp8_s = 0, d2h_s = 0, h2d_s = 0, copy_host_s = 0;
    bool always_retained = false;
  };
  const StageGraph& sub_;
  std::vector<TensorTerms> tensors_;
  std::vector<double> forward_s_;
  std::vector<char> retained_;
  std::vector<char> rerun_;
};

// The block's candidate assignments that may still beat `bound`.
std::vector<Candidate> BlockCandidates(const StageGraph& sub, const CostEvaluator& parent, double r,
                                       double bound, double forward_s, double backward_s,
                                       const MitigationOptions& options) {
  CostEvaluator eval(sub, parent.hw());
  eval.set_deadline(parent.deadline());
  const double m0 = sub.M0(r);
  std::vector<Candidate> out;
  auto add = [&](const Assignment& a) {
    const AssignmentCost c = eval.Evaluate(a, r);
    if (c.conflict || !options.HostFits(c.host_bytes)) return;
    out.push_back({{c.device_bytes - m0, c.recompute_s + c.fp8_s + c.copy_host_s, c.d2h_s, c.h2d_s,
                    c.host_bytes},
                   a});
  };
  const size_t n = sub.ops.size();
  std::vector<std::vector<Strategy>> choices(n);
  double count = 1;
  for (size_t o = 0; o < n; ++o) {
    for (Strategy s : kAllStrategies) {
      if (options.Permits(s) && eval.Allowed(static_cast<int>(o), s)) choices[o].push_back(s);
    }
    count *= static_cast<double>(choices[o].size());
  }
  if (count <= options.exact_layer_assignments) {
    // Every assignment of the block, as a mixed-radix counter. Tensors with several savers
    // are checked for a conflict first: that skips the evaluation of most assignments.
    std::vector<const std::vector<int>*> shared;
    for (const SavedTensor& t : sub.tensors) {
      if (!t.block_input && t.savers.size() > 1) shared.push_back(&t.savers);
    }
    auto conflict = [&](const Assignment& a) {
      for (const std::vector<int>* savers : shared) {
        Strategy seen = Strategy::kRecompute;
        for (int s : *savers) {
          if (a[s] == Strategy::kRecompute) continue;
          if (seen != Strategy::kRecompute && a[s] != seen) return true;
          seen = a[s];
        }
      }
      return false;
    };
    BlockTermsEvaluator terms_of(sub, parent.hw(), r);
    const Deadline* deadline = parent.deadline();
    Assignment a(n, Strategy::kKeep);
    std::vector<size_t> digit(n, 0);
    for (uint64_t visited = 0;; ++visited) {
      if ((visited & 255) == 0 && deadline != nullptr) deadline->Check();
      Terms t;
      if (!conflict(a) && terms_of.Measure(a, t) && options.HostFits(t.host) &&
          Overhead(t, forward_s, backward_s) < bound) {
        out.push_back({t, a});
      }
      size_t o = 0;
      for (; o < n; ++o) {
        if (++digit[o] < choices[o].size()) {
          a[o] = choices[o][digit[o]];
          break;
        }
        digit[o] = 0;
        a[o] = choices[o][0];
      }
      if (o == n) break;
    }
  } else {
    // Too many to list: the assignments greedy runs on the block alone pass through, down to M0
    // with each strategy family and to intermediate budgets with all of them.
    std::vector<Assignment> seen;
    MitigationOptions plain = options;
    plain.layer_search = false;
    std::vector<MitigationOptions> variants = {plain};
    if (plain.allow_offload && (plain.allow_recompute || plain.allow_fp8)) {
      variants.push_back(plain);
      variants.back().allow_offload = false;
    }
    if (plain.allow_recompute && (plain.allow_offload || plain.allow_fp8)) {
      variants.push_back(plain);
      variants.back().allow_recompute = false;
    }
    for (const MitigationOptions& v : variants) (void)GreedyMitigation(eval, r, m0, v, &seen);
    const double keep = sub.KeepAllBytes(r);
    for (double f : {0.25, 0.5, 0.75}) {
      (void)GreedyMitigation(eval, r, m0 + f * (keep - m0), plain, &seen);
    }
    for (const Assignment& a : seen) add(a);
  }
  return out;
}

// A combination of candidates of the blocks seen so far.
struct State {
  Terms terms;
  int parent = -1;     // state of the previous block
  int candidate = -1;  // candidate of this block
};

// Keeps what may still lead to an answer cheaper than `bound` (overheads only grow as blocks are
// added): the Pareto front when it is small, else the front of (bytes, overhead so far), which is
// no longer exact. Past options.max_layer_states the front is cut: the least bytes stay
// (feasibility), then the lowest overheads.
template <typename T>
void Reduce(std::vector<T>& items, double bound, double forward_s, double backward_s,
            const MitigationOptions& options) {
  auto overhead = [&](const T& x) { return Overhead(x.terms, forward_s, backward_s); };
  std::erase_if(items, [&](const T& x) { return overhead(x) >= bound; });
  constexpr size_t kExactFront = 1024;
  if (items.size() <= kExactFront) {
    ParetoPrune(items, options.host_limit_bytes >= 0);
  } else {
    std::sort(items.begin(), items.end(), [&](const T& a, const T& b) {
      return a.terms.mem != b.terms.mem ? a.terms.mem < b.terms.mem : overhead(a) < overhead(b);
    });
    size_t kept = 0;
    double least = bound;
    for (size_t i = 0; i < items.size(); ++i) {
      const double o = overhead(items[i]);
      if (o < least) {
        least = o;
        if (kept != i) items[kept] = std::move(items[i]);
        ++kept;
      }
    }
    items.resize(kept);
  }
  const size_t cap = static_cast<size_t>(std::max(2, options.max_layer_states));
  if (items.size() <= cap) return;
  std::stable_sort(items.begin() + 1, items.end(),
                   [&](const T& a, const T& b) { return overhead(a) < overhead(b); });
  items.resize(cap);
}

}  // namespace

std::optional<Assignment> LayerSearch(const CostEvaluator& eval, double r, double budget,
                                      double bound, const MitigationOptions& options) {
  const StageGraph& g = eval.graph();
  // The compute the copies hide under (none where they are synchronous: copy_overlap 0).
  const double overlap = eval.hw().copy_overlap;
  const double forward_s = overlap * g.ForwardTime(r), backward_s = overlap * g.BackwardTime(r);
  std::vector<std::vector<int>> blocks = Blocks(g);
  std::vector<StageGraph> graphs;
  std::vector<std::vector<Candidate>> candidates;
  std::vector<int> same_as(blocks.size(), -1);  // an earlier block of the same shape
  for (size_t b = 0; b < blocks.size(); ++b) {
    graphs.push_back(Subgraph(g, blocks[b]));
    for (size_t e = 0; e < b && same_as[b] < 0; ++e) {
      if (same_as[e] < 0 && SameShape(graphs[e], graphs[b])) same_as[b] = static_cast<int>(e);
    }
    candidates.push_back(same_as[b] >= 0 ? candidates[same_as[b]]
                                         : BlockCandidates(graphs[b], eval, r, bound, forward_s,
                                                           backward_s, options));
    Reduce(candidates.back(), bound, forward_s, backward_s, options);
    if (candidates.back().empty()) return std::nullopt;
  }
  // Bytes the blocks may hold beyond the block inputs, and the least the remaining blocks need.
  const double limit = budget - g.M0(r);
  const double slack = 1e-9 * std::max(1.0, budget);
  const double host_limit = options.host_limit_bytes;
  const double host_slack = 1e-9 * std::max(1.0, host_limit);
  std::vector<double> least_after(blocks.size() + 1, 0);
  for (size_t b = blocks.size(); b-- > 0;) {
    double least = candidates[b].front().terms.mem;
    for (const Candidate& c : candidates[b]) least = std::min(least, c.terms.mem);
    least_after[b] = least_after[b + 1] + least;
  }
  std::vector<std::vector<State>> layers(blocks.size() + 1);
  layers[0].push_back({});
  for (size_t b = 0; b < blocks.size(); ++b) {
    std::vector<State>& next = layers[b + 1];
    const std::vector<State>& prev = layers[b];
    for (size_t s = 0; s < prev.size(); ++s) {
      if (eval.deadline() != nullptr) eval.deadline()->Check();
      for (size_t c = 0; c < candidates[b].size(); ++c) {
        const Terms& t = candidates[b][c].terms;
        State x;
        x.terms = {prev[s].terms.mem + t.mem, prev[s].terms.local + t.local,
                   prev[s].terms.d2h + t.d2h, prev[s].terms.h2d + t.h2d,
                   prev[s].terms.host + t.host};
        if (x.terms.mem + least_after[b + 1] > limit + slack ||
            (options.host_limit_bytes >= 0 && x.terms.host > host_limit + host_slack) ||
            Overhead(x.terms, forward_s, backward_s) >= bound) {
          continue;
        }
        x.parent = static_cast<int>(s);
        x.candidate = static_cast<int>(c);
        next.push_back(x);
      }
    }
    if (next.empty()) return std::nullopt;
    Reduce(next, bound, forward_s, backward_s, options);
  }
  // Cheapest final states first; the first that the full evaluator confirms wins (the sums
  // above add in another order, so a state exactly at the budget is checked again).
  const std::vector<State>& last = layers.back();
  std::vector<int> order(last.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    return Overhead(last[a].terms, forward_s, backward_s) <
           Overhead(last[b].terms, forward_s, backward_s);
  });
  constexpr size_t kChecked = 8;
  for (size_t i = 0; i < order.size() && i < kChecked; ++i) {
    Assignment a(g.ops.size(), Strategy::kKeep);
    int s = order[i];
    for (size_t b = blocks.size(); b-- > 0;) {
      const State& st = layers[b + 1][s];
      const Assignment& local = candidates[b][st.candidate].assignment;
      for (size_t k = 0; k < blocks[b].size(); ++k) a[blocks[b][k]] = local[k];
      s = st.parent;
    }
    const AssignmentCost c = eval.Evaluate(a, r);
    if (!c.conflict && c.device_bytes <= budget && options.HostFits(c.host_bytes)) return a;
  }
  return std::nullopt;
}

}  // namespace bgl::plan
