// StagePlanner: the planner's one entry point. Given a stage and a scheduling point (phase,
// micro-batch ids, load factor, bytes in use) it returns a Plan: the budget, each operator's
// strategy, the issue order, the predicted memory and the time overhead. One per GPU; not
// thread-safe (the daemon serialises calls per session). On large chunks it owns the anytime
// path's refinement worker (refiner.h), and with the warm-up a second one; each runs on its own
// thread and touches none of the planner's state: finished jobs enter the cache on the planner's
// calling thread.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <vector>

#include "governor/planner/assignment.h"
#include "governor/planner/budget.h"
#include "governor/planner/deadline.h"
#include "governor/planner/dual_batch.h"
#include "governor/planner/hardware.h"
#include "governor/planner/mitigation.h"
#include "governor/planner/model_config.h"
#include "governor/planner/pipeline_schedule.h"
#include "governor/planner/plan_cache.h"
#include "governor/planner/refiner.h"
#include "governor/planner/shared_plans.h"
#include "governor/planner/stage_graph.h"

namespace bgl::plan {

// How a scheduling point's chains are ordered.
enum class IssuePolicy {
  kDualBatch,  // the DP of paper V-B (fused dual-batch execution)
  kLockstep,   // round i issues stage i of every chain: overlap by accident, no planning
  kSerial,     // no fusion (Megatron 1F1B): F then R then B one stage per round; the copy
               // engines run O beside F and R's reloads beside R's recomputes
};

// How one stage is planned. A plain value.
struct PlannerOptions {
  int64_t capacity_bytes = 0;  // device memory; 0: the hardware profile's
  int pipeline_rank = 0;
  int64_t budget_step_bytes = int64_t{64} << 20;  // plan-cache budget discretisation
  double load_bucket = 0.05;                      // assignment cache: load-factor bucket width
  double schedule_load_class = 0.25;              // issue-order cache: load-factor class width
  double offload_chunk_bytes = 64.0 * (1 << 20);
  size_t cache_entries = 4096;
  MitigationOptions mitigation;
  IssuePolicy issue_policy = IssuePolicy::kDualBatch;
  // The anytime path (issue 23): on a chunk of at least anytime_min_ops operators a mitigation
  // cache miss is answered with the first answer (MitigationOptions::fast: the priced candidates,
  // then the operator DP on fast_dp_states labels) and the full search for the same key runs on a
  // background thread (refiner.h); its plan, never costlier, replaces the first answer in the
  // cache, so the key's next hit returns it (Plan::first_answer, Plan::refined). <= 0: off, every
  // miss runs the full search on the caller's thread. 64: the full search of a 2-layer chunk of
  // 32 operators takes tens of milliseconds, the shipped small models stay on the exact path.
  int anytime_min_ops = 64;
  // A refinement running longer is dropped and the first answer stays (<= 0: no limit).
  int64_t refine_timeout_ms = 30000;
  // false: first answers stay, nothing is refined (bgl-plan --first-answer shows one).
  bool refine_first_answers = true;
  // The warm-up (issue 43): from the first planned point on, a worker thread (at warm_nice)
  // runs the full search for the mitigation-cache keys a run will meet (WarmKeys: every forward of
  // an iteration at load 1 and, for each load bucket up to warm_spike_bound, each micro-batch
  // spiked to it with the budgets that spike leaves the points after it; and every budget bucket
  // the run's points meet, at every load bucket up to the bound), at the first point's host limit
  // and bandwidth share; the plans enter the cache as they land, so the keys' first hits get them
  // (Plan::warm). Rounds re-enumerate with the landed plans' bytes until no new key shows (at most
  // warm_rounds), and again when a point meets a new budget bucket. At most warm_max_keys keys (0:
  // half the cache), so the warm-up never evicts its own plans. With it on, a point's load below
  // 1 is served the cached full-search plan of load 1 (warm or refined), a met budget bucket's
  // neighbours are warmed with it, and a miss is served the nearest plan where it is not costlier
  // than the first answer (Plan::nearest).
  bool warm_up = false;
  double warm_spike_bound = 3.0;  // highest load factor warmed, in [1, 64]
  size_t warm_max_keys = 0;       // <= cache_entries / 2
  int warm_rounds = 4;
  // The warm-up's jobs run on their own worker thread at this nice value (Linux; 19: the
  // lowest priority, so it takes the CPU that training leaves) ...
  int warm_nice = 19;
  // ... and the misses' refinements on the anytime path's at this one (0: the caller's). The
  // package's embedded planner asks for 19: in a training process on cores training keeps
  // busy, a refinement at the caller's priority takes its CPU from training (docs/planner.md
  // "The anytime path"); the daemon, a process of its own, keeps 0.
  int refine_nice = 0;
  // The downgrade after the gate (PlanAfterGate) runs its operator DP on the caller's thread, in
  // the forward: it spends at most this share of the exposed overhead it could remove (GateSearch,
  // mitigation.h), at the seconds per label the planner measured on its earlier searches at the
  // same gate; in [0, 1], 0: the full search at every revision.
  double gate_search_share = 0.25;
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
  // Pinned host bytes the plan may offload (the session's grant); -1: none. Plan::host_bytes at
  // the point's load never exceeds it.
  int64_t host_limit_bytes = -1;
  // The fraction of the host link's bandwidth this session's copies get, in (0, 1]: scales the
  // offload/reload rooflines' peak for this plan (rounded down to 1/kShareSteps).
  double bandwidth_share = 1.0;
};

// Bandwidth shares are planned in steps of 1/kShareSteps, rounded down (never optimistic).
inline constexpr int kShareSteps = 16;

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
  // Produced by the post-gate call and revised there; false where the plan still fit at the
  // observed load (then no issue order is computed: the caller keeps the plan and order it has).
  bool deferred = false;
  bool cache_hit = false;
  // The anytime path (PlannerOptions::anytime_min_ops): first_answer, the assignment is the quick
  // first answer, its refinement pending (or past refine_timeout_ms); refined, the assignment is
  // the background full search's, cached under this point's key. Both false: the full search ran
  // on the call, the first answer was proven optimal (its DP never thinned), or keep-all.
  bool first_answer = false;
  bool refined = false;
  bool warm = false;  // the warm-up's plan (PlannerOptions::warm_up), met before its first hit
  // With the warm-up, a cold key (a miss) served the nearest plan: a cached full-search plan of
  // a neighbouring key of the same phase and chunk (the warm-up's or a refined miss's) that fits
  // this key's budget and host limit at its load and costs no more than the key's first answer;
  // the key's own full search refines it in the background (first_answer is then false).
  bool nearest = false;
  double bandwidth_share = 1.0;  // the share the plan assumed (rounded down to 1/kShareSteps)
};

