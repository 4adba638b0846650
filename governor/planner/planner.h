// StagePlanner: the planner's one entry point. Given a stage and a scheduling point (phase,
// micro-batch ids, load factor, bytes in use) it returns a Plan: the budget, each operator's
// strategy, the issue order, the predicted memory and the time overhead. One per GPU; not
// thread-safe (the daemon serialises calls per session).
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "governor/planner/assignment.h"
#include "governor/planner/budget.h"
#include "governor/planner/dual_batch.h"
#include "governor/planner/hardware.h"
#include "governor/planner/mitigation.h"
#include "governor/planner/model_config.h"
#include "governor/planner/pipeline_schedule.h"
#include "governor/planner/plan_cache.h"
#include "governor/planner/stage_graph.h"

namespace bgl::plan {

// How one stage is planned.
struct PlannerOptions {
  int64_t capacity_bytes = 0;  // device memory; 0: the hardware profile's
  int pipeline_rank = 0;
  int64_t budget_step_bytes = int64_t{64} << 20;  // plan-cache budget discretisation
  double load_bucket = 0.05;                      // plan-cache load-factor bucket width
  double offload_chunk_bytes = 64.0 * (1 << 20);
  size_t cache_entries = 4096;
  MitigationOptions mitigation;
  bool dual_batch = true;  // false: issue in program order (ablation L3)
};

// A pipeline scheduling point F_x B_y (either side may be absent in warmup or cooldown).
struct SchedulePoint {
  std::optional<Phase> phase;  // derived from the schedule when absent
  int forward_micro_batch = -1;
  int forward_chunk = 0;
  int backward_micro_batch = -1;
  int backward_chunk = 0;
  double load_factor = 1.0;   // predicted (or, after the gate, observed) r of the forward
  int64_t bytes_in_use = -1;  // activation bytes retained now as measured; -1: use reports
};

// One issued stage of the dual-batch order.
struct IssueItem {
  Chain chain = Chain::kForward;
  int stage = 0;
  int round = 0;
  Resource resource = Resource::kCompute;
  double duration_s = 0;
  std::string label;
};

// The planner's answer for one scheduling point; a plain value that hosts serialise.
struct Plan {
  Phase phase = Phase::kSteady;
  int micro_batch = -1;  // the forward planned (-1: none at this point)
  int chunk = 0;
  double load_factor = 1;
  int64_t budget_bytes = 0;
  int64_t free_bytes = 0;
  int k = 0;
  bool infeasible = false;  // free < k * M0: the caller must evict (pressure)
  int64_t m0_bytes = 0;
  int64_t keep_all_bytes = 0;
  int64_t predicted_bytes = 0;  // retained by the forward under the plan
  int64_t host_bytes = 0;
  Assignment strategies;  // one per graph operator
  std::vector<IssueItem> issue_order;
  double overhead_s = 0;    // exposed time overhead of the mitigations
  double serial_s = 0;      // the point's work one stage after another
  double overlapped_s = 0;  // makespan of the dual-batch order
  bool fallback_full_recompute = false;
  bool deferred = false;  // produced by the post-gate call
  bool cache_hit = false;
};

// Counters of both caches.
struct PlannerCacheStats {
  CacheCounters mitigation;
  CacheCounters schedule;
};

class StagePlanner {
 public:
  static Result<std::unique_ptr<StagePlanner>> Create(const ModelConfig& config,
                                                      const HardwareProfile& hw,
                                                      const PlannerOptions& options);

  // Plans the point. Errors name the offending field; the planner's state is then unchanged.
  Result<Plan> PlanPoint(const SchedulePoint& point);
  // Deferred planning: after the gate of `gate_layer` (a layer index within the chunk) ran with
  // observed load `observed_r`, may downgrade the rest of the MoE block to full recompute.
  Result<Plan> PlanAfterGate(int micro_batch, int chunk, int gate_layer, double observed_r);
  // What the forward of (micro_batch, chunk) actually retained.
  Status Report(int micro_batch, int chunk, int64_t actual_bytes);
  // Starts a new iteration: live micro-batches are forgotten, caches are kept.
  void ResetIteration();

  const ModelConfig& config() const { return config_; }
  const HardwareProfile& hardware() const { return hw_; }
  const StageGraph& graph() const { return graph_; }
  const CostEvaluator& evaluator() const { return *eval_; }
  const std::vector<Step>& steps() const { return steps_; }
  const PlannerOptions& options() const { return options_; }
  // Device memory left for activations: capacity minus weights, optimizer state, workspace and
  // the safety margin.
  double activation_capacity() const { return m_max_; }
  double m0() const { return graph_.M0(1.0); }
  double used_bytes() const { return tracker_.used(); }
  PlannerCacheStats cache_stats() const;

 private:
  struct UnitState {
    Assignment assignment;
    MitigationKey key;
    double load = 1;
    double budget = 0;
  };

  StagePlanner(ModelConfig config, HardwareProfile hw, PlannerOptions options, StageGraph graph,
               std::vector<Step> steps, double m_max);
  Status Validate(const SchedulePoint& point) const;
  const Assignment& AssignmentFor(const MitigationKey& key, double budget, double r, bool& hit,
                                  bool& fallback);
  void FillSchedule(Plan& plan, int f_mb, int f_chunk, int b_mb, int b_chunk, bool use_cache);
  const UnitState* Unit(int micro_batch, int chunk) const;

  ModelConfig config_;
  HardwareProfile hw_;
  PlannerOptions options_;
  StageGraph graph_;
  std::unique_ptr<CostEvaluator> eval_;
  std::vector<Step> steps_;
  double m_max_;
  BudgetTracker tracker_;
  std::map<std::pair<int, int>, UnitState> units_;
  struct CachedAssignment {
    Assignment assignment;
    bool fallback = false;
  };
  LruCache<MitigationKey, CachedAssignment> mitigation_cache_;
  LruCache<ScheduleKey, DualBatchSchedule> schedule_cache_;
  Assignment keep_all_;
};

}  // namespace bgl::plan
