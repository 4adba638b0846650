#include "governor/planner/planner.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
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

// Issue 14: one forward under pressure, planned with a host limit and a bandwidth share.
Plan PlanUnderPressure(int64_t host_limit, double share) {
  auto p = Make("glm-423b-a30b.json", k64GB);
  SchedulePoint point;
  point.forward_micro_batch = 0;
  point.load_factor = 2.6;
  point.bytes_in_use = static_cast<int64_t>(p->activation_capacity() * 0.85);
  point.host_limit_bytes = host_limit;
  point.bandwidth_share = share;
  EXPECT_TRUE(p->PlanPoint(point).ok());
  // The second forward's point also runs the first one's offloads (chain O).
  point.forward_micro_batch = 1;
  point.bytes_in_use = -1;
  auto plan = p->PlanPoint(point);
  EXPECT_TRUE(plan.ok()) << plan.status().message();
  return plan.ok() ? *plan : Plan{};
}

TEST(StagePlanner, HostLimitBoundsThePlansHostBytes) {
  const Plan free = PlanUnderPressure(-1, 1.0);
  ASSERT_GT(free.host_bytes, 0) << "the scenario must offload without a limit";
  const int64_t step = PlannerOptions{}.budget_step_bytes;
  for (int64_t limit : {int64_t{0}, step - 1, step, 4 * step, free.host_bytes / 2,
                        free.host_bytes - 1, free.host_bytes + step}) {
    const Plan limited = PlanUnderPressure(limit, 1.0);
    EXPECT_LE(limited.host_bytes, limit) << "limit " << limit;
    EXPECT_LE(limited.predicted_bytes, limited.budget_bytes) << "limit " << limit;
    // Less host means more recompute/FP8: never a cheaper plan.
    EXPECT_GE(limited.overhead_s, free.overhead_s - 1e-12) << "limit " << limit;
  }
  EXPECT_EQ(PlanUnderPressure(0, 1.0).host_bytes, 0);
}

TEST(StagePlanner, BandwidthShareSlowsTheCopies) {
  const Plan full = PlanUnderPressure(-1, 1.0);
  const Plan half = PlanUnderPressure(-1, 0.5);
  EXPECT_EQ(full.bandwidth_share, 1.0);
  EXPECT_EQ(half.bandwidth_share, 0.5);
  EXPECT_GE(half.overhead_s, full.overhead_s - 1e-12);
  double d2h_full = 0, d2h_half = 0;
  for (const IssueItem& item : full.issue_order) {
    if (item.resource == Resource::kD2H || item.resource == Resource::kH2D) {
      d2h_full += item.duration_s;
    }
  }
  for (const IssueItem& item : half.issue_order) {
    if (item.resource == Resource::kD2H || item.resource == Resource::kH2D) {
      d2h_half += item.duration_s;
    }
  }
  ASSERT_GT(d2h_full, 0) << "the scenario must offload";
  // Per byte on host, halving the bandwidth must lengthen the copies.
  ASSERT_GT(half.host_bytes, 0) << "the shared plan must offload too";
  EXPECT_GT(d2h_half / static_cast<double>(half.host_bytes),
            d2h_full / static_cast<double>(full.host_bytes));
  EXPECT_GE(half.serial_s, full.serial_s - 1e-12);
  // Shares are rounded down to 1/16: 1/3 plans as 5/16.
  EXPECT_DOUBLE_EQ(PlanUnderPressure(-1, 1.0 / 3).bandwidth_share, 5.0 / 16);
}

