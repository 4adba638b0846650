#include "governor/planner/assignment.h"

#include <algorithm>
#include <cmath>

namespace bgl::plan {

const char* StrategyName(Strategy s) {
  switch (s) {
    case Strategy::kKeep:
      return "keep";
    case Strategy::kRecompute:
      return "recompute";
    case Strategy::kOffload:
      return "offload";
    case Strategy::kFp8:
      return "fp8";
  }
  return "?";
}

const char* PlacementName(Placement p) {
  switch (p) {
    case Placement::kDevice:
      return "device";
    case Placement::kFp8:
      return "fp8";
    case Placement::kHost:
      return "host";
    case Placement::kDropped:
      return "dropped";
    case Placement::kConflict:
      return "conflict";
  }
  return "?";
}

CostEvaluator::CostEvaluator(const StageGraph& graph, const HardwareProfile& hw)
    : graph_(graph), hw_(hw) {}

double CostEvaluator::Fp8Bytes(double bytes, DType dtype) {
  const double elements = bytes / DTypeBytes(dtype);
  return elements + std::ceil(elements / 128.0) * 4.0;
}

bool CostEvaluator::Allowed(int op, Strategy s) const {
  const Operator& o = graph_.ops[op];
  if (s == Strategy::kKeep) return true;
  // An operator that saves nothing movable has nothing to mitigate.
  bool movable = false;
  bool fp8_source = false;
  for (int t : o.saves) {
    const SavedTensor& tensor = graph_.tensors[t];
    if (tensor.block_input) continue;
    movable = true;
    if (tensor.dtype != DType::kFP8) fp8_source = true;
  }
  if (!movable) return false;
  if (s == Strategy::kFp8) return o.fp8_allowed && fp8_source;
  if (s == Strategy::kRecompute) return o.recompute_allowed;
  return true;
}

namespace {

// Bit set of the non-recompute strategies of a tensor's savers.
unsigned SaverMask(const StageGraph& g, const Assignment& a, int tensor) {
  unsigned mask = 0;
  for (int s : g.tensors[tensor].savers) {
    if (a[s] != Strategy::kRecompute) mask |= 1u << static_cast<unsigned>(a[s]);
  }
  return mask;
}

}  // namespace

Placement CostEvaluator::TensorPlacement(const Assignment& a, int tensor) const {
  if (graph_.tensors[tensor].block_input) return Placement::kDevice;
  const unsigned mask = SaverMask(graph_, a, tensor);
  if (mask == 0) return Placement::kDropped;
  if ((mask & (mask - 1)) != 0) return Placement::kConflict;  // two or more bits set
  if (mask & (1u << static_cast<unsigned>(Strategy::kKeep))) return Placement::kDevice;
  if (mask & (1u << static_cast<unsigned>(Strategy::kOffload))) return Placement::kHost;
  return Placement::kFp8;
}

std::vector<char> CostEvaluator::RecomputeClosure(const Assignment& a) const {
  const auto& g = graph_;
  std::vector<char> rerun(g.ops.size(), 0);
  std::vector<char> queued(g.tensors.size(), 0);
  std::vector<int> pending;
  auto retained = [&](int t) {
    return g.tensors[t].block_input || g.tensors[t].producer < 0 || SaverMask(g, a, t) != 0;
  };
  // Tensors a recomputing saver drops that no other saver keeps must be regenerated.
  for (size_t o = 0; o < g.ops.size(); ++o) {
    if (a[o] != Strategy::kRecompute) continue;
    for (int t : g.ops[o].saves) {
      if (!retained(t) && !queued[t]) {
        queued[t] = 1;
        pending.push_back(t);
      }
    }
  }
  while (!pending.empty()) {
    const int t = pending.back();
    pending.pop_back();
    const int p = g.tensors[t].producer;
    if (p < 0 || rerun[p]) continue;
    rerun[p] = 1;
    for (int u : g.ops[p].inputs) {
      if (!retained(u) && !queued[u]) {
        queued[u] = 1;
        pending.push_back(u);
      }
    }
  }
  return rerun;
}

AssignmentCost CostEvaluator::Evaluate(const Assignment& a, double r) const {
  if (deadline_ != nullptr) deadline_->Check();
  AssignmentCost c;
  const auto& g = graph_;
  for (size_t t = 0; t < g.tensors.size(); ++t) {
    const SavedTensor& tensor = g.tensors[t];
    if (tensor.savers.empty() && !tensor.block_input) continue;
    const double bytes = tensor.Bytes(r);
    switch (TensorPlacement(a, static_cast<int>(t))) {
      case Placement::kDevice:
        c.device_bytes += bytes;
        break;
      case Placement::kConflict:
        // Two precisions or a device copy beside an offload: at least the full tensor stays.
        c.device_bytes += bytes;
        if (!c.conflict) c.conflict_tensor = static_cast<int>(t);
        c.conflict = true;
        break;
      case Placement::kFp8:
        c.device_bytes += Fp8Bytes(bytes, tensor.dtype);
        c.fp8_s += 2 * hw_.fp8_cast.Time(bytes);
        break;
      case Placement::kHost:
        c.host_bytes += bytes;
        c.d2h_s += hw_.offload.Time(bytes);
        c.h2d_s += hw_.reload.Time(bytes);
        c.copy_host_s += hw_.CopyHostTime();
        break;
      case Placement::kDropped:
        break;
    }
  }
  bool any_recompute = false;
  for (Strategy s : a) any_recompute |= s == Strategy::kRecompute;
  if (any_recompute) {
    const auto rerun = RecomputeClosure(a);
    for (size_t o = 0; o < g.ops.size(); ++o) {
      if (rerun[o]) c.recompute_s += hw_.RerunTime(g.ops[o].ForwardTime(r));
    }
  }
  // Copies hide under the chunk's compute as far as the machine overlaps them (copy engines: all
  // of it; the host backend's synchronous copies: none).
  c.exposed_s = c.recompute_s + c.fp8_s + c.copy_host_s +
                std::max(0.0, c.d2h_s - hw_.copy_overlap * g.ForwardTime(r)) +
                std::max(0.0, c.h2d_s - hw_.copy_overlap * g.BackwardTime(r));
  return c;
}

}  // namespace bgl::plan
