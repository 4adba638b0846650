#include "tools/bgl-sim/simulator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "governor/planner/cost_model.h"
#include "tools/bgl-sim/options.h"
#include "tools/bgl-sim/static_plan.h"

namespace bgl::sim {
namespace {

const std::string kModels = BGL_MODELS_DIR;

SimConfig Config(const std::string& model, std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"--model", kModels + "/" + model};
  args.insert(args.end(), extra.begin(), extra.end());
  auto options = ParseOptions(args);
  EXPECT_TRUE(options.ok()) << options.status().message();
  auto config = BuildConfig(*options);
  EXPECT_TRUE(config.ok()) << config.status().message();
  return *config;
}

LoadTrace Trace(const SimConfig& c, int iterations, double spike_prob, uint64_t seed = 3) {
  LoadSpec spec;
  spec.spike_prob = spike_prob;
  spec.seed = seed;
  auto trace = GenerateLoads(spec, iterations, 2, static_cast<int>(c.model.MicroBatches()));
  EXPECT_TRUE(trace.ok());
  return *trace;
}

TEST(SimulatorTest, BagualuNeverExceedsCapacity) {
  for (const char* model : {"glm-423b-a30b.json", "tiny-moe.json"}) {
    const SimConfig config = Config(model);
    const LoadTrace trace = Trace(config, 25, 0.4);
    for (Policy policy : {Policy::kL3, Policy::kL4}) {
      auto sim = PolicySimulator::Create(config, policy);
      ASSERT_TRUE(sim.ok()) << sim.status().message();
      for (int it = 0; it < trace.iterations(); ++it) {
        auto rec = (*sim)->Step(trace, it, it == 0);
        ASSERT_TRUE(rec.ok()) << rec.status().message();
        EXPECT_LE(rec->peak_bytes, rec->capacity_bytes) << model << " iteration " << it;
        EXPECT_FALSE(rec->oom);
        EXPECT_DOUBLE_EQ(rec->restart_s, 0);
      }
      for (const StageIteration& stage : (*sim)->traced()) {
        for (const MemorySample& m : stage.memory) {
          EXPECT_LE(m.bytes, stage.capacity_bytes);
        }
      }
    }
  }
}

// The activation peak of a stage under a fixed assignment, from the planner's own cost model.
double IndependentPeak(const plan::StagePlanner& p, const plan::Assignment& a,
                       const std::vector<double>& loads) {
  return plan::BuildIterationCurve(
             p.steps(),
             [&](const plan::Step& s) {
               plan::UnitCost c;
               c.retained_bytes = p.evaluator().Evaluate(a, loads[s.micro_batch]).device_bytes;
               return c;
             })
      .peak_bytes;
}

TEST(SimulatorTest, StaticUnderOomsExactlyWhenThePeakExceedsCapacity) {
  // Cool-down 1: every iteration starts under-provisioned, so each one is judged on its own.
  SimConfig config = Config("glm-423b-a30b.json", {"--cooldown", "1"});
  const LoadTrace trace = Trace(config, 60, 0.25);
  auto sim = PolicySimulator::Create(config, Policy::kStaticUnder);
  ASSERT_TRUE(sim.ok());
  // The under-provisioned assignment, sized as the policy sizes it: for the tightest stage.
  std::vector<std::unique_ptr<plan::StagePlanner>> stages;
  double tightest = 0;
  for (int rank : {0, 7}) {
    plan::PlannerOptions options;
    options.pipeline_rank = rank;
    auto p = plan::StagePlanner::Create(config.model, config.hw, options);
    ASSERT_TRUE(p.ok());
    const double budget = StaticUnitBudget((*p)->activation_capacity(), (*p)->steps());
    if (stages.empty() || budget < tightest) tightest = budget;
    stages.push_back(std::move(*p));
  }
  const plan::Assignment under =
      StaticAssignment(Policy::kStaticUnder, stages[0]->evaluator(), config.design_load, tightest);
  int expected_ooms = 0;
  for (int it = 0; it < trace.iterations(); ++it) {
    bool over = false;
    for (size_t i = 0; i < stages.size(); ++i) {
      over |=
          IndependentPeak(*stages[i], under, trace.loads[it][i]) > stages[i]->activation_capacity();
    }
    expected_ooms += over ? 1 : 0;
    auto rec = (*sim)->Step(trace, it, false);
    ASSERT_TRUE(rec.ok()) << rec.status().message();
    EXPECT_EQ(rec->oom, over) << "iteration " << it << " load " << rec->max_load;
    if (rec->oom) {
      EXPECT_GE(rec->restart_s, config.restart_s);
      EXPECT_GT(rec->wasted_s, 0);
      EXPECT_DOUBLE_EQ(rec->time_s, rec->run_s + rec->wasted_s + rec->restart_s);
      EXPECT_EQ(rec->mode, "over");
    }
  }
  EXPECT_GT(expected_ooms, 0) << "the trace should contain spikes that overflow";
  EXPECT_LT(expected_ooms, trace.iterations()) << "normal iterations must fit";
  EXPECT_EQ((*sim)->Summary().ooms, expected_ooms);
}

TEST(SimulatorTest, AfterAnOomStaticUnderStaysOverProvisioned) {
  const SimConfig config = Config("glm-423b-a30b.json");
  const LoadTrace trace = Trace(config, 40, 0.3);
  auto sim = PolicySimulator::Create(config, Policy::kStaticUnder);
  ASSERT_TRUE(sim.ok());
  bool crashed = false;
  for (int it = 0; it < trace.iterations(); ++it) {
    auto rec = (*sim)->Step(trace, it, false);
    ASSERT_TRUE(rec.ok());
    if (crashed) {
      EXPECT_FALSE(rec->oom);
      EXPECT_EQ(rec->mode, "over");
    }
    crashed |= rec->oom;
  }
  EXPECT_TRUE(crashed);
  EXPECT_EQ((*sim)->Summary().ooms, 1);
}

void TimelineChecks(const char* model);

// Checks a traced stage: one stage at a time per resource, chains in order, points in sequence.
void CheckTimeline(const StageIteration& stage) {
  ASSERT_FALSE(stage.timeline.empty());
  constexpr double kEps = 1e-12;
  std::map<int, std::vector<Interval>> by_point;
  for (const Interval& iv : stage.timeline) {
    EXPECT_LE(iv.start_s, iv.end_s);
    by_point[iv.point].push_back(iv);
  }
  double previous_end = 0;
  for (auto& [point, intervals] : by_point) {
    double start = intervals.front().start_s, end = 0;
    for (const Interval& iv : intervals) {
      start = std::min(start, iv.start_s);
      end = std::max(end, iv.end_s);
    }
    EXPECT_GE(start + kEps, previous_end) << "point " << point << " overlaps the previous one";
    previous_end = end;
    for (int r = 0; r < plan::kResourceCount; ++r) {
      std::vector<Interval> on;
      for (const Interval& iv : intervals) {
        if (static_cast<int>(iv.resource) == r) on.push_back(iv);
      }
      std::sort(on.begin(), on.end(),
                [](const Interval& a, const Interval& b) { return a.start_s < b.start_s; });
      for (size_t i = 1; i < on.size(); ++i) {
        EXPECT_GE(on[i].start_s + kEps, on[i - 1].end_s)
            << "point " << point << ": two stages at once on "
            << plan::ResourceName(on[i].resource);
      }
    }
    for (int c = 0; c < plan::kChainCount; ++c) {
      std::vector<Interval> chain;
      for (const Interval& iv : intervals) {
        if (static_cast<int>(iv.chain) == c) chain.push_back(iv);
      }
      std::sort(chain.begin(), chain.end(),
                [](const Interval& a, const Interval& b) { return a.stage < b.stage; });
      for (size_t i = 0; i < chain.size(); ++i) {
        EXPECT_EQ(chain[i].stage, static_cast<int>(i)) << "a chain stage is missing";
        if (i > 0) {
          EXPECT_GE(chain[i].start_s + kEps, chain[i - 1].end_s)
              << "point " << point << ": chain " << plan::ChainName(chain[i].chain)
              << " out of order";
        }
      }
    }
  }
  EXPECT_NEAR(previous_end, stage.busy_s, 1e-9);
}

TEST(SimulatorTest, TimelineRespectsResourcesAndChainOrder) {
  // Interleaved 1F1B (423B: 2 chunks per rank) and plain 1F1B (tiny-moe).
  for (const char* model : {"glm-423b-a30b.json", "tiny-moe.json"}) {
    TimelineChecks(model);
  }
}

void TimelineChecks(const char* model) {
  SimConfig config = Config(model);
  const LoadTrace trace = Trace(config, 1, 1.0);
  for (Policy policy : {Policy::kL4, Policy::kL3, Policy::kKuaiLike, Policy::kStaticOver}) {
    for (ExecModel exec : {ExecModel::kSerial, ExecModel::kLockstep, ExecModel::kDualBatch}) {
      config.exec_override = true;
      config.exec = exec;
      auto sim = PolicySimulator::Create(config, policy);
      ASSERT_TRUE(sim.ok());
      ASSERT_TRUE((*sim)->Step(trace, 0, true).ok());
      ASSERT_EQ((*sim)->traced().size(), 2u);
      for (const StageIteration& stage : (*sim)->traced()) {
        SCOPED_TRACE(std::string(model) + " " + PolicyName(policy) + " rank " +
                     std::to_string(stage.rank));
        CheckTimeline(stage);
      }
    }
  }
}

TEST(SimulatorTest, SummaryIsConsistent) {
  const SimConfig config = Config("tiny-moe.json");
  const LoadTrace trace = Trace(config, 30, 0.2);
  for (Policy policy : AllPolicies()) {
    auto sim = PolicySimulator::Create(config, policy);
    ASSERT_TRUE(sim.ok()) << sim.status().message();
    double total = 0;
    for (int it = 0; it < trace.iterations(); ++it) {
      auto rec = (*sim)->Step(trace, it, false);
      ASSERT_TRUE(rec.ok());
      EXPECT_GT(rec->mfu, 0);
      EXPECT_LT(rec->mfu, 1);
      EXPECT_GT(rec->bubble_s, 0);
      total += rec->time_s;
    }
    const PolicySummary s = (*sim)->Summary();
    EXPECT_EQ(s.iterations, 30);
    EXPECT_NEAR(s.total_s, total, 1e-9 * total);
    EXPECT_GT(s.mfu, 0);
    EXPECT_LT(s.mfu, 1);
    EXPECT_GT(s.throughput_tflops, 0);
  }
}

}  // namespace
}  // namespace bgl::sim
