#include "governor/planner/planner.h"

#include <cmath>

#include "governor/planner/units.h"

namespace bgl::plan {

Result<std::unique_ptr<StagePlanner>> StagePlanner::Create(const ModelConfig& config,
                                                           const HardwareProfile& hw,
                                                           const PlannerOptions& options) {
  BGL_RETURN_IF_ERROR(config.Validate());
  BGL_RETURN_IF_ERROR(hw.Validate());
  if (options.capacity_bytes < 0) {
    return InvalidArgument("capacity: must be non-negative, got " +
                           std::to_string(options.capacity_bytes));
  }
  if (options.budget_step_bytes <= 0) return InvalidArgument("budget_step_bytes must be positive");
  if (!(options.load_bucket > 0)) return InvalidArgument("load_bucket must be positive");
  if (!(options.offload_chunk_bytes > 0)) {
    return InvalidArgument("offload_chunk_bytes must be positive");
  }
  if (options.cache_entries == 0) return InvalidArgument("cache_entries must be positive");
  auto graph = BuildStageGraph(config, hw);
  if (!graph.ok()) return graph.status();
  auto steps =
      BuildSchedule(static_cast<int>(config.pp), options.pipeline_rank,
                    static_cast<int>(config.MicroBatches()), static_cast<int>(config.Chunks()));
  if (!steps.ok()) return steps.status();
  const double capacity =
      static_cast<double>(options.capacity_bytes > 0 ? options.capacity_bytes : hw.memory_bytes);
  const double fixed = config.StaticBytesPerGpu() + static_cast<double>(config.workspace_bytes) +
                       config.safety_margin * capacity;
  const double m_max = capacity - fixed;
  const double m0 = graph->M0(1.0);
  const int warmup =
      WarmupForwards(static_cast<int>(config.pp), options.pipeline_rank,
                     static_cast<int>(config.MicroBatches()), static_cast<int>(config.Chunks()));
  if (m_max < (warmup + 1) * m0) {
    return InvalidArgument("capacity: " + FormatBytes(capacity) + " leaves " +
                           FormatBytes(std::max(0.0, m_max)) +
                           " for activations after weights, gradients and optimizer state (" +
                           FormatBytes(config.StaticBytesPerGpu()) + "), workspace and margin; " +
                           std::to_string(warmup + 1) + " micro-batches in flight need at least " +
                           FormatBytes((warmup + 1) * m0) + " (M0 each)");
  }
  return std::unique_ptr<StagePlanner>(
      new StagePlanner(config, hw, options, std::move(*graph), std::move(*steps), m_max));
}

StagePlanner::StagePlanner(ModelConfig config, HardwareProfile hw, PlannerOptions options,
                           StageGraph graph, std::vector<Step> steps, double m_max)
    : config_(std::move(config)),
      hw_(std::move(hw)),
      options_(options),
      graph_(std::move(graph)),
      steps_(std::move(steps)),
      m_max_(m_max),
      tracker_(m_max, graph_.M0(1.0)),
      mitigation_cache_(options.cache_entries),
      schedule_cache_(options.cache_entries) {
  eval_ = std::make_unique<CostEvaluator>(graph_, hw_);
  keep_all_.assign(graph_.ops.size(), Strategy::kKeep);
}

PlannerCacheStats StagePlanner::cache_stats() const {
  return {mitigation_cache_.counters(), schedule_cache_.counters()};
}

void StagePlanner::ResetIteration() {
  units_.clear();
  tracker_ = BudgetTracker(m_max_, graph_.M0(1.0));
}

Status StagePlanner::Validate(const SchedulePoint& p) const {
  const int mbs = static_cast<int>(config_.MicroBatches());
  const int chunks = static_cast<int>(config_.Chunks());
  auto check_unit = [&](int mb, int chunk, const char* mb_field, const char* chunk_field) {
    if (mb < -1 || mb >= mbs) {
      return InvalidArgument(std::string(mb_field) + ": " + std::to_string(mb) +
                             " is outside [0, " + std::to_string(mbs) + ") (or -1 for none)");
    }
    if (chunk < 0 || chunk >= chunks) {
      return InvalidArgument(std::string(chunk_field) + ": " + std::to_string(chunk) +
                             " is outside [0, " + std::to_string(chunks) + ")");
    }
    return OkStatus();
  };
  BGL_RETURN_IF_ERROR(
      check_unit(p.forward_micro_batch, p.forward_chunk, "forward_micro_batch", "forward_chunk"));
  BGL_RETURN_IF_ERROR(check_unit(p.backward_micro_batch, p.backward_chunk, "backward_micro_batch",
                                 "backward_chunk"));
  if (p.forward_micro_batch < 0 && p.backward_micro_batch < 0) {
    return InvalidArgument("forward_micro_batch: a point needs a forward or a backward");
  }
  if (!std::isfinite(p.load_factor) || p.load_factor <= 0 || p.load_factor > 64) {
    return InvalidArgument("load_factor: must be in (0, 64], got " + std::to_string(p.load_factor));
  }
  if (p.bytes_in_use < -1 || p.bytes_in_use > (int64_t{1} << 50)) {
    return InvalidArgument("bytes_in_use: out of range: " + std::to_string(p.bytes_in_use));
  }
  if (p.forward_micro_batch >= 0 && p.forward_micro_batch == p.backward_micro_batch &&
      p.forward_chunk == p.backward_chunk) {
    return InvalidArgument(
        "backward_micro_batch: a micro-batch's forward and backward never "
        "share a scheduling point");
  }
  return OkStatus();
}

const StagePlanner::UnitState* StagePlanner::Unit(int micro_batch, int chunk) const {
  auto it = units_.find({micro_batch, chunk});
  return it == units_.end() ? nullptr : &it->second;
}

const Assignment& StagePlanner::AssignmentFor(const MitigationKey& key, double budget, double r,
                                              bool& hit, bool& fallback) {
  if (const CachedAssignment* cached = mitigation_cache_.Find(key)) {
    hit = true;
    fallback = cached->fallback;
    return cached->assignment;
  }
  hit = false;
  // Plan for the worst case of the bucket: the lowest budget and the highest load in it.
  const double r_plan = static_cast<double>(key.load_bucket) * options_.load_bucket;
  const double budget_plan =
      std::max(graph_.M0(r_plan), static_cast<double>(key.budget_bucket) *
                                      static_cast<double>(options_.budget_step_bytes));
  (void)budget;
  (void)r;
  auto selected = SelectMitigation(*eval_, r_plan, budget_plan, options_.mitigation);
  CachedAssignment entry;
  if (selected.ok()) {
    entry.assignment = std::move(selected->assignment);
    entry.fallback = selected->fallback_full_recompute;
  } else {
    entry.assignment = FullRecompute(*eval_);
    entry.fallback = true;
  }
  fallback = entry.fallback;
  return mitigation_cache_.Insert(key, std::move(entry)).assignment;
}

Result<Plan> StagePlanner::PlanPoint(const SchedulePoint& point) {
  BGL_RETURN_IF_ERROR(Validate(point));
  Plan plan;
  plan.m0_bytes = static_cast<int64_t>(graph_.M0(point.load_factor));
  plan.load_factor = point.load_factor;
  if (point.bytes_in_use >= 0) tracker_.Rebase(static_cast<double>(point.bytes_in_use));
  bool hit_mitigation = true;
  if (point.forward_micro_batch >= 0) {
    const int index = FindForward(steps_, point.forward_micro_batch, point.forward_chunk);
    if (index < 0) {
      return InvalidArgument("forward_micro_batch: (" + std::to_string(point.forward_micro_batch) +
                             ", chunk " + std::to_string(point.forward_chunk) +
                             ") is not a forward of this stage's schedule");
    }
    plan.phase = point.phase.value_or(steps_[index].phase);
    plan.micro_batch = point.forward_micro_batch;
    plan.chunk = point.forward_chunk;
    const BudgetDecision d = tracker_.OnForward(ForwardsUntilNextBackward(steps_, index));
    plan.budget_bytes = static_cast<int64_t>(d.budget);
    plan.free_bytes = static_cast<int64_t>(d.free);
    plan.k = d.k;
    plan.infeasible = d.infeasible;
    MitigationKey key;
    key.valid = true;
    key.phase = static_cast<int>(plan.phase);
    key.chunk = point.forward_chunk;
    key.budget_bucket = static_cast<int64_t>(
        std::floor(d.budget / static_cast<double>(options_.budget_step_bytes)));
    key.load_bucket =
        static_cast<int64_t>(std::ceil(point.load_factor / options_.load_bucket - 1e-9));
    bool fallback = false;
    const Assignment& a = AssignmentFor(key, d.budget, point.load_factor, hit_mitigation, fallback);
    plan.strategies = a;
    plan.fallback_full_recompute = fallback;
    const AssignmentCost cost = eval_->Evaluate(a, point.load_factor);
    plan.predicted_bytes = static_cast<int64_t>(cost.device_bytes);
    plan.host_bytes = static_cast<int64_t>(cost.host_bytes);
    plan.overhead_s = cost.exposed_s;
    plan.keep_all_bytes = static_cast<int64_t>(graph_.KeepAllBytes(point.load_factor));
    UnitState& unit = units_[{point.forward_micro_batch, point.forward_chunk}];
    unit.assignment = a;
    unit.key = key;
    unit.load = point.load_factor;
    unit.budget = d.budget;
    // The prediction stands in for the report until the real number arrives.
    tracker_.OnReport(point.forward_micro_batch, point.forward_chunk, cost.device_bytes);
  } else {
    plan.phase = point.phase.value_or(Phase::kCooldown);
  }
  FillSchedule(plan, point.forward_micro_batch, point.forward_chunk, point.backward_micro_batch,
               point.backward_chunk, /*use_cache=*/true);
  plan.cache_hit = hit_mitigation && plan.cache_hit;
  if (point.backward_micro_batch >= 0) {
    tracker_.OnBackward(point.backward_micro_batch, point.backward_chunk);
    units_.erase({point.backward_micro_batch, point.backward_chunk});
  }
  return plan;
}

void StagePlanner::FillSchedule(Plan& plan, int f_mb, int f_chunk, int b_mb, int b_chunk,
                                bool use_cache) {
  // O is the forward before this one; R the backward after this one.
  int o_mb = -1, o_chunk = 0, r_mb = -1, r_chunk = 0;
  const int f_index = f_mb >= 0 ? FindForward(steps_, f_mb, f_chunk) : -1;
  for (int i = f_index - 1; i >= 0; --i) {
    if (steps_[i].forward) {
      o_mb = steps_[i].micro_batch;
      o_chunk = steps_[i].chunk;
      break;
    }
  }
  if (b_mb >= 0) {
    bool seen = false;
    for (const Step& s : steps_) {
      if (s.forward) continue;
      if (seen) {
        r_mb = s.micro_batch;
        r_chunk = s.chunk;
        break;
      }
      seen = s.micro_batch == b_mb && s.chunk == b_chunk;
    }
  }
  PointUnits units;
  units.offload_chunk_bytes = options_.offload_chunk_bytes;
  ScheduleKey key;
  auto bind = [&](int mb, int chunk, const Assignment*& a, double& r, MitigationKey& k) {
    if (mb < 0) return;
    if (const UnitState* u = Unit(mb, chunk)) {
      a = &u->assignment;
      r = u->load;
      k = u->key;
    } else {
      // Not planned by this planner (e.g. it started mid-iteration): assume everything kept.
      a = &keep_all_;
      k.valid = true;
      k.budget_bucket = -1;
      k.chunk = chunk;
    }
  };
  bind(f_mb, f_chunk, units.forward, units.forward_r, key[0]);
  bind(b_mb, b_chunk, units.backward, units.backward_r, key[1]);
  bind(o_mb, o_chunk, units.offload, units.offload_r, key[2]);
  bind(r_mb, r_chunk, units.recover, units.recover_r, key[3]);
  const DualBatchSchedule* schedule = nullptr;
  DualBatchSchedule computed;
  Chains chains = BuildChains(*eval_, units);
  if (use_cache) schedule = schedule_cache_.Find(key);
  plan.cache_hit = schedule != nullptr;
  if (!schedule) {
    if (options_.dual_batch) {
      computed = SolveDualBatch(chains);
    } else {
      // Program order without planning: every chain advances one stage per round in lockstep.
      size_t longest = 0;
      for (const auto& c : chains) longest = std::max(longest, c.size());
      for (const auto& c : chains) {
        for (const auto& s : c) computed.serial_s += s.duration_s;
      }
      for (size_t i = 0; i < longest; ++i) {
        IssueRound round;
        for (int c = 0; c < kChainCount; ++c) {
          if (i < chains[c].size()) round.stage[c] = static_cast<int>(i);
        }
        round.time_s = RoundTime(chains, round.stage);
        computed.overlapped_s += round.time_s;
        computed.rounds.push_back(round);
      }
    }
    schedule = use_cache ? &schedule_cache_.Insert(key, std::move(computed)) : &computed;
  }
  plan.serial_s = schedule->serial_s;
  plan.overlapped_s = schedule->overlapped_s;
  plan.issue_order.clear();
  for (size_t r = 0; r < schedule->rounds.size(); ++r) {
    const IssueRound& round = schedule->rounds[r];
    for (int c = 0; c < kChainCount; ++c) {
      if (round.stage[c] < 0 || round.stage[c] >= static_cast<int>(chains[c].size())) continue;
      const ChainStage& s = chains[c][round.stage[c]];
      plan.issue_order.push_back({static_cast<Chain>(c), round.stage[c], static_cast<int>(r),
                                  s.resource, s.duration_s, s.label});
    }
  }
}

Result<Plan> StagePlanner::PlanAfterGate(int micro_batch, int chunk, int gate_layer,
                                         double observed_r) {
  auto it = units_.find({micro_batch, chunk});
  if (it == units_.end()) {
    return NotFound("micro_batch: (" + std::to_string(micro_batch) + ", chunk " +
                    std::to_string(chunk) + ") has no forward plan to revise");
  }
  if (gate_layer < 0 || gate_layer >= graph_.layers) {
    return InvalidArgument("gate_layer: " + std::to_string(gate_layer) + " is outside [0, " +
                           std::to_string(graph_.layers) + ")");
  }
  if (!std::isfinite(observed_r) || observed_r <= 0 || observed_r > 64) {
    return InvalidArgument("load_factor: must be in (0, 64], got " + std::to_string(observed_r));
  }
  UnitState& unit = it->second;
  const MitigationResult revised =
      ReplanAfterGate(*eval_, unit.assignment, gate_layer, observed_r, unit.budget);
  unit.assignment = revised.assignment;
  unit.load = observed_r;
  unit.key.load_bucket = static_cast<int64_t>(std::ceil(observed_r / options_.load_bucket - 1e-9));
  unit.key.budget_bucket = -2 - gate_layer;  // revised plans never alias first-pass plans
  tracker_.OnReport(micro_batch, chunk, revised.cost.device_bytes);
  Plan plan;
  plan.phase = Phase::kSteady;
  const int index = FindForward(steps_, micro_batch, chunk);
  if (index >= 0) plan.phase = steps_[index].phase;
  plan.micro_batch = micro_batch;
  plan.chunk = chunk;
  plan.load_factor = observed_r;
  plan.budget_bytes = static_cast<int64_t>(unit.budget);
  plan.m0_bytes = static_cast<int64_t>(graph_.M0(observed_r));
  plan.keep_all_bytes = static_cast<int64_t>(graph_.KeepAllBytes(observed_r));
  plan.predicted_bytes = static_cast<int64_t>(revised.cost.device_bytes);
  plan.host_bytes = static_cast<int64_t>(revised.cost.host_bytes);
  plan.strategies = revised.assignment;
  plan.overhead_s = revised.cost.exposed_s;
  plan.fallback_full_recompute = revised.fallback_full_recompute;
  plan.infeasible = !revised.fits;
  plan.deferred = true;
  FillSchedule(plan, micro_batch, chunk, -1, 0, /*use_cache=*/false);
  return plan;
}

Status StagePlanner::Report(int micro_batch, int chunk, int64_t actual_bytes) {
  if (actual_bytes < 0) {
    return InvalidArgument("actual_bytes: must be non-negative, got " +
                           std::to_string(actual_bytes));
  }
  if (!Unit(micro_batch, chunk)) {
    return NotFound("micro_batch: (" + std::to_string(micro_batch) + ", chunk " +
                    std::to_string(chunk) + ") was not planned or its backward already ran");
  }
  tracker_.OnReport(micro_batch, chunk, static_cast<double>(actual_bytes));
  return OkStatus();
}

}  // namespace bgl::plan
