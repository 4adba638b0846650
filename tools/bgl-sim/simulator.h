// PolicySimulator: runs one policy over the iterations of a load trace on the simulated stages,
// turns the stages' busy times into the pipeline's iteration time, and models OOM crashes,
// restarts and the switch to an over-provisioned configuration (paper II-B).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "governor/planner/hardware.h"
#include "governor/planner/model_config.h"
#include "tools/bgl-sim/load_trace.h"
#include "tools/bgl-sim/policy.h"
#include "tools/bgl-sim/served_plans.h"
#include "tools/bgl-sim/stage_runner.h"

namespace bgl::sim {

// Everything but the policy.
struct SimConfig {
  plan::ModelConfig model;
  plan::HardwareProfile hw;
  int64_t capacity_bytes = 0;  // 0: the hardware profile's
  std::vector<int> ranks;      // simulated pipeline ranks (empty: 0 and the last)
  double design_load = 1.2;    // the load static policies are sized for
  double restart_s = 284;      // cost of an OOM: restart and warm-up (paper II-B)
  int cooldown = 0;            // iterations before switching back to under-provisioning; 0: never
  bool exec_override = false;  // run every policy but L4 under `exec` instead of serial
  ExecModel exec = ExecModel::kSerial;
  double schedule_load_class = 0.01;         // the planner's issue-order cache class width
  std::shared_ptr<const ServedPlans> plans;  // --plans: what policy "plans" replays
};

// One iteration of one policy.
struct IterationRecord {
  int iteration = 0;
  double max_load = 1;
  bool spike = false;
  double time_s = 0;      // wall time of the iteration, including a failed attempt and restart
  double run_s = 0;       // the successful attempt
  double bubble_s = 0;    // pipeline bubble inside run_s
  double mfu = 0;         // useful FLOPs over time_s at peak
  double peak_bytes = 0;  // worst simulated stage
  double capacity_bytes = 0;
  bool oom = false;
  double wasted_s = 0;     // progress lost to the OOM
  double restart_s = 0;    // restart paid in this iteration
  std::string mode;        // under, over or dynamic
  double planning_ms = 0;  // measured planner wall time (all simulated stages)
  int fallbacks = 0;
};

// Totals of a run.
struct PolicySummary {
  Policy policy = Policy::kL4;
  ExecModel exec = ExecModel::kDualBatch;
  int iterations = 0;
  double total_s = 0;
  double mfu = 0;                // useful FLOPs over total time at peak, restarts included
  double throughput_tflops = 0;  // the whole cluster
  double tokens_per_s = 0;
  double normal_mfu = 0;  // mean MFU of iterations without a spike
  double spike_mfu = 0;   // mean MFU of spike iterations (restarts included)
  double spike_s = 0;     // time spent in spike iterations
  int ooms = 0;
  double restart_s = 0;
  double wasted_s = 0;
  double planning_ms_mean = 0;
  double planning_ms_max = 0;
  double peak_bytes = 0;
  double capacity_bytes = 0;
  double recompute_share = 0;  // recompute FLOPs over useful FLOPs
  // Policy plans under dual-batch: points issued in the DP's order because the recorded issue
  // order did not cover this cost model's chains (ServedStageRunner::reordered), all stages.
  int reordered_points = 0;
};

class PolicySimulator {
 public:
  static Result<std::unique_ptr<PolicySimulator>> Create(const SimConfig& config, Policy policy);

  // Simulates iteration `iteration` of `trace`; with `trace_stages`, keeps the stages' timelines
  // and memory curves (see traced()).
  Result<IterationRecord> Step(const LoadTrace& trace, int iteration, bool trace_stages);
  PolicySummary Summary() const;
  const std::vector<IterationRecord>& records() const { return records_; }
  // The stages of the last traced iteration.
  const std::vector<StageIteration>& traced() const { return traced_; }
  Policy policy() const { return policy_; }
  ExecModel exec() const { return exec_; }
  const std::vector<int>& ranks() const { return ranks_; }

 private:
  PolicySimulator(const SimConfig& config, Policy policy, ExecModel exec);
  // Sizes the static assignments for `design_load` (under) or switches to over-provisioning.
  void Provision(double design_load, bool over);
  struct Attempt {
    double run_s = 0, bubble_s = 0, peak = 0, first_over_s = -1, planning_s = 0;
    double useful = 0, recompute = 0;
    int fallbacks = 0;
    bool oom = false;
  };
  Result<Attempt> Attempt1(const LoadTrace& trace, int iteration, bool trace_stages);

  SimConfig config_;
  Policy policy_;
  ExecModel exec_;
  std::vector<int> ranks_;
  std::vector<std::unique_ptr<StageRunner>> runners_;
  bool over_ = false;
  int over_iterations_ = 0;
  std::vector<IterationRecord> records_;
  std::vector<StageIteration> traced_;
  double useful_total_ = 0;
  double recompute_total_ = 0;
};

}  // namespace bgl::sim