TEST(StagePlanner, BadHostLimitOrShareIsRejected) {
  auto p = Make("glm-423b-a30b.json", k64GB);
  SchedulePoint point;
  point.forward_micro_batch = 0;
  point.host_limit_bytes = -2;
  auto bad = p->PlanPoint(point);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("host_limit_bytes"), std::string::npos);
  point.host_limit_bytes = -1;
  for (double share : {0.0, -1.0, 1.5, std::nan("")}) {
    point.bandwidth_share = share;
    auto b = p->PlanPoint(point);
    ASSERT_FALSE(b.ok());
    EXPECT_NE(b.status().message().find("bandwidth_share"), std::string::npos);
  }
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
  // At the load it was planned for the plan still fits: not revised (deferred false, the same
  // strategies, no issue order computed: the caller keeps its own).
  auto same =
      p->PlanAfterGate(point.forward_micro_batch, point.forward_chunk, 0, plan->load_factor);
  ASSERT_TRUE(same.ok());
  EXPECT_FALSE(same->deferred);
  EXPECT_EQ(same->strategies, plan->strategies);
  EXPECT_TRUE(same->issue_order.empty());
  EXPECT_LE(same->predicted_bytes, same->budget_bytes);
  EXPECT_EQ(PlanToJson(*same, p->graph())["deferred"], false);
  auto revised = p->PlanAfterGate(point.forward_micro_batch, point.forward_chunk, 0, 2.6);
  ASSERT_TRUE(revised.ok());
  EXPECT_TRUE(revised->deferred);
  EXPECT_LE(revised->predicted_bytes, revised->budget_bytes);
  EXPECT_FALSE(revised->issue_order.empty());
  // The plan no longer fits at 2.6: the rest of the chunk is planned again (issue 43), never
  // costlier than the fixed rule (its MoE blocks to recompute), which the plan was before.
  EXPECT_NE(revised->strategies, plan->strategies);
  Assignment rule = plan->strategies;
  for (size_t o = 0; o < rule.size(); ++o) {
    if (IsMoeBlock(p->graph().ops[o].kind) &&
        p->evaluator().Allowed(static_cast<int>(o), Strategy::kRecompute)) {
      rule[o] = Strategy::kRecompute;
    }
  }
  EXPECT_LE(revised->overhead_s, p->evaluator().Evaluate(rule, 2.6).exposed_s + 1e-12);
  EXPECT_FALSE(FormatPlanTable(*revised, *p).empty());
  EXPECT_EQ(PlanToJson(*revised, p->graph())["deferred"], true);
}

// The C ABI's plan text (PlanToJsonText, written without the document) reads back as the very
// document PlanToJson builds, key for key and value for value: the plans of a real schedule (points
// with issue orders, a revision after the gate, one that still fits) and a plan whose names and
// numbers need escaping or a particular form (quotes, control characters, UTF-8, integral,
// tiny, huge and non-finite doubles).
TEST(PlanFormat, TheTextReadsBackAsTheDocument) {
  auto p = Make("glm-423b-a30b.json", k64GB);
  const auto same = [&](const Plan& plan, const StageGraph& g) {
    const std::string text = PlanToJsonText(plan, g);
    const nlohmann::json doc = PlanToJson(plan, g);
    const nlohmann::json back = nlohmann::json::parse(text);  // throws on malformed text
    EXPECT_EQ(back, nlohmann::json::parse(doc.dump()));       // (NaN and inf write as null)
    EXPECT_EQ(back.dump(), doc.dump());                       // the same values of the same types
    // ... under the same keys in the same order (the document's are sorted), at every level
    const nlohmann::ordered_json ordered = nlohmann::ordered_json::parse(text);
    const auto keys = [](const auto& object) {
      std::vector<std::string> out;
      for (auto it = object.begin(); it != object.end(); ++it) out.push_back(it.key());
      return out;
    };
    EXPECT_EQ(keys(ordered), keys(doc));
    for (const char* list : {"operators", "issue_order"}) {
      for (size_t i = 0; i < doc[list].size(); ++i) {
        EXPECT_EQ(keys(ordered[list][i]), keys(doc[list][i])) << list << " " << i;
      }
    }
  };
  int checked = 0;
  for (const auto& step : p->steps()) {
    SchedulePoint point;
    point.phase = step.phase;
    point.forward_micro_batch = step.micro_batch;
    point.forward_chunk = step.chunk;
    point.load_factor = checked % 3 == 2 ? 1.7 : 1.0;
    auto plan = p->PlanPoint(point);
    ASSERT_TRUE(plan.ok()) << plan.status().message();
    same(*plan, p->graph());
    if (!plan->issue_order.empty()) ++checked;
    auto gate = p->PlanAfterGate(point.forward_micro_batch, point.forward_chunk, 0, 2.6);
    ASSERT_TRUE(gate.ok());
    same(*gate, p->graph());
    if (checked >= 6) break;
  }
  EXPECT_GE(checked, 1);
  StageGraph g = p->graph();
  ASSERT_FALSE(g.ops.empty());
  g.ops[0].name = "say \"hi\"\\ tab\t nl\n ctl\x01 \xc3\xa9t\xc3\xa9";
  Plan odd;
  odd.strategies.assign(g.ops.size(), Strategy::kOffload);
  odd.load_factor = 2.0;
  odd.overhead_s = 1e-7;
  odd.serial_s = 1e300;
  odd.overlapped_s = std::numeric_limits<double>::quiet_NaN();
  odd.bandwidth_share = std::numeric_limits<double>::infinity();
  odd.budget_bytes = int64_t{1} << 62;
  odd.free_bytes = -5;
  odd.issue_order.push_back({Chain::kOffload, 0, 0, Resource::kD2H, 0.0001, -1, -1});
  odd.issue_order.push_back({Chain::kForward, 1, 2, Resource::kCompute, 123456789012.0, 0, 0});
  same(odd, g);
}