// Counters of both caches and of the anytime path. A plain value.
struct PlannerCacheStats {
  CacheCounters mitigation;
  CacheCounters schedule;
  uint64_t first_answers = 0;   // misses answered with the first answer (refinements submitted)
  uint64_t refined = 0;         // refinements that entered the cache
  uint64_t improved = 0;        // of those, cheaper than their first answer
  uint64_t refine_expired = 0;  // past refine_timeout_ms: the first answer stayed
  // The warm-up (PlannerOptions::warm_up).
  uint64_t warm_keys = 0;        // mitigation-cache entries holding the warm-up's plans now
  uint64_t warm_enumerated = 0;  // distinct keys the warm-up found (before the cap)
  uint64_t warm_submitted = 0;   // keys sent to the worker (at most warm_max_keys)
  uint64_t warm_done = 0;        // of those, searched (landed, failed or expired)
  uint64_t warm_hits = 0;        // points served by a warm-up plan
  uint64_t warm_nearest = 0;     // misses served the nearest plan (Plan::nearest)
  uint64_t warm_rounds = 0;      // enumeration rounds run
  bool warm_complete = false;    // every round ran and every job landed
  double warm_cpu_s = 0;         // the warm-up worker thread's CPU time on its jobs
  double refine_cpu_s = 0;       // the anytime worker's on the misses' refinements
  // Sharing (ShareWarmPlans): of warm_hits, the points served by another planner's warm-up
  // plan; and the plans the shared store holds now (0: not sharing).
  uint64_t warm_shared_hits = 0;
  uint64_t warm_shared_keys = 0;
  // The downgrades after the gate (PlanAfterGate) that searched (ran the operator DP), those the
  // search's price cut (fewer labels, or no search: GateSearch), and the searches' wall time.
  uint64_t gate_searches = 0;
  uint64_t gate_searches_cut = 0;
  double gate_search_s = 0;
};

class StagePlanner {
 public:
  static Result<std::unique_ptr<StagePlanner>> Create(const ModelConfig& config,
                                                      const HardwareProfile& hw,
                                                      const PlannerOptions& options);
  ~StagePlanner();
  StagePlanner(const StagePlanner&) = delete;
  StagePlanner& operator=(const StagePlanner&) = delete;

