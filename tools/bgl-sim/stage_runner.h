// StageRunner: simulates one iteration of one pipeline stage under a policy: which assignment each
// micro-batch gets, how long each scheduling point takes, and the activation memory over time.
// Dynamic policies ask the StagePlanner; static ones apply a fixed assignment.
#pragma once

#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "governor/planner/planner.h"
#include "tools/bgl-sim/point_schedule.h"
#include "tools/bgl-sim/policy.h"
#include "tools/bgl-sim/served_plans.h"

namespace bgl::sim {

// Activation bytes held by the stage at a time of its iteration.
struct MemorySample {
  double time_s = 0;
  double bytes = 0;
};

// What one stage did in one iteration.
struct StageIteration {
  int rank = 0;
  double busy_s = 0;                 // sum of the point durations (the stage without bubbles)
  double peak_bytes = 0;             // activation peak at the stage's worst GPU
  double capacity_bytes = 0;         // activation capacity
  double first_over_s = -1;          // when memory first exceeded capacity (-1: never)
  double useful_flops = 0;           // 3x forward FLOPs at the mean load, per GPU
  double recompute_flops = 0;        // rerun forward FLOPs (not useful)
  double planning_wall_s = 0;        // measured wall time spent in the planner
  int fallbacks = 0;                 // micro-batches the planner sent to full recompute
  int infeasible = 0;                // forwards whose budget was below k * M0
  std::vector<Interval> timeline;    // when traced: every placed stage, iteration-relative
  std::vector<MemorySample> memory;  // when traced: the activation memory curve
};

// Simulates iterations of one stage.
class StageRunner {
 public:
  virtual ~StageRunner() = default;
  // `loads[mb]`: micro-batch mb's load factor at this stage's worst GPU.
  virtual Result<StageIteration> Run(const std::vector<double>& loads, bool trace) = 0;
  virtual const plan::StagePlanner& planner() const = 0;
};

// A fixed assignment for every micro-batch, issued under `exec`.
class StaticStageRunner : public StageRunner {
 public:
  StaticStageRunner(std::unique_ptr<plan::StagePlanner> planner, ExecModel exec);
  void SetAssignment(plan::Assignment a) { assignment_ = std::move(a); }
  const plan::Assignment& assignment() const { return assignment_; }
  Result<StageIteration> Run(const std::vector<double>& loads, bool trace) override;
  const plan::StagePlanner& planner() const override { return *planner_; }

 private:
  std::unique_ptr<plan::StagePlanner> planner_;
  ExecModel exec_;
  plan::Assignment assignment_;
  std::vector<PointRef> points_;
};

// Every micro-batch planned by the StagePlanner at its observed load, one PlanPoint per
// scheduling point as the runtime calls it; points take the time of the planner's issue order.
class DynamicStageRunner : public StageRunner {
 public:
  // `exec`: kSerial re-issues each plan's work Megatron-style (the ablation's L3); otherwise the
  // planner's own issue order is used.
  DynamicStageRunner(std::unique_ptr<plan::StagePlanner> planner, ExecModel exec);
  Result<StageIteration> Run(const std::vector<double>& loads, bool trace) override;
  const plan::StagePlanner& planner() const override { return *planner_; }
  plan::StagePlanner& mutable_planner() { return *planner_; }

 private:
  std::unique_ptr<plan::StagePlanner> planner_;
  ExecModel exec_;
  std::vector<PointRef> points_;
};

// The plans a run was served (served_plans.h), replayed in the order of their iterations: each
// point's chains are built by this cost model from the served assignments at the loads they were
// planned for; dual-batch issues them in the order the plan recorded where it covers exactly these
// chains (else the DP's order), serial and lockstep re-issue them.
class ServedStageRunner : public StageRunner {
 public:
  // Resolves every plan's operator names on the planner's stage graph (errors name the file,
  // the iteration and the operator).
  static Result<std::unique_ptr<ServedStageRunner>> Create(
      std::unique_ptr<plan::StagePlanner> planner, ExecModel exec, const ServedPlans& plans);
  // `loads` is not used: each micro-batch runs at the load its plan was made for.
  Result<StageIteration> Run(const std::vector<double>& loads, bool trace) override;
  const plan::StagePlanner& planner() const override { return *planner_; }
  // Points whose recorded issue order did not cover this cost model's chains (dual-batch only).
  int reordered() const { return reordered_; }

 private:
  struct Unit {
    plan::Assignment assignment;
    double load = 1;
    std::vector<ServedIssueItem> order;
  };
  ServedStageRunner(std::unique_ptr<plan::StagePlanner> planner, ExecModel exec);
  std::unique_ptr<plan::StagePlanner> planner_;
  ExecModel exec_;
  std::vector<PointRef> points_;
  std::vector<std::map<std::pair<int, int>, Unit>> iterations_;  // (micro-batch, chunk) -> unit
  std::string source_;
  size_t next_ = 0;
  int reordered_ = 0;
};

// The issue items of `order` over `chains` when it issues every stage of every chain once, in
// chain order; empty otherwise.
std::vector<plan::IssueItem> RecordedItems(const plan::Chains& chains,
                                           const std::vector<ServedIssueItem>& order);

// Walks a stage's points in order: busy time, the memory curve and its peak. `bytes(mb, chunk)`
// is what a forward retains; `schedules[i]` is point i's placed work.
void WalkPoints(const std::vector<PointRef>& points, const std::vector<PointSchedule>& schedules,
                const std::vector<std::vector<double>>& bytes, bool trace, StageIteration& out);

}  // namespace bgl::sim
