#include "governor/planner/planner.h"

#include <gtest/gtest.h>

#include <random>

#include "governor/planner/iteration.h"
#include "governor/planner/plan_format.h"

namespace bgl::plan {
namespace {

std::unique_ptr<StagePlanner> Make(const std::string& model, int64_t capacity, int rank = 0,
                                   PlannerOptions options = {}) {
  auto c = LoadModelConfig(std::string(BGL_MODELS_DIR) + "/" + model);
  EXPECT_TRUE(c.ok());
  options.capacity_bytes = capacity;
  options.pipeline_rank = rank;
  auto p = StagePlanner::Create(*c, *HardwareProfileByName(c->gpu), options);
  EXPECT_TRUE(p.ok()) << p.status().message();
  return p.ok() ? std::move(*p) : nullptr;
}

constexpr int64_t k64GB = int64_t{64} * 1000 * 1000 * 1000;

TEST(StagePlanner, BalancedIterationKeepsEverythingThatFits) {
  auto p = Make("glm-423b-a30b.json", k64GB);
  std::vector<double> loads(32, 1.0);
  auto replay = ReplayIteration(*p, loads);
  ASSERT_TRUE(replay.ok());
  EXPECT_LE(replay->planned.peak_bytes, p->activation_capacity());
  EXPECT_EQ(replay->infeasible_points, 0);
}

TEST(StagePlanner, SpikesStayWithinCapacity) {
  auto p = Make("glm-423b-a30b.json", k64GB);
  std::mt19937 rng(1);
  std::uniform_real_distribution<double> normal(0.9, 1.2);
  std::bernoulli_distribution spike(0.05);
  for (int iteration = 0; iteration < 20; ++iteration) {
    std::vector<double> loads(32);
    for (double& r : loads) r = spike(rng) ? 2.6 : normal(rng);
    auto replay = ReplayIteration(*p, loads);
    ASSERT_TRUE(replay.ok());
    EXPECT_LE(replay->planned.peak_bytes, p->activation_capacity() * (1 + 1e-9));
    EXPECT_GT(replay->keep_all.peak_bytes, replay->planned.peak_bytes - 1);
  }
  const auto stats = p->cache_stats();
  EXPECT_GT(stats.mitigation.hits, stats.mitigation.misses);
}

TEST(StagePlanner, CacheHitsRepeatThePlan) {
  auto p = Make("glm-423b-a30b.json", k64GB);
  std::vector<double> loads(32, 1.3);
  auto first = ReplayIteration(*p, loads);
  auto second = ReplayIteration(*p, loads);
  ASSERT_TRUE(first.ok() && second.ok());
  ASSERT_EQ(first->plans.size(), second->plans.size());
  int hits = 0;
  for (size_t i = 0; i < first->plans.size(); ++i) {
    EXPECT_EQ(first->plans[i].strategies, second->plans[i].strategies);
    EXPECT_EQ(first->plans[i].overlapped_s, second->plans[i].overlapped_s);
    hits += second->plans[i].cache_hit;
  }
  EXPECT_EQ(hits, static_cast<int>(second->plans.size()));
}

TEST(StagePlanner, DualBatchNeverSlowerThanProgramOrder) {
  PlannerOptions no_dp;
  no_dp.issue_policy = IssuePolicy::kLockstep;
  auto with = Make("glm-423b-a30b.json", k64GB);
  auto without = Make("glm-423b-a30b.json", k64GB, 0, no_dp);
  std::vector<double> loads(32, 1.6);
  auto a = ReplayIteration(*with, loads);
  auto b = ReplayIteration(*without, loads);
  ASSERT_TRUE(a.ok() && b.ok());
  double ta = 0, tb = 0;
  for (const auto& plan : a->plans) ta += plan.overlapped_s;
  for (const auto& plan : b->plans) tb += plan.overlapped_s;
  EXPECT_LT(ta, tb);
}

TEST(StagePlanner, LastRankRunsEachForwardAndItsBackwardAsTwoPoints) {
  auto p = Make("glm-423b-a30b.json", k64GB, /*rank=*/7);
  std::vector<double> loads(32, 1.0);
  auto replay = ReplayIteration(*p, loads);
  ASSERT_TRUE(replay.ok()) << replay.status().message();
  int forwards = 0;
  for (const auto& plan : replay->plans) forwards += plan.micro_batch >= 0;
  EXPECT_EQ(forwards, 32 * 2);  // every forward of every chunk planned once
}

TEST(StagePlanner, DualBatchOrderBeatsSerialAndLockstep) {
  double total[3] = {0, 0, 0};
  const IssuePolicy policies[3] = {IssuePolicy::kDualBatch, IssuePolicy::kLockstep,
                                   IssuePolicy::kSerial};
  for (int i = 0; i < 3; ++i) {
    PlannerOptions options;
    options.issue_policy = policies[i];
    auto p = Make("glm-423b-a30b.json", k64GB, 0, options);
    auto replay = ReplayIteration(*p, std::vector<double>(32, 2.0));
    ASSERT_TRUE(replay.ok());
    for (const auto& plan : replay->plans) {
      total[i] += plan.overlapped_s;
      EXPECT_LE(plan.overlapped_s, plan.serial_s + 1e-12);
    }
  }
  EXPECT_LE(total[0], total[1]);
  EXPECT_LE(total[0], total[2]);
}

TEST(StagePlanner, BadPointsAreRejectedAndStateIsKept) {
  auto p = Make("tiny-moe.json", int64_t{2} << 30);
  SchedulePoint ok;
  ok.forward_micro_batch = 0;
  ASSERT_TRUE(p->PlanPoint(ok).ok());
  const double used = p->used_bytes();
  auto expect = [&](SchedulePoint point, const std::string& field) {
    auto r = p->PlanPoint(point);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(field), std::string::npos) << r.status().message();
    EXPECT_EQ(p->used_bytes(), used);
  };
  SchedulePoint bad = ok;
  bad.forward_micro_batch = 99;
  expect(bad, "forward_micro_batch");
  bad = ok;
  bad.forward_chunk = 3;
  expect(bad, "forward_chunk");
  bad = ok;
  bad.load_factor = -1;
  expect(bad, "load_factor");
  bad.load_factor = std::numeric_limits<double>::quiet_NaN();
  expect(bad, "load_factor");
  bad = ok;
  bad.bytes_in_use = -7;
  expect(bad, "bytes_in_use");
  bad = SchedulePoint{};
  expect(bad, "forward_micro_batch");
  EXPECT_EQ(p->Report(5, 0, 100).code(), StatusCode::kNotFound);
  EXPECT_EQ(p->Report(0, 0, -1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(p->PlanAfterGate(0, 0, 42, 1.0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(p->PlanAfterGate(7, 0, 0, 1.0).status().code(), StatusCode::kNotFound);
}

TEST(StagePlanner, CapacityBelowWeightsIsAnError) {
  auto c = LoadModelConfig(std::string(BGL_MODELS_DIR) + "/glm-423b-a30b.json");
  PlannerOptions options;
  options.capacity_bytes = int64_t{8} << 30;
  auto p = StagePlanner::Create(*c, *HardwareProfileByName("paper"), options);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("capacity"), std::string::npos);
  options.pipeline_rank = 8;
  options.capacity_bytes = 0;
  EXPECT_FALSE(StagePlanner::Create(*c, *HardwareProfileByName("paper"), options).ok());
}

TEST(StagePlanner, DeferredPlanningAfterTheGate) {
  auto p = Make("glm-423b-a30b.json", k64GB);
  // Fill the warmup at balanced load, then a steady forward that spikes at its gate.
  std::vector<double> loads(32, 1.0);
  const auto& steps = p->steps();
  SchedulePoint point;
  size_t i = 0;
  for (; i < steps.size() && steps[i].phase == Phase::kWarmup; ++i) {
    point = {};
    point.forward_micro_batch = steps[i].micro_batch;
    point.forward_chunk = steps[i].chunk;
    ASSERT_TRUE(p->PlanPoint(point).ok());
  }
  point = {};
  point.forward_micro_batch = steps[i].micro_batch;
  point.forward_chunk = steps[i].chunk;
  point.backward_micro_batch = steps[i + 1].micro_batch;
  point.backward_chunk = steps[i + 1].chunk;
  auto plan = p->PlanPoint(point);
  ASSERT_TRUE(plan.ok());
  auto revised = p->PlanAfterGate(point.forward_micro_batch, point.forward_chunk, 0, 2.6);
  ASSERT_TRUE(revised.ok());
  EXPECT_TRUE(revised->deferred);
  EXPECT_LE(revised->predicted_bytes, revised->budget_bytes);
  EXPECT_FALSE(revised->issue_order.empty());
  const std::string table = FormatPlanTable(*revised, *p);
  EXPECT_NE(table.find("recompute"), std::string::npos);
  EXPECT_EQ(PlanToJson(*revised, p->graph())["deferred"], true);
}

}  // namespace
}  // namespace bgl::plan
