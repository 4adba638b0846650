// Random small stage graphs for the exhaustive-search checks.
#pragma once

#include <algorithm>
#include <random>
#include <string>

#include "governor/planner/stage_graph.h"

namespace bgl::plan::testing {

// A chain of `n` operators over one layer: operator i reads the output of i-1 (and sometimes an
// earlier tensor too, so tensors have several savers), some operators are communication, and
// some tensors scale with load. Tensor 0 is the block input.
inline StageGraph RandomGraph(std::mt19937& rng, int n) {
  std::uniform_real_distribution<double> time(1e-5, 2e-3);
  std::uniform_int_distribution<int64_t> bytes(1 << 20, 256 << 20);
  std::bernoulli_distribution coin(0.3);
  StageGraph g;
  g.layers = 1;
  SavedTensor input;
  input.name = "input";
  input.bytes = bytes(rng) / 4;
  input.block_input = true;
  g.tensors.push_back(input);
  for (int i = 0; i < n; ++i) {
    Operator o;
    o.name = "op" + std::to_string(i);
    o.kind = (i > 0 && coin(rng)) ? OpKind::kDispatch : OpKind::kLinear;
    if (o.kind == OpKind::kDispatch) o.kind = coin(rng) ? OpKind::kDispatch : OpKind::kNorm;
    o.forward_s = time(rng);
    o.backward_s = 2 * o.forward_s;
    o.scales_with_load = coin(rng);
    o.fp8_allowed = !coin(rng) || i == 0;
    const int last = static_cast<int>(g.tensors.size()) - 1;
    o.inputs.push_back(last);
    if (!o.IsComm()) o.saves.push_back(last);
    if (last > 1 && coin(rng)) {
      std::uniform_int_distribution<int> earlier(1, last - 1);
      const int t = earlier(rng);
      o.inputs.push_back(t);
      o.saves.push_back(t);
    }
    g.ops.push_back(o);
    SavedTensor out;
    out.name = "t" + std::to_string(i);
    out.bytes = bytes(rng);
    out.producer = i;
    out.scales_with_load = o.scales_with_load;
    out.dtype = coin(rng) ? DType::kFP32 : DType::kBF16;
    g.tensors.push_back(out);
  }
  Status s = g.Finalize();
  (void)s;
  return g;
}

// One edge case for the exhaustive-search check (issue 12 item 11): a graph, a load factor and a
// budget, and which families it was drawn from.
struct EdgeCase {
  StageGraph graph;
  double r = 1;
  double budget = 0;
  std::string families;  // e.g. "layers=3 zero-cost ties near-M0"
};

// Draws an edge case. Each family is switched on independently, so combinations occur:
//  - layers: 1 to 4 replicated layers (layer l's input is layer l-1's output, a block input), so
//    a small mitigation can be spread over layers or piled into one;
//  - near-M0: the budget a hair above M0 (0 to 5% of keep-all minus M0), or a hair below keep-all;
//  - zero-cost: about half the operators take no time (free recompute, nothing to hide copies);
//  - tiny: a tiny stage: KiB-sized tensors (copies and casts at their launch floors) and
//    microsecond operators;
//  - exact-fit: the budget is keep-all minus a random subset of the saved tensors;
//  - ties: every tensor the same size and every operator the same time;
//  - uneven: each layer's operator times and tensor sizes scaled by 0.25x to 4x (else the
//    layers are identical).
// At most `max_ops` operators in total, so 4^n assignments can be enumerated.
inline EdgeCase RandomEdgeCase(std::mt19937& rng, int max_ops = 8) {
  std::bernoulli_distribution half(0.5), rare(0.25);
  EdgeCase e;
  const bool near_m0 = half(rng), zero_cost = half(rng), tiny = rare(rng), ties = rare(rng),
             uneven = !ties && half(rng);
  std::uniform_int_distribution<int> layer_count(1, 4);
  const int layers = layer_count(rng);
  std::uniform_int_distribution<int> op_count(1, std::max(1, std::min(4, max_ops / layers)));
  const int k = op_count(rng);
  e.families = "layers=" + std::to_string(layers) + " ops/layer=" + std::to_string(k);
  if (near_m0) e.families += " near-M0";
  if (zero_cost) e.families += " zero-cost";
  if (tiny) e.families += " tiny";
  if (ties) e.families += " ties";
  if (uneven) e.families += " uneven";

  // The layer template: operator i reads tensor i (0: the block input), saves it unless it is
  // communication, sometimes also an earlier tensor (shared savers) or its own output.
  std::uniform_real_distribution<double> time(tiny ? 1e-6 : 1e-5, tiny ? 5e-5 : 2e-3);
  std::uniform_int_distribution<int64_t> bytes(tiny ? 1 << 10 : 1 << 20,
                                               tiny ? 256 << 10 : 256 << 20);
  std::bernoulli_distribution coin(0.3);
  const double tied_time = time(rng);
  const int64_t tied_bytes = bytes(rng);
  struct OpSpec {
    OpKind kind;
    double forward_s;
    bool scales, fp8_allowed, saves_output;
    int extra_saved;  // template tensor index, -1: none
    int64_t out_bytes;
    DType out_dtype;
  };
  std::vector<OpSpec> spec(k);
  const int64_t input_bytes = ties ? tied_bytes : bytes(rng) / 4;
  for (int i = 0; i < k; ++i) {
    OpSpec& s = spec[i];
    s.kind =
        (i > 0 && coin(rng)) ? (coin(rng) ? OpKind::kDispatch : OpKind::kNorm) : OpKind::kLinear;
    s.forward_s = ties ? tied_time : time(rng);
    if (zero_cost && half(rng)) s.forward_s = 0;
    s.scales = coin(rng);
    s.fp8_allowed = !coin(rng) || i == 0;
    s.saves_output = s.kind != OpKind::kDispatch && rare(rng);
    s.extra_saved = -1;
    if (i > 1 && coin(rng)) s.extra_saved = std::uniform_int_distribution<int>(1, i - 1)(rng);
    // The last operator's output is the next layer's input: it has the block input's size.
    s.out_bytes = i == k - 1 ? input_bytes : (ties ? tied_bytes : bytes(rng));
    s.out_dtype = coin(rng) && i != k - 1 ? DType::kFP32 : DType::kBF16;
  }

  StageGraph& g = e.graph;
  g.layers = layers;
  SavedTensor input;
  input.name = "input";
  input.bytes = input_bytes;
  input.block_input = true;
  g.tensors.push_back(input);
  int block_input = 0;
  std::uniform_real_distribution<double> jitter(0.25, 4.0);
  for (int l = 0; l < layers; ++l) {
    std::vector<int> local = {block_input};  // template tensor index -> graph tensor index
    for (int i = 0; i < k; ++i) {
      const OpSpec& s = spec[i];
      Operator o;
      o.name = "L" + std::to_string(l) + ".op" + std::to_string(i);
      o.kind = s.kind;
      o.layer = l;
      o.forward_s = uneven ? s.forward_s * jitter(rng) : s.forward_s;
      o.backward_s = 2 * s.forward_s;
      o.scales_with_load = s.scales;
      o.fp8_allowed = s.fp8_allowed;
      o.inputs.push_back(local[i]);
      if (!o.IsComm()) o.saves.push_back(local[i]);
      if (s.extra_saved >= 0) {
        o.inputs.push_back(local[s.extra_saved]);
        o.saves.push_back(local[s.extra_saved]);
      }
      const int op_index = static_cast<int>(g.ops.size());
      SavedTensor out;
      out.name = "L" + std::to_string(l) + ".t" + std::to_string(i);
      out.bytes =
          uneven && i != k - 1 ? static_cast<int64_t>(s.out_bytes * jitter(rng)) : s.out_bytes;
      out.producer = op_index;
      out.scales_with_load = s.scales && i != k - 1;
      out.dtype = s.out_dtype;
      // Layer outputs feed the next layer as its block input; the chunk's output leaves.
      out.block_input = i == k - 1 && l != layers - 1;
      g.tensors.push_back(out);
      local.push_back(static_cast<int>(g.tensors.size()) - 1);
      if (s.saves_output) o.saves.push_back(local.back());
      g.ops.push_back(o);
    }
    block_input = local.back();
  }
  Status status = g.Finalize();
  (void)status;

  std::uniform_real_distribution<double> load(0.8, 2.6);
  e.r = half(rng) ? 1.0 : load(rng);
  const double m0 = g.M0(e.r), keep = g.KeepAllBytes(e.r);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  double fraction = unit(rng);
  if (near_m0) {
    constexpr double kNear[] = {0.0, 1e-4, 1e-3, 0.01, 0.05, 0.95, 0.99, 0.999};
    fraction = kNear[std::uniform_int_distribution<int>(0, 7)(rng)];
  }
  e.budget = m0 + fraction * (keep - m0);
  if (!near_m0 && half(rng)) {
    // Exact fit: keep-all minus a random subset of the movable tensors, so some set of moves
    // meets the budget to the byte.
    e.families += " exact-fit";
    e.budget = keep;
    for (const SavedTensor& t : g.tensors) {
      if (!t.block_input && !t.savers.empty() && half(rng)) e.budget -= t.Bytes(e.r);
    }
    e.budget = std::max(e.budget, m0);  // rounding: keep-all minus everything may land below M0
  }
  return e;
}

}  // namespace bgl::plan::testing
