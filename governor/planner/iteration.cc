#include "governor/planner/iteration.h"

#include <map>
#include <utility>

namespace bgl::plan {

Result<IterationReplay> ReplayIteration(StagePlanner& planner, const std::vector<double>& loads,
                                        const std::function<double(const Plan&)>& actual) {
  const auto& steps = planner.steps();
  const auto& graph = planner.graph();
  const auto micro_batches = static_cast<size_t>(planner.config().MicroBatches());
  if (loads.size() != micro_batches) {
    return InvalidArgument("loads: expected one load factor per micro-batch (" +
                           std::to_string(micro_batches) + "), got " +
                           std::to_string(loads.size()));
  }
  planner.ResetIteration();
  IterationReplay replay;
  std::map<std::pair<int, int>, double> retained;
  std::map<std::pair<int, int>, double> overhead;
  for (size_t i = 0; i < steps.size();) {
    SchedulePoint point;
    const Step& s = steps[i];
    if (s.forward) {
      point.forward_micro_batch = s.micro_batch;
      point.forward_chunk = s.chunk;
      point.load_factor = loads[s.micro_batch];
      // A steady forward shares its point with the next backward, unless that backward is its
      // own (the last rank runs F_x then B_x: two points).
      const bool pair =
          i + 1 < steps.size() && !steps[i + 1].forward && s.phase == Phase::kSteady &&
          !(steps[i + 1].micro_batch == s.micro_batch && steps[i + 1].chunk == s.chunk);
      if (pair) {
        point.backward_micro_batch = steps[i + 1].micro_batch;
        point.backward_chunk = steps[i + 1].chunk;
        i += 2;
      } else {
        i += 1;
      }
    } else {
      point.backward_micro_batch = s.micro_batch;
      point.backward_chunk = s.chunk;
      i += 1;
    }
    auto plan = planner.PlanPoint(point);
    if (!plan.ok()) return plan.status();
    if (plan->micro_batch >= 0) {
      const double bytes = actual ? actual(*plan) : static_cast<double>(plan->predicted_bytes);
      BGL_RETURN_IF_ERROR(
          planner.Report(plan->micro_batch, plan->chunk, static_cast<int64_t>(bytes)));
      retained[{plan->micro_batch, plan->chunk}] = bytes;
      overhead[{plan->micro_batch, plan->chunk}] = plan->overhead_s;
      replay.infeasible_points += plan->infeasible ? 1 : 0;
      replay.fallbacks += plan->fallback_full_recompute ? 1 : 0;
      replay.overhead_s += plan->overhead_s;
    }
    replay.plans.push_back(std::move(*plan));
  }
  replay.planned = BuildIterationCurve(steps, [&](const Step& s) {
    const double r = loads[s.micro_batch];
    UnitCost c;
    c.retained_bytes = retained[{s.micro_batch, s.chunk}];
    c.forward_s = graph.ForwardTime(r);
    c.backward_s = graph.BackwardTime(r) + overhead[{s.micro_batch, s.chunk}];
    return c;
  });
  replay.keep_all = BuildIterationCurve(steps, [&](const Step& s) {
    const double r = loads[s.micro_batch];
    return UnitCost{graph.KeepAllBytes(r), graph.ForwardTime(r), graph.BackwardTime(r)};
  });
  return replay;
}

}  // namespace bgl::plan
