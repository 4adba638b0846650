// Small multi-layer chunks for the first answer against the exact reference (issue 43): 2 or 3
// layers of 4 to 6 operators each, at the magnitudes of a GPU (MiB-sized tensors, operators of
// tens of microseconds to milliseconds, the H200's copy bandwidth or a tenth of it), so the copy
// windows are sometimes ample, sometimes binding. Plain values; build them on any thread.
#pragma once

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "governor/planner/hardware.h"
#include "governor/planner/stage_graph.h"

namespace bgl::plan::testing {

struct SmallChunk {
  StageGraph graph;
  HardwareProfile hw;
  double r = 1;
  double budget = 0;
  std::string label;
};

// One chunk: a layer template replicated over the layers (each layer's times and sizes jittered
// when `uneven`). Operator i of a layer reads tensor i of the layer (0: its block input) and
// saves it unless it is communication; some also save an earlier tensor (shared savers) or their
// own output; the last operator's output is the next layer's block input. Budgets: M0, near M0,
// keep-all minus a random subset of the tensors, near keep-all, uniform (by `family`).
inline SmallChunk RandomSmallChunk(std::mt19937& rng, int family) {
  std::bernoulli_distribution half(0.5), third(0.3), rare(0.15);
  SmallChunk x;
  x.hw = *HardwareProfileByName("h200");
  const bool slow = half(rng);  // copies at a tenth of the H200's: windows bind more often
  if (slow) {
    x.hw.offload.peak_bytes_per_s /= 10;
    x.hw.reload.peak_bytes_per_s /= 10;
  }
  const int layers = std::uniform_int_distribution<int>(2, 3)(rng);
  const int k = std::uniform_int_distribution<int>(4, 6)(rng);
  const bool uneven = half(rng);
  std::uniform_real_distribution<double> log_time(std::log(1e-5), std::log(2e-3));
  std::uniform_real_distribution<double> log_bytes(std::log(1 << 20), std::log(256 << 20));
  std::uniform_real_distribution<double> jitter(0.5, 2.0);
  struct Spec {
    OpKind kind;
    double forward_s;
    bool scales, fp8_allowed, saves_output;
    int extra;  // an earlier template tensor it also saves, -1: none
    double out_bytes;
    DType dtype;
  };
  std::vector<Spec> spec(k);
  const double input_bytes = std::exp(log_bytes(rng)) / 4;
  for (int i = 0; i < k; ++i) {
    Spec& s = spec[i];
    s.kind = i > 0 && third(rng) ? (half(rng) ? OpKind::kDispatch : OpKind::kNorm)
                                 : (half(rng) ? OpKind::kLinear : OpKind::kExpertLinear);
    s.forward_s = std::exp(log_time(rng));
    s.scales = third(rng);
    s.fp8_allowed = !rare(rng);
    s.saves_output = s.kind != OpKind::kDispatch && rare(rng);
    s.extra = i > 1 && third(rng) ? std::uniform_int_distribution<int>(1, i - 1)(rng) : -1;
    s.out_bytes = i == k - 1 ? input_bytes : std::exp(log_bytes(rng));
    s.dtype = i != k - 1 && rare(rng) ? DType::kFP32 : DType::kBF16;
  }
  x.label = std::to_string(layers) + "x" + std::to_string(k) + (uneven ? " uneven" : "") +
            (slow ? " slow-copies" : "");
  StageGraph& g = x.graph;
  g.layers = layers;
  SavedTensor input;
  input.name = "input";
  input.bytes = static_cast<int64_t>(input_bytes);
  input.block_input = true;
  g.tensors.push_back(input);
  int block_input = 0;
  for (int l = 0; l < layers; ++l) {
    const double jt = uneven ? jitter(rng) : 1.0, jb = uneven ? jitter(rng) : 1.0;
    std::vector<int> local = {block_input};
    for (int i = 0; i < k; ++i) {
      const Spec& s = spec[i];
      Operator o;
      o.name = "L" + std::to_string(l) + ".op" + std::to_string(i);
      o.kind = s.kind;
      o.layer = l;
      o.forward_s = s.forward_s * jt;
      o.backward_s = (o.IsComm() ? 1.0 : 2.0) * o.forward_s;
      o.scales_with_load = s.scales;
      o.fp8_allowed = s.fp8_allowed;
      o.inputs.push_back(local[i]);
      if (!o.IsComm()) o.saves.push_back(local[i]);
      if (s.extra >= 0) {
        o.inputs.push_back(local[s.extra]);
        o.saves.push_back(local[s.extra]);
      }
      SavedTensor out;
      out.name = "L" + std::to_string(l) + ".t" + std::to_string(i);
      out.bytes = static_cast<int64_t>(i == k - 1 ? s.out_bytes : s.out_bytes * jb);
      out.producer = static_cast<int>(g.ops.size());
      out.scales_with_load = s.scales && i != k - 1;
      out.dtype = s.dtype;
      out.block_input = i == k - 1 && l != layers - 1;
      g.tensors.push_back(out);
      local.push_back(static_cast<int>(g.tensors.size()) - 1);
      if (s.saves_output) o.saves.push_back(local.back());
      g.ops.push_back(o);
    }
    block_input = local.back();
  }
  (void)g.Finalize();
  constexpr double kLoads[] = {1.0, 1.0, 1.3, 1.6, 2.0, 2.6};
  x.r = kLoads[std::uniform_int_distribution<int>(0, 5)(rng)];
  const double m0 = g.M0(x.r), keep = g.KeepAllBytes(x.r);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  constexpr double kNear[] = {1e-3, 0.01, 0.05};
  const double near = kNear[std::uniform_int_distribution<int>(0, 2)(rng)];
  switch (family % 5) {
    case 0:
      x.budget = m0;
      x.label += " budget=M0";
      break;
    case 1:
      x.budget = m0 + near * (keep - m0);
      x.label += " budget=near-M0";
      break;
    case 2:
      x.budget = keep;
      for (const SavedTensor& t : g.tensors) {
        if (!t.block_input && !t.savers.empty() && unit(rng) < 0.4) x.budget -= t.Bytes(x.r);
      }
      x.budget = std::max(x.budget, m0);
      x.label += " budget=keep-all-minus-subset";
      break;
    case 3:
      x.budget = keep - near * (keep - m0);
      x.label += " budget=near-keep-all";
      break;
    default:
      x.budget = m0 + unit(rng) * (keep - m0);
      x.label += " budget=uniform";
  }
  x.label += " r=" + std::to_string(x.r);
  return x;
}

}  // namespace bgl::plan::testing
