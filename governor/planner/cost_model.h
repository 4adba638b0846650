// The activation cost model of paper IV-A at iteration level: micro-batch costs concatenated
// over the stage's pipeline steps give the activation memory curve and its peak.
#pragma once

#include <functional>
#include <vector>

#include "governor/planner/pipeline_schedule.h"

namespace bgl::plan {

// Cost of one micro-batch of one chunk under its plan.
struct UnitCost {
  double retained_bytes = 0;  // activation memory held from its forward to its backward
  double forward_s = 0;
  double backward_s = 0;
};

// A point of the activation memory curve: bytes held at the end of a step.
struct CurvePoint {
  double time_s = 0;
  double bytes = 0;
  int step = 0;
};

// The iteration's activation memory curve (piecewise linear between points).
struct IterationCurve {
  std::vector<CurvePoint> points;
  double peak_bytes = 0;
  int peak_step = -1;
  double time_s = 0;
};

// Walks `steps`: a forward adds its micro-batch's retained bytes over its duration, a backward
// releases them. `cost` is asked once per step.
IterationCurve BuildIterationCurve(const std::vector<Step>& steps,
                                   const std::function<UnitCost(const Step&)>& cost);

}  // namespace bgl::plan