  // Plans the point. Errors name the offending field; the planner's state is then unchanged.
  // A budget at or above the micro-batch's keep-all bytes plans keep-all whatever the budget
  // step. When `deadline` expires the call returns its Status (deadline.h), state unchanged.
  Result<Plan> PlanPoint(const SchedulePoint& point, const Deadline& deadline = {});
  // Deferred planning: after the gate of `gate_layer` (a layer index within the chunk) ran with
  // observed load `observed_r`, revises the rest of the chunk where the plan no longer fits
  // (Plan::deferred true, with its issue order); where it still fits, returns it unrevised at
  // once (deferred false, no issue order).
  Result<Plan> PlanAfterGate(int micro_batch, int chunk, int gate_layer, double observed_r,
                             const Deadline& deadline = {});
  // What the forward of (micro_batch, chunk) actually retained.
  Status Report(int micro_batch, int chunk, int64_t actual_bytes);
  // Starts a new iteration: live micro-batches are forgotten, caches are kept.
  void ResetIteration();
  // Drops every cached plan (after a calibration change, or to measure a cold planner);
  // refinements in flight then never enter the cache.
  void ClearCaches();
  // The anytime path: puts finished refinements into the cache (PlanPoint does it first) ...
  void ApplyRefinements();
  // ... and waits for every submitted refinement first (tests, benchmarks, a host between
  // iterations).
  void WaitForRefinements();
  // Refinements queued or running.
  size_t refinements_pending() const {
    return (refiner_ ? refiner_->Pending() : 0) + (warm_refiner_ ? warm_refiner_->Pending() : 0);
  }
  // The warm-up (PlannerOptions::warm_up): starts it now (PlanPoint starts it at the first point
  // otherwise) for the keys at `host_limit_bytes` (-1: none) and `bandwidth_share`; a second call
  // does nothing. Error: warm_up is off.
  Status StartWarmup(int64_t host_limit_bytes = -1, double bandwidth_share = 1.0);
  // Waits until every warm-up round has run and its plans entered the cache (tests,
  // benchmarks).
  void WaitForWarmup();
  // The keys the warm-up would search now, in its order (the cache's plans give the bytes of the
  // forwards they serve; the rest are estimated at min(budget, keep-all)); uncapped.
  std::vector<MitigationKey> WarmKeys(int64_t host_limit_bytes = -1, double bandwidth_share = 1.0);
  // Shares the warm-up with other planners of equal graph, hardware and options (the daemon's
  // sessions of one job): keys another planner claimed or published are not searched here, this
  // planner's warm plans are published as they land, and a point whose key misses this planner's
  // cache is served the shared plan (a warm hit). Call before the first point; null: stop
  // sharing (claims not landed are released). ClearCaches stops sharing too.
  void ShareWarmPlans(std::shared_ptr<SharedPlans> shared);

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
  // An assignment the planner has produced, with its memory as a linear function of load
  // (placements do not depend on r), so cached plans predict bytes without re-evaluation.
  struct Interned {
    Assignment assignment;
    double device_fixed = 0, device_per_load = 0;
    double host_fixed = 0, host_per_load = 0;
    double exposed_s = 0;  // at the load it was planned for, at the full bandwidth
    double planned_r = 1;
    bool fallback = false;
    std::map<int, double> exposed_at_share;  // share bucket -> exposed_s at that share
  };
  // The hardware with the copy rooflines scaled to one bandwidth share, and its evaluator.
  struct ShareModel {
    HardwareProfile hw;
    std::unique_ptr<CostEvaluator> eval;
  };
  // The forward of one (micro-batch, chunk) that has not run its backward yet.
  struct UnitState {
    bool live = false;
    int assignment = -1;
    double load = 1;
    double budget = 0;
    double host_limit = -1;
    int share_bucket = kShareSteps;
  };

  // An assignment cache entry: the interned id and where it came from (Plan::first_answer,
  // Plan::refined).
  struct CachedAssignment {
    int id = -1;
    bool first_answer = false;
    bool refined = false;
    bool warm = false;    // the warm-up's plan
    bool shared = false;  // another planner's warm-up plan (ShareWarmPlans)
    // The nearest plan (Plan::nearest) in place of the first answer; first_answer stays true
    // while the key's own refinement is pending.
    bool nearest = false;
  };