// The downgrade's search is priced by what it measured (PlannerOptions::gate_search_share):
// every revision that searched is counted with its time, and a share of 0 never cuts one; a
// share outside [0, 1] is refused naming the option.
TEST(StagePlanner, TheGatesSearchesAreCountedAndPriced) {
  for (const double share : {0.0, 0.25}) {
    PlannerOptions options;
    options.gate_search_share = share;
    auto p = Make("glm-423b-a30b.json", k64GB, 0, options);
    const auto& steps = p->steps();
    size_t i = 0;
    for (; i < steps.size() && steps[i].phase == Phase::kWarmup; ++i) {
      SchedulePoint point;
      point.forward_micro_batch = steps[i].micro_batch;
      point.forward_chunk = steps[i].chunk;
      ASSERT_TRUE(p->PlanPoint(point).ok());
    }
    ASSERT_GE(i, 2u);
    int revised = 0;
    for (size_t u = 0; u < 2; ++u) {  // two forwards of the warmup spike at their last gate
      for (const double r : {2.0, 2.6}) {
        auto plan =
            p->PlanAfterGate(steps[u].micro_batch, steps[u].chunk, p->graph().layers - 1, r);
        ASSERT_TRUE(plan.ok()) << plan.status().message();
        revised += plan->deferred ? 1 : 0;
      }
    }
    const PlannerCacheStats stats = p->cache_stats();
    EXPECT_GT(revised, 0) << "the spike must revise a plan";
    EXPECT_LE(stats.gate_searches + stats.gate_searches_cut, static_cast<uint64_t>(2 * revised));
    EXPECT_EQ(stats.gate_search_s > 0, stats.gate_searches > 0);
    if (share == 0) {
      EXPECT_EQ(stats.gate_searches_cut, 0u);
      EXPECT_GT(stats.gate_searches, 0u) << "no revision left the search anything to remove";
    }
  }
  auto c = LoadModelConfig(std::string(BGL_MODELS_DIR) + "/glm-423b-a30b.json");
  ASSERT_TRUE(c.ok());
  for (const double bad : {-0.5, 1.01, std::nan("")}) {
    PlannerOptions options;
    options.gate_search_share = bad;
    auto p = StagePlanner::Create(*c, *HardwareProfileByName(c->gpu), options);
    ASSERT_FALSE(p.ok()) << bad;
    EXPECT_NE(p.status().message().find("gate_search_share: "), std::string::npos)
        << p.status().message();
  }
}

}  // namespace
}  // namespace bgl::plan
