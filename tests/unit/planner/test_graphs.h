// Random small stage graphs for the exhaustive-search checks.
#pragma once

#include <random>

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

}  // namespace bgl::plan::testing
