// Replays one iteration of a stage through a StagePlanner as the runtime drives it: one
// scheduling point per warmup forward, per steady F/B pair and per cooldown backward.
#pragma once

#include <functional>
#include <vector>

#include "governor/planner/cost_model.h"
#include "governor/planner/planner.h"

namespace bgl::plan {

// The plans of an iteration and the memory curves they imply.
struct IterationReplay {
  std::vector<Plan> plans;  // one per scheduling point, in order
  IterationCurve planned;   // activation memory with the plans applied
  IterationCurve keep_all;  // the same loads with every activation kept
  int infeasible_points = 0;
  int fallbacks = 0;
  double overhead_s = 0;  // sum of the plans' exposed overheads
};

// `loads[mb]` is micro-batch mb's load factor (the worst GPU's of the stage). `actual`, when
// given, returns the bytes a forward really retained (default: the plan's prediction), which is
// reported back so later budgets re-base on it.
Result<IterationReplay> ReplayIteration(StagePlanner& planner, const std::vector<double>& loads,
                                        const std::function<double(const Plan&)>& actual = nullptr);

}  // namespace bgl::plan
