// Assignments of mitigation strategies to operators and what they cost (docs/algorithms.md sec. 2):
// device bytes per tensor from the strategies of its savers, conflicts, the recompute closure,
// and the time overhead of each strategy's roofline.
#pragma once

#include <cstdint>
#include <vector>

#include "governor/planner/deadline.h"
#include "governor/planner/hardware.h"
#include "governor/planner/stage_graph.h"

namespace bgl::plan {

// What happens to the tensors an operator saves.
enum class Strategy : uint8_t { kKeep, kRecompute, kOffload, kFp8 };
constexpr int kStrategyCount = 4;
inline constexpr Strategy kAllStrategies[] = {Strategy::kKeep, Strategy::kRecompute,
                                              Strategy::kOffload, Strategy::kFp8};
const char* StrategyName(Strategy s);

// One strategy per operator of a StageGraph, in graph order.
using Assignment = std::vector<Strategy>;

// Where a tensor lives between its forward and its backward.
enum class Placement : uint8_t { kDevice, kFp8, kHost, kDropped, kConflict };
const char* PlacementName(Placement p);

// Memory and time of a micro-batch under an assignment, at one load factor.
struct AssignmentCost {
  double device_bytes = 0;  // retained on device (the micro-batch's activation memory)
  double host_bytes = 0;    // offloaded to pinned host
  double recompute_s = 0;   // the recompute closure's reruns (RerunTime), in backward
  double fp8_s = 0;         // casts in forward plus uncasts in backward
  double d2h_s = 0;         // offload copies (copy engine)
  double h2d_s = 0;         // reload copies (copy engine)
  double copy_host_s = 0;   // the host backend's fixed cost of those copies (training thread)
  double exposed_s = 0;     // added to the micro-batch when copies overlap its own compute
  bool conflict = false;
  int conflict_tensor = -1;
};

// Evaluates assignments of one graph; cheap enough to call thousands of times per plan.
class CostEvaluator {
 public:
  CostEvaluator(const StageGraph& graph, const HardwareProfile& hw);

  AssignmentCost Evaluate(const Assignment& a, double r) const;
  Placement TensorPlacement(const Assignment& a, int tensor) const;
  // Operators rerun in backward (the closure of section 2), flagged per operator.
  std::vector<char> RecomputeClosure(const Assignment& a) const;
  // Bytes of a tensor stored as FP8 e4m3 with one FP32 scale per 128 elements.
  static double Fp8Bytes(double bytes, DType dtype);

  const StageGraph& graph() const { return graph_; }
  const HardwareProfile& hw() const { return hw_; }
  // True when `s` can be applied to operator `op` (e.g. no FP8 for the router).
  bool Allowed(int op, Strategy s) const;
  // The planning call's deadline (null: none); Evaluate checks it, so every loop that evaluates
  // assignments stops when it expires (deadline.h).
  void set_deadline(const Deadline* deadline) { deadline_ = deadline; }
  const Deadline* deadline() const { return deadline_; }

 private:
  const StageGraph& graph_;
  const HardwareProfile& hw_;
  const Deadline* deadline_ = nullptr;
};

}  // namespace bgl::plan
