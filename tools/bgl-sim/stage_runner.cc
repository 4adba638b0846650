#include "tools/bgl-sim/stage_runner.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <tuple>
#include <utility>

#include "tools/bgl-sim/static_plan.h"

namespace bgl::sim {
namespace {

size_t Chunks(const plan::StagePlanner& p) { return static_cast<size_t>(p.config().Chunks()); }

// Per-iteration totals that do not depend on the policy.
void FillCommon(const plan::StagePlanner& p, StageIteration& out) {
  out.rank = p.options().pipeline_rank;
  out.capacity_bytes = p.activation_capacity();
  out.useful_flops = 3.0 * p.graph().ForwardFlops(1.0) *
                     static_cast<double>(p.config().MicroBatches() * p.config().Chunks());
}

}  // namespace

// The schedule of `chains` under `exec`: dual-batch issues `recorded` (a plan's own order), or
// where that is empty the DP's order, and says so in *reordered (may be null).
PointSchedule Schedule(const plan::Chains& chains, ExecModel exec,
                       std::vector<plan::IssueItem> recorded, bool trace, bool* reordered) {
  switch (exec) {
    case ExecModel::kSerial:
      return ScheduleSerial(chains, trace);
    case ExecModel::kLockstep:
      return ScheduleRounds(LockstepItems(chains), trace);
    case ExecModel::kDualBatch:
      break;
  }
  if (recorded.empty()) {
    recorded = DualBatchItems(chains);
    if (reordered != nullptr) *reordered = true;
  }
  return ScheduleRounds(recorded, trace);
}

void WalkPoints(const std::vector<PointRef>& points, const std::vector<PointSchedule>& schedules,
                const std::vector<std::vector<double>>& bytes, bool trace, StageIteration& out) {
  double t = 0;
  double used = 0;
  if (trace) out.memory.push_back({0, 0});
  for (size_t i = 0; i < points.size(); ++i) {
    const PointRef& p = points[i];
    const PointSchedule& s = schedules[i];
    if (p.f_mb >= 0) {
      used += bytes[p.f_mb][p.f_chunk];
      if (trace) out.memory.push_back({t + s.forward_end_s, used});
      if (used > out.peak_bytes) out.peak_bytes = used;
      if (used > out.capacity_bytes && out.first_over_s < 0) out.first_over_s = t + s.duration_s;
    }
    if (p.b_mb >= 0) {
      used -= bytes[p.b_mb][p.b_chunk];
      if (trace) out.memory.push_back({t + s.duration_s, std::max(0.0, used)});
    }
    if (trace) {
      for (Interval iv : s.intervals) {
        iv.point = static_cast<int>(i);
        iv.start_s += t;
        iv.end_s += t;
        out.timeline.push_back(std::move(iv));
      }
    }
    t += s.duration_s;
  }
  out.busy_s = t;
}

StaticStageRunner::StaticStageRunner(std::unique_ptr<plan::StagePlanner> planner, ExecModel exec)
    : planner_(std::move(planner)), exec_(exec) {
  assignment_ = plan::FullRecompute(planner_->evaluator());
  points_ = GroupPoints(planner_->steps());
}

Result<StageIteration> StaticStageRunner::Run(const std::vector<double>& loads, bool trace) {
  const plan::CostEvaluator& eval = planner_->evaluator();
  const size_t mbs = static_cast<size_t>(planner_->config().MicroBatches());
  if (loads.size() != mbs) return InvalidArgument("loads: one load factor per micro-batch needed");
  StageIteration out;
  FillCommon(*planner_, out);
  std::vector<std::vector<double>> bytes(mbs, std::vector<double>(Chunks(*planner_)));
  for (size_t mb = 0; mb < mbs; ++mb) {
    const double device = eval.Evaluate(assignment_, loads[mb]).device_bytes;
    std::fill(bytes[mb].begin(), bytes[mb].end(), device);
    out.recompute_flops +=
        RecomputeFlops(eval, assignment_, loads[mb]) * static_cast<double>(Chunks(*planner_));
  }
  std::vector<PointSchedule> schedules;
  schedules.reserve(points_.size());
  for (const PointRef& p : points_) {
    plan::PointUnits units;
    units.offload_chunk_bytes = planner_->options().offload_chunk_bytes;
    if (p.f_mb >= 0) units.forward = &assignment_, units.forward_r = loads[p.f_mb];
    if (p.b_mb >= 0) units.backward = &assignment_, units.backward_r = loads[p.b_mb];
    if (p.o_mb >= 0) units.offload = &assignment_, units.offload_r = loads[p.o_mb];
    if (p.r_mb >= 0) units.recover = &assignment_, units.recover_r = loads[p.r_mb];
    schedules.push_back(Schedule(plan::BuildChains(eval, units), exec_, {}, trace, nullptr));
  }
  WalkPoints(points_, schedules, bytes, trace, out);
  return out;
}

DynamicStageRunner::DynamicStageRunner(std::unique_ptr<plan::StagePlanner> planner, ExecModel exec)
    : planner_(std::move(planner)), exec_(exec) {
  points_ = GroupPoints(planner_->steps());
}

Result<StageIteration> DynamicStageRunner::Run(const std::vector<double>& loads, bool trace) {
  const size_t mbs = static_cast<size_t>(planner_->config().MicroBatches());
  if (loads.size() != mbs) return InvalidArgument("loads: one load factor per micro-batch needed");
  StageIteration out;
  FillCommon(*planner_, out);
  std::vector<std::vector<double>> bytes(mbs, std::vector<double>(Chunks(*planner_)));
  std::vector<PointSchedule> schedules;
  schedules.reserve(points_.size());
  std::chrono::steady_clock::duration planning{};
  planner_->ResetIteration();
  for (const PointRef& p : points_) {
    plan::SchedulePoint point;
    point.forward_micro_batch = p.f_mb;
    point.forward_chunk = p.f_chunk;
    point.backward_micro_batch = p.b_mb;
    point.backward_chunk = p.b_chunk;
    // The gate runs before any load-dependent activation is allocated, so the plan sees the
    // observed load of the forward (docs/algorithms.md sec. 3, deferred planning).
    point.load_factor = p.f_mb >= 0 ? loads[p.f_mb] : 1.0;
    const auto start = std::chrono::steady_clock::now();
    auto plan = planner_->PlanPoint(point);
    if (plan.ok() && plan->micro_batch >= 0) {
      // The simulated GPU retains exactly what the cost model predicts.
      Status reported = planner_->Report(plan->micro_batch, plan->chunk, plan->predicted_bytes);
      if (!reported.ok()) return reported;
    }
    planning += std::chrono::steady_clock::now() - start;
    if (!plan.ok()) return plan.status();
    if (plan->micro_batch >= 0) {
      bytes[plan->micro_batch][plan->chunk] = static_cast<double>(plan->predicted_bytes);
      out.recompute_flops +=
          RecomputeFlops(planner_->evaluator(), plan->strategies, plan->load_factor);
      out.fallbacks += plan->fallback_full_recompute ? 1 : 0;
      out.infeasible += plan->infeasible ? 1 : 0;
    }
    schedules.push_back(exec_ == ExecModel::kSerial
                            ? ScheduleSerial(ChainsFromItems(plan->issue_order), trace)
                            : ScheduleRounds(plan->issue_order, trace));
  }
  out.planning_wall_s = std::chrono::duration<double>(planning).count();
  WalkPoints(points_, schedules, bytes, trace, out);
  return out;
}

std::vector<plan::IssueItem> RecordedItems(const plan::Chains& chains,
                                           const std::vector<ServedIssueItem>& order) {
  std::array<int, plan::kChainCount> next{};
  std::array<int, plan::kChainCount> last_round{};
  last_round.fill(-1);
  std::vector<plan::IssueItem> items;
  for (const ServedIssueItem& o : order) {
    const int c = static_cast<int>(o.chain);
    if (o.stage != next[c] || o.stage >= static_cast<int>(chains[c].size()) ||
        o.round < last_round[c]) {
      return {};
    }
    items.push_back(Item(chains, c, o.stage, o.round));
    ++next[c];
    last_round[c] = o.round;
  }
  for (int c = 0; c < plan::kChainCount; ++c) {
    if (next[c] != static_cast<int>(chains[c].size())) return {};
  }
  // The round model runs rounds in order: sort by round, keeping chain order within one.
  std::stable_sort(
      items.begin(), items.end(),
      [](const plan::IssueItem& a, const plan::IssueItem& b) { return a.round < b.round; });
  return items;
}

ServedStageRunner::ServedStageRunner(std::unique_ptr<plan::StagePlanner> planner, ExecModel exec)
    : planner_(std::move(planner)), exec_(exec) {
  points_ = GroupPoints(planner_->steps());
}

Result<std::unique_ptr<ServedStageRunner>> ServedStageRunner::Create(
    std::unique_ptr<plan::StagePlanner> planner, ExecModel exec, const ServedPlans& plans) {
  std::unique_ptr<ServedStageRunner> r(new ServedStageRunner(std::move(planner), exec));
  r->source_ = plans.source;
  const plan::StageGraph& g = r->planner_->graph();
  const int chunks = static_cast<int>(r->planner_->config().Chunks());
  for (size_t it = 0; it < plans.iterations.size(); ++it) {
    std::map<std::pair<int, int>, Unit> units;
    for (size_t i = 0; i < plans.iterations[it].size(); ++i) {
      const ServedPlan& p = plans.iterations[it][i];
      const std::string where = "plans: " + plans.source + ": iterations[" + std::to_string(it) +
                                "].plans[" + std::to_string(i) + "]";
      if (p.chunk >= chunks) {
        return InvalidArgument(where + ".chunk: " + std::to_string(p.chunk) +
                               " is not a chunk of the model (" + std::to_string(chunks) + ")");
      }
      auto a = ServedAssignment(p, g, where);
      if (!a.ok()) return a.status();
      units[{p.micro_batch, p.chunk}] = Unit{std::move(*a), p.load_factor, p.issue_order};
    }
    r->iterations_.push_back(std::move(units));
  }
  return r;
}

Result<StageIteration> ServedStageRunner::Run(const std::vector<double>& /*loads*/, bool trace) {
  if (next_ >= iterations_.size()) {
    return InvalidArgument("plans: " + source_ + " has " + std::to_string(iterations_.size()) +
                           " iteration(s); no more to replay");
  }
  const size_t it = next_++;
  const auto& units = iterations_[it];
  const plan::CostEvaluator& eval = planner_->evaluator();
  const size_t mbs = static_cast<size_t>(planner_->config().MicroBatches());
  StageIteration out;
  FillCommon(*planner_, out);
  auto unit = [&](int mb, int chunk) -> Result<const Unit*> {
    auto found = units.find({mb, chunk});
    if (found == units.end()) {
      return InvalidArgument("plans: " + source_ + ": iterations[" + std::to_string(it) +
                             "] has no plan for micro-batch " + std::to_string(mb) + " chunk " +
                             std::to_string(chunk));
    }
    return &found->second;
  };
  std::vector<std::vector<double>> bytes(mbs, std::vector<double>(Chunks(*planner_)));
  std::vector<PointSchedule> schedules;
  schedules.reserve(points_.size());
  for (const PointRef& p : points_) {
    plan::PointUnits u;
    u.offload_chunk_bytes = planner_->options().offload_chunk_bytes;
    const Unit* forward = nullptr;
    for (auto [mb, chunk, a, r] : {std::tuple{p.f_mb, p.f_chunk, &u.forward, &u.forward_r},
                                   std::tuple{p.b_mb, p.b_chunk, &u.backward, &u.backward_r},
                                   std::tuple{p.o_mb, p.o_chunk, &u.offload, &u.offload_r},
                                   std::tuple{p.r_mb, p.r_chunk, &u.recover, &u.recover_r}}) {
      if (mb < 0) continue;
      auto found = unit(mb, chunk);
      if (!found.ok()) return found.status();
      *a = &(*found)->assignment;
      *r = (*found)->load;
      if (a == &u.forward) forward = *found;
    }
    if (forward != nullptr) {
      bytes[p.f_mb][p.f_chunk] = eval.Evaluate(forward->assignment, forward->load).device_bytes;
      out.recompute_flops += RecomputeFlops(eval, forward->assignment, forward->load);
    }
    const plan::Chains chains = plan::BuildChains(eval, u);
    std::vector<plan::IssueItem> recorded;
    if (forward != nullptr && exec_ == ExecModel::kDualBatch) {
      recorded = RecordedItems(chains, forward->order);
    }
    bool reordered = false;
    schedules.push_back(Schedule(chains, exec_, std::move(recorded), trace, &reordered));
    if (reordered) ++reordered_;
  }
  WalkPoints(points_, schedules, bytes, trace, out);
  return out;
}

}  // namespace bgl::sim