  StagePlanner(ModelConfig config, HardwareProfile hw, PlannerOptions options, StageGraph graph,
               std::vector<Step> steps, double m_max);
  Status Validate(const SchedulePoint& point) const;
  Result<Plan> PlanPointUnchecked(const SchedulePoint& point, const Deadline& deadline);
  Result<Plan> PlanAfterGateUnchecked(int micro_batch, int chunk, int gate_layer, double observed_r,
                                      const Deadline& deadline);
  // Runs `plan` under `deadline`: the evaluator and the DP check it; if it expires, the budget
  // tracker and the units are restored and the deadline's Status is returned.
  template <typename F>
  Result<Plan> WithDeadline(const Deadline& deadline, F&& plan);
  int Intern(Assignment assignment, double planned_r, bool fallback);
  // The inputs a key is planned at (the bucket's worst case) as a refinement job.
  RefineJob JobFor(const MitigationKey& key);
  // A warm-up round: enumerates, submits the keys not submitted yet (up to the cap).
  void WarmRound();
  void LandWarm(RefineDone& done);
  void ApplyDone(std::vector<RefineDone> finished);
  // The budget buckets the points met since the last call, at every load bucket up to the
  // bound, ahead of the replay's queued keys.
  void WarmObserved();
  size_t WarmCap() const;
  const CachedAssignment& AssignmentFor(const MitigationKey& key, bool& hit);
  // The nearest plan for a cold `key` (Plan::nearest): the interned id of the cheapest cached
  // full-search plan of the same phase and chunk that fits `job`'s budget and host limit at its
  // load, costing at most `bound_s` there (`exposed_s` set to its cost); -1: none.
  int NearestPlan(const MitigationKey& key, const RefineJob& job, double bound_s,
                  double& exposed_s);
  // The interned ids of the cached full-search plans of `key`'s phase and chunk within
  // kNearestBudgets budget buckets (any load, host and share bucket) that `keep` accepts: distinct,
  // nearest first (budget and load buckets apart), at most kNearestPlans. The nearest plan's
  // candidates, and the downgrade after the gate's warm alternatives (PlanAfterGate).
  std::vector<int> PlansNear(const MitigationKey& key,
                             const std::function<bool(const Interned&)>& keep);
  void FillSchedule(Plan& plan, int f_mb, int f_chunk, int b_mb, int b_chunk, int share_bucket,
                    bool use_cache, const Deadline& deadline);
  // The evaluator for a share bucket (kShareSteps: eval_), created on first use.
  CostEvaluator& EvaluatorFor(int share_bucket);
  // Exposed overhead of interned assignment `id` at a share bucket.
  double ExposedAt(int id, int share_bucket);
  int UnitIndex(int micro_batch, int chunk) const {
    return micro_batch * static_cast<int>(config_.Chunks()) + chunk;
  }

  ModelConfig config_;
  HardwareProfile hw_;
  PlannerOptions options_;
  StageGraph graph_;
  std::unique_ptr<CostEvaluator> eval_;
  std::map<int, std::unique_ptr<ShareModel>> share_models_;
  std::vector<Step> steps_;
  std::vector<int> forward_step_;      // unit -> index of its forward step
  std::vector<int> previous_forward_;  // unit -> unit whose forward precedes it (-1: none)
  std::vector<int> next_backward_;     // unit -> unit whose backward follows its own (-1: none)
  double m_max_;
  BudgetTracker tracker_;
  std::vector<UnitState> units_;
  std::vector<Interned> interned_;
  std::map<Assignment, int> intern_index_;
  LruCache<MitigationKey, CachedAssignment> mitigation_cache_;
  LruCache<ScheduleKey, DualBatchSchedule> schedule_cache_;
  int keep_all_ = -1;
  uint64_t generation_ = 0;  // ClearCaches() count: older refinements are dropped
  uint64_t first_answers_ = 0, refined_ = 0, improved_ = 0, refine_expired_ = 0;
  bool anytime_ = false;  // first answers on a miss (anytime_min_ops); the refiner may run anyway
  // The warm-up's state.
  bool warm_started_ = false, warm_complete_ = false, warm_last_round_ = false;
  int64_t warm_host_limit_ = -1;
  int warm_share_bucket_ = kShareSteps;
  std::map<MitigationKey, bool> warm_submitted_;  // key -> landed
  std::set<MitigationKey> warm_observed_;         // keys the points met, load bucket 0
  std::set<MitigationKey> warm_found_;            // every key enumerated (before the cap)
  bool warm_observed_new_ = false;                // one added since the last round
  uint64_t warm_in_flight_ = 0, warm_done_ = 0, warm_hits_ = 0, warm_nearest_ = 0;
  uint64_t warm_live_ = 0, warm_rounds_ = 0;
  double warm_cpu_s_ = 0, refine_cpu_s_ = 0;
  std::shared_ptr<SharedPlans> shared_;  // null: not sharing
  uint64_t warm_shared_hits_ = 0;
  // Per gate layer, the measured seconds per label of the downgrade's DP (0: not measured yet).
  std::vector<double> gate_search_s_per_label_;
  uint64_t gate_searches_ = 0, gate_searches_cut_ = 0;
  double gate_search_s_ = 0;
  // Claims the warm-up's keys in shared_ (true: searched here) or skips them (false: another
  // planner's); without sharing, always true.
  bool ClaimWarm(const MitigationKey& key);
  // The shared plan for `key` entered in this planner's cache, or null.
  const CachedAssignment* FromShared(const MitigationKey& key);
  // Last: destroyed (joined) first. refiner_: the misses' refinements (null: anytime off);
  // warm_refiner_: the warm-up's jobs, at warm_nice (null: warm_up off).
  std::unique_ptr<Refiner> refiner_;
  std::unique_ptr<Refiner> warm_refiner_;
};

}  // namespace bgl::plan
