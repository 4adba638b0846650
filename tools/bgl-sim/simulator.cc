#include "tools/bgl-sim/simulator.h"

#include <algorithm>
#include <cmath>

#include "governor/planner/mitigation.h"
#include "tools/bgl-sim/static_plan.h"

namespace bgl::sim {
namespace {

// Static policies that apply one configuration to every stage (sized for the tightest stage).
bool UniformAcrossStages(Policy p) {
  return p == Policy::kStaticUnder || p == Policy::kStaticOver || p == Policy::kL1;
}

}  // namespace

Result<std::unique_ptr<PolicySimulator>> PolicySimulator::Create(const SimConfig& config,
                                                                 Policy policy) {
  BGL_RETURN_IF_ERROR(config.model.Validate());
  ExecModel exec = DefaultExecModel(policy);
  if (config.exec_override && policy != Policy::kL4) exec = config.exec;
  std::unique_ptr<PolicySimulator> sim(new PolicySimulator(config, policy, exec));
  const int pp = static_cast<int>(config.model.pp);
  if (sim->ranks_.empty()) {
    sim->ranks_.push_back(0);
    if (pp > 1) sim->ranks_.push_back(pp - 1);
  }
  for (int rank : sim->ranks_) {
    if (rank < 0 || rank >= pp) {
      return InvalidArgument("--ranks: rank " + std::to_string(rank) + " is outside [0, " +
                             std::to_string(pp) + ")");
    }
    plan::PlannerOptions options;
    options.capacity_bytes = config.capacity_bytes;
    options.pipeline_rank = rank;
    options.issue_policy =
        policy == Policy::kL4 ? plan::IssuePolicy::kDualBatch : plan::IssuePolicy::kSerial;
    // The issue-order cache times chains at the top of a load class; narrow classes keep the
    // simulated time at the load the micro-batch really has.
    options.schedule_load_class = config.schedule_load_class;
    auto planner = plan::StagePlanner::Create(config.model, config.hw, options);
    if (!planner.ok()) return planner.status();
    if (policy == Policy::kPlans) {
      if (config.plans == nullptr) return InvalidArgument("--policy plans: needs --plans FILE");
      auto runner = ServedStageRunner::Create(std::move(*planner), exec, *config.plans);
      if (!runner.ok()) return runner.status();
      sim->runners_.push_back(std::move(*runner));
    } else if (IsDynamic(policy)) {
      sim->runners_.push_back(std::make_unique<DynamicStageRunner>(std::move(*planner), exec));
    } else {
      sim->runners_.push_back(std::make_unique<StaticStageRunner>(std::move(*planner), exec));
    }
  }
  sim->Provision(config.design_load, policy == Policy::kStaticOver);
  return sim;
}

PolicySimulator::PolicySimulator(const SimConfig& config, Policy policy, ExecModel exec)
    : config_(config), policy_(policy), exec_(exec), ranks_(config.ranks) {}

void PolicySimulator::Provision(double design_load, bool over) {
  if (IsDynamic(policy_)) return;
  over_ = over;
  const Policy effective = over && policy_ == Policy::kStaticUnder ? Policy::kStaticOver : policy_;
  // Uniform policies size every stage for the tightest one.
  double tightest = 0;
  int tightest_index = 0;
  for (size_t i = 0; i < runners_.size(); ++i) {
    const plan::StagePlanner& p = runners_[i]->planner();
    const double budget = StaticUnitBudget(p.activation_capacity(), p.steps());
    if (i == 0 || budget < tightest) {
      tightest = budget;
      tightest_index = static_cast<int>(i);
    }
  }
  plan::Assignment uniform;
  if (UniformAcrossStages(effective)) {
    uniform = StaticAssignment(effective, runners_[tightest_index]->planner().evaluator(),
                               design_load, tightest);
  }
  for (auto& runner : runners_) {
    auto* stage = static_cast<StaticStageRunner*>(runner.get());
    const plan::StagePlanner& p = stage->planner();
    if (UniformAcrossStages(effective)) {
      stage->SetAssignment(uniform);
    } else {
      stage->SetAssignment(StaticAssignment(effective, p.evaluator(), design_load,
                                            StaticUnitBudget(p.activation_capacity(), p.steps())));
    }
  }
}

Result<PolicySimulator::Attempt> PolicySimulator::Attempt1(const LoadTrace& trace, int iteration,
                                                           bool trace_stages) {
  Attempt a;
  if (trace_stages) traced_.clear();
  const int pp = static_cast<int>(config_.model.pp);
  const double units = static_cast<double>(config_.model.MicroBatches() * config_.model.Chunks());
  const double bubble_factor = static_cast<double>(pp - 1) / units;
  double busy = 0;
  double first_over = -1;
  for (size_t i = 0; i < runners_.size(); ++i) {
    const auto& loads = trace.loads[iteration][std::min(i, trace.loads[iteration].size() - 1)];
    auto stage = runners_[i]->Run(loads, trace_stages);
    if (!stage.ok()) return stage.status();
    busy = std::max(busy, stage->busy_s);
    a.peak = std::max(a.peak, stage->peak_bytes);
    if (stage->first_over_s >= 0) {
      a.oom = true;
      first_over = first_over < 0 ? stage->first_over_s : std::min(first_over, stage->first_over_s);
    }
    a.planning_s += stage->planning_wall_s;
    a.fallbacks += stage->fallbacks;
    a.useful = stage->useful_flops;  // the same on every stage
    a.recompute = std::max(a.recompute, stage->recompute_flops);
    if (trace_stages) traced_.push_back(std::move(*stage));
  }
  a.bubble_s = busy * bubble_factor;
  a.run_s = busy + a.bubble_s;
  // Work is lost up to the crash; the pipeline stretches it by the same bubble factor.
  a.first_over_s = first_over < 0 ? -1 : first_over * (1 + bubble_factor);
  return a;
}

Result<IterationRecord> PolicySimulator::Step(const LoadTrace& trace, int iteration,
                                              bool trace_stages) {
  if (iteration < 0 || iteration >= trace.iterations()) {
    return InvalidArgument("iteration " + std::to_string(iteration) + " is outside the trace");
  }
  IterationRecord rec;
  rec.iteration = iteration;
  rec.max_load = trace.MaxLoad(iteration);
  rec.spike = trace.spike[iteration] != 0;
  // Cool-down over: the operator restarts into the under-provisioned configuration.
  if (over_ && config_.cooldown > 0 && policy_ != Policy::kStaticOver &&
      over_iterations_ >= config_.cooldown) {
    Provision(config_.design_load, false);
    over_iterations_ = 0;
    rec.restart_s += config_.restart_s;
  }
  auto attempt = Attempt1(trace, iteration, trace_stages);
  if (!attempt.ok()) return attempt.status();
  if (attempt->oom) {
    rec.oom = true;
    rec.wasted_s = attempt->first_over_s;
    rec.restart_s += config_.restart_s;
    if (!IsDynamic(policy_) && policy_ != Policy::kStaticOver) {
      // Re-provision for the imbalance just observed (static-under: full recompute), then redo.
      const double observed = std::ceil(std::max(rec.max_load, config_.design_load) * 10) / 10;
      Provision(observed, true);
      over_iterations_ = 0;
      attempt = Attempt1(trace, iteration, trace_stages);
      if (!attempt.ok()) return attempt.status();
    }
  }
  const plan::StagePlanner& p = runners_.front()->planner();
  rec.run_s = attempt->run_s;
  rec.bubble_s = attempt->bubble_s;
  rec.time_s = rec.run_s + rec.wasted_s + rec.restart_s;
  rec.peak_bytes = attempt->peak;
  rec.capacity_bytes = p.activation_capacity();
  rec.mfu = attempt->useful / (rec.time_s * config_.hw.peak_flops);
  rec.mode = IsDynamic(policy_) ? "dynamic" : over_ ? "over" : "under";
  rec.planning_ms = attempt->planning_s * 1e3;
  rec.fallbacks = attempt->fallbacks;
  if (over_) ++over_iterations_;
  useful_total_ += attempt->useful;
  recompute_total_ += attempt->recompute;
  records_.push_back(rec);
  return rec;
}

PolicySummary PolicySimulator::Summary() const {
  PolicySummary s;
  s.policy = policy_;
  s.exec = exec_;
  s.iterations = static_cast<int>(records_.size());
  if (records_.empty()) return s;
  double normal_mfu = 0, spike_mfu = 0;
  int normal = 0, spikes = 0;
  for (const auto& r : records_) {
    s.total_s += r.time_s;
    s.ooms += r.oom ? 1 : 0;
    s.restart_s += r.restart_s;
    s.wasted_s += r.wasted_s;
    s.planning_ms_mean += r.planning_ms;
    s.planning_ms_max = std::max(s.planning_ms_max, r.planning_ms);
    s.peak_bytes = std::max(s.peak_bytes, r.peak_bytes);
    s.capacity_bytes = r.capacity_bytes;
    if (r.spike) {
      spike_mfu += r.mfu;
      s.spike_s += r.time_s;
      ++spikes;
    } else {
      normal_mfu += r.mfu;
      ++normal;
    }
  }
  s.planning_ms_mean /= s.iterations;
  s.normal_mfu = normal ? normal_mfu / normal : 0;
  s.spike_mfu = spikes ? spike_mfu / spikes : 0;
  s.mfu = useful_total_ / (s.total_s * config_.hw.peak_flops);
  s.throughput_tflops = useful_total_ * static_cast<double>(config_.model.gpus) / s.total_s / 1e12;
  const double tokens_per_iteration =
      static_cast<double>(config_.model.dp * config_.model.MicroBatches() *
                          config_.model.micro_batch_size * config_.model.seq_len);
  s.tokens_per_s = tokens_per_iteration * s.iterations / s.total_s;
  s.recompute_share = useful_total_ > 0 ? recompute_total_ / useful_total_ : 0;
  for (const auto& runner : runners_) {
    if (const auto* served = dynamic_cast<const ServedStageRunner*>(runner.get())) {
      s.reordered_points += served->reordered();
    }
  }
  return s;
}

}  // namespace bgl::sim
