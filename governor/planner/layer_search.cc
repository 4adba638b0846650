#include "governor/planner/layer_search.h"

#include <algorithm>
#include <numeric>
#include <utility>

namespace bgl::plan {

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

constexpr Strategy kAll[] = {Strategy::kKeep, Strategy::kRecompute, Strategy::kOffload,
                             Strategy::kFp8};

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
        x.inputs != y.inputs || x.saves != y.saves) {
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
};

bool Dominates(const Terms& a, const Terms& b) {
  return a.mem <= b.mem && a.local <= b.local && a.d2h <= b.d2h && a.h2d <= b.h2d;
}

// Keeps the items no other item dominates (one of equal ones). T has a `terms` member.
template <typename T>
void ParetoPrune(std::vector<T>& items) {
  std::sort(items.begin(), items.end(), [](const T& a, const T& b) {
    if (a.terms.mem != b.terms.mem) return a.terms.mem < b.terms.mem;
    if (a.terms.local != b.terms.local) return a.terms.local < b.terms.local;
    if (a.terms.d2h != b.terms.d2h) return a.terms.d2h < b.terms.d2h;
    return a.terms.h2d < b.terms.h2d;
  });
  size_t kept = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    bool dominated = false;
    for (size_t k = 0; k < kept && !dominated; ++k) {
      dominated = Dominates(items[k].terms, items[i].terms);
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

// The block's candidate assignments, Pareto-pruned.
std::vector<Candidate> BlockCandidates(const StageGraph& sub, const CostEvaluator& parent, double r,
                                       const MitigationOptions& options) {
  CostEvaluator eval(sub, parent.hw());
  eval.set_deadline(parent.deadline());
  const double m0 = sub.M0(r);
  std::vector<Candidate> out;
  auto add = [&](const Assignment& a) {
    const AssignmentCost c = eval.Evaluate(a, r);
    if (c.conflict) return;
    out.push_back({{c.device_bytes - m0, c.recompute_s + c.fp8_s, c.d2h_s, c.h2d_s}, a});
  };
  const size_t n = sub.ops.size();
  std::vector<std::vector<Strategy>> choices(n);
  double count = 1;
  for (size_t o = 0; o < n; ++o) {
    for (Strategy s : kAll) {
      if (Permitted(options, s) && eval.Allowed(static_cast<int>(o), s)) choices[o].push_back(s);
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
    Assignment a(n, Strategy::kKeep);
    std::vector<size_t> digit(n, 0);
    while (true) {
      if (!conflict(a)) add(a);
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
  ParetoPrune(out);
  return out;
}

// A combination of candidates of the blocks seen so far.
struct State {
  Terms terms;
  int parent = -1;     // state of the previous block
  int candidate = -1;  // candidate of this block
};

double Overhead(const Terms& t, double forward_s, double backward_s) {
  return t.local + std::max(0.0, t.d2h - forward_s) + std::max(0.0, t.h2d - backward_s);
}

// Past options.max_layer_states a Pareto front (sorted by memory) is cut and the search is no
// longer exact: the least memory (feasibility) stays, then the lowest overheads so far
// (overheads only grow as blocks are added).
template <typename T>
void CapFront(std::vector<T>& front, const MitigationOptions& options, double forward_s,
              double backward_s) {
  const size_t cap = static_cast<size_t>(std::max(2, options.max_layer_states));
  if (front.size() <= cap) return;
  std::stable_sort(front.begin() + 1, front.end(), [&](const T& a, const T& b) {
    return Overhead(a.terms, forward_s, backward_s) < Overhead(b.terms, forward_s, backward_s);
  });
  front.resize(cap);
}

}  // namespace

std::optional<Assignment> LayerSearch(const CostEvaluator& eval, double r, double budget,
                                      const MitigationOptions& options) {
  const StageGraph& g = eval.graph();
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
                                         : BlockCandidates(graphs[b], eval, r, options));
    if (candidates.back().empty()) return std::nullopt;
    CapFront(candidates.back(), options, 0, 0);
  }
  // Bytes the blocks may hold beyond the block inputs, and the least the remaining blocks need.
  const double limit = budget - g.M0(r);
  const double slack = 1e-9 * std::max(1.0, budget);
  std::vector<double> least_after(blocks.size() + 1, 0);
  for (size_t b = blocks.size(); b-- > 0;) {
    double least = candidates[b].front().terms.mem;
    for (const Candidate& c : candidates[b]) least = std::min(least, c.terms.mem);
    least_after[b] = least_after[b + 1] + least;
  }
  const double forward_s = g.ForwardTime(r), backward_s = g.BackwardTime(r);
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
                   prev[s].terms.d2h + t.d2h, prev[s].terms.h2d + t.h2d};
        if (x.terms.mem + least_after[b + 1] > limit + slack) continue;
        x.parent = static_cast<int>(s);
        x.candidate = static_cast<int>(c);
        next.push_back(x);
      }
    }
    if (next.empty()) return std::nullopt;
    ParetoPrune(next);
    CapFront(next, options, forward_s, backward_s);
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
    if (!c.conflict && c.device_bytes <= budget) return a;
  }
  return std::nullopt;
}

}  // namespace bgl::plan
