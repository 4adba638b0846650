// bgl-sim --plans (issue 42): the plans a run was served, read and replayed; bad files refused
// naming what is wrong.
#include "tools/bgl-sim/served_plans.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "governor/planner/mitigation.h"
#include "tools/bgl-sim/options.h"
#include "tools/bgl-sim/simulator.h"
#include "tools/bgl-sim/stage_runner.h"

namespace bgl::sim {
namespace {

const std::string kModels = BGL_MODELS_DIR;

SimConfig Config() {
  auto options = ParseOptions({"--model", kModels + "/tiny-moe.json", "--ranks", "0"});
  EXPECT_TRUE(options.ok()) << options.status().message();
  auto config = BuildConfig(*options);
  EXPECT_TRUE(config.ok()) << config.status().message();
  return *config;
}

std::unique_ptr<plan::StagePlanner> Planner(const SimConfig& c) {
  plan::PlannerOptions options;
  options.capacity_bytes = c.capacity_bytes;
  options.pipeline_rank = 0;
  auto p = plan::StagePlanner::Create(c.model, c.hw, options);
  EXPECT_TRUE(p.ok()) << p.status().message();
  return std::move(*p);
}

// A plans document giving every micro-batch of `iterations` iterations `a`.
nlohmann::json Document(const plan::StageGraph& g, const plan::Assignment& a, int micro_batches,
                        int iterations) {
  nlohmann::json ops = nlohmann::json::array();
  for (size_t o = 0; o < g.ops.size(); ++o) {
    ops.push_back({{"name", g.ops[o].name}, {"strategy", plan::StrategyName(a[o])}});
  }
  nlohmann::json its = nlohmann::json::array();
  for (int it = 0; it < iterations; ++it) {
    nlohmann::json plans = nlohmann::json::array();
    for (int mb = 0; mb < micro_batches; ++mb) {
      plans.push_back(
          {{"micro_batch", mb}, {"chunk", 0}, {"load_factor", 1.0}, {"operators", ops}});
    }
    its.push_back({{"plans", plans}});
  }
  return {{"format", "bgl-served-plans"}, {"version", 1}, {"iterations", its}};
}

std::string Error(const std::string& text) {
  auto p = ParseServedPlans(text, "x.plans.json");
  EXPECT_FALSE(p.ok()) << text;
  return p.ok() ? "" : p.status().message();
}

TEST(ServedPlansTest, BadDocumentsAreRefusedNamingTheField) {
  EXPECT_NE(Error("{").find("not valid JSON"), std::string::npos);
  EXPECT_NE(Error(R"({"format": "other", "version": 1, "iterations": []})").find("format"),
            std::string::npos);
  EXPECT_NE(
      Error(R"({"format": "bgl-served-plans", "version": 2, "iterations": [{}]})").find("version"),
      std::string::npos);
  const std::string head = R"({"format": "bgl-served-plans", "version": 1, "iterations": [)";
  EXPECT_NE(Error(head + R"({"plans": [{"micro_batch": 0, "operators": [{"name": "L0.a",
            "strategy": "swap"}]}]}]})")
                .find("iterations[0].plans[0].operators[0].strategy: unknown strategy"),
            std::string::npos);
  EXPECT_NE(Error(head + R"({"plans": [{"micro_batch": -1, "operators": []}]}]})")
                .find("iterations[0].plans[0].micro_batch"),
            std::string::npos);
  EXPECT_NE(Error(head + R"({"plans": [{"micro_batch": 0, "load_factor": 0,
            "operators": [{"name": "a", "strategy": "keep"}]}]}]})")
                .find("load_factor"),
            std::string::npos);
  EXPECT_NE(Error(head + R"({"plans": [{"micro_batch": 0, "operators": [{"name": "a",
            "strategy": "keep"}], "issue_order": [{"chain": "X", "stage": 0, "round": 0}]}]}]})")
                .find("issue_order[0].chain"),
            std::string::npos);
  const std::string twice = head + R"({"plans": [
      {"micro_batch": 1, "operators": [{"name": "a", "strategy": "keep"}]},
      {"micro_batch": 1, "operators": [{"name": "a", "strategy": "keep"}]}]}]})";
  EXPECT_NE(Error(twice).find("a second plan for micro-batch 1"), std::string::npos);
}

TEST(ServedPlansTest, OperatorsMustMatchTheStageGraph) {
  const SimConfig c = Config();
  auto planner = Planner(c);
  const plan::StageGraph& g = planner->graph();
  const int mbs = static_cast<int>(c.model.MicroBatches());
  nlohmann::json doc = Document(g, plan::FullRecompute(planner->evaluator()), mbs, 1);
  doc["iterations"][0]["plans"][1]["operators"][2]["name"] = "L9.nothing";
  auto plans = ParseServedPlans(doc.dump(), "x.plans.json");
  ASSERT_TRUE(plans.ok()) << plans.status().message();
  auto runner = ServedStageRunner::Create(Planner(c), ExecModel::kSerial, *plans);
  ASSERT_FALSE(runner.ok());
  EXPECT_NE(runner.status().message().find("iterations[0].plans[1]: operator 'L9.nothing'"),
            std::string::npos)
      << runner.status().message();
  // Dropping an operator leaves it without a strategy.
  doc = Document(g, plan::FullRecompute(planner->evaluator()), mbs, 1);
  doc["iterations"][0]["plans"][0]["operators"].erase(0);
  plans = ParseServedPlans(doc.dump(), "x.plans.json");
  ASSERT_TRUE(plans.ok());
  runner = ServedStageRunner::Create(Planner(c), ExecModel::kSerial, *plans);
  ASSERT_FALSE(runner.ok());
  EXPECT_NE(runner.status().message().find("no strategy for operator '" + g.ops[0].name + "'"),
            std::string::npos)
      << runner.status().message();
  // A micro-batch without a plan is named when its point runs.
  doc = Document(g, plan::FullRecompute(planner->evaluator()), mbs, 1);
  doc["iterations"][0]["plans"].erase(mbs - 1);
  plans = ParseServedPlans(doc.dump(), "x.plans.json");
  ASSERT_TRUE(plans.ok());
  EXPECT_FALSE(LoadsFromPlans(*plans, 1, mbs, 1.2).ok());
  runner = ServedStageRunner::Create(Planner(c), ExecModel::kSerial, *plans);
  ASSERT_TRUE(runner.ok());
  auto run = (*runner)->Run(std::vector<double>(mbs, 1.0), false);
  ASSERT_FALSE(run.ok());
  EXPECT_NE(run.status().message().find("no plan for micro-batch " + std::to_string(mbs - 1)),
            std::string::npos);
}

// Replaying one assignment for every micro-batch is the static policy of that assignment: the
// same time and memory in every execution model, and one iteration per iteration of the file.
TEST(ServedPlansTest, ReplayOfOneAssignmentIsThatStaticPlan) {
  const SimConfig c = Config();
  auto probe = Planner(c);
  const int mbs = static_cast<int>(c.model.MicroBatches());
  plan::Assignment a = plan::FullRecompute(probe->evaluator());
  // Something to copy too: offload what recompute leaves alone where allowed.
  for (size_t o = 0; o < a.size(); o += 3) {
    if (probe->evaluator().Allowed(static_cast<int>(o), plan::Strategy::kOffload)) {
      a[o] = plan::Strategy::kOffload;
    }
  }
  auto plans = ParseServedPlans(Document(probe->graph(), a, mbs, 2).dump(), "x.plans.json");
  ASSERT_TRUE(plans.ok()) << plans.status().message();
  for (ExecModel e : {ExecModel::kSerial, ExecModel::kLockstep, ExecModel::kDualBatch}) {
    StaticStageRunner fixed(Planner(c), e);
    fixed.SetAssignment(a);
    auto served = ServedStageRunner::Create(Planner(c), e, *plans);
    ASSERT_TRUE(served.ok()) << served.status().message();
    const std::vector<double> loads(mbs, 1.0);
    for (int it = 0; it < 2; ++it) {
      auto want = fixed.Run(loads, false);
      auto got = (*served)->Run(loads, false);
      ASSERT_TRUE(want.ok() && got.ok());
      EXPECT_NEAR(got->busy_s, want->busy_s, 1e-12 * want->busy_s) << ExecModelName(e);
      EXPECT_DOUBLE_EQ(got->peak_bytes, want->peak_bytes);
      EXPECT_DOUBLE_EQ(got->recompute_flops, want->recompute_flops);
    }
    EXPECT_FALSE((*served)->Run(loads, false).ok()) << "a third iteration of two";
    // No order was recorded: under dual-batch every point takes the DP's.
    const int points = static_cast<int>(GroupPoints(fixed.planner().steps()).size());
    EXPECT_EQ((*served)->reordered(), e == ExecModel::kDualBatch ? 2 * points : 0);
  }
}

TEST(ServedPlansTest, RecordedIssueOrderIsUsedWhereItCoversTheChains) {
  plan::Chains chains;
  chains[0] = {{plan::Resource::kCompute, 1.0, 0, 0}, {plan::Resource::kCompute, 2.0, 1, 1}};
  chains[2] = {{plan::Resource::kD2H, 3.0, 0, 0}};
  // F0 with O0, then F1: 3 + 2.
  const std::vector<ServedIssueItem> order = {
      {plan::Chain::kForward, 0, 0}, {plan::Chain::kOffload, 0, 0}, {plan::Chain::kForward, 1, 1}};
  const auto items = RecordedItems(chains, order);
  ASSERT_EQ(items.size(), 3u);
  EXPECT_DOUBLE_EQ(ScheduleRounds(items, false).duration_s, 5.0);
  // The offload last instead: 1 + 2 + 3.
  const auto late = RecordedItems(chains, {{plan::Chain::kForward, 0, 0},
                                           {plan::Chain::kForward, 1, 1},
                                           {plan::Chain::kOffload, 0, 2}});
  EXPECT_DOUBLE_EQ(ScheduleRounds(late, false).duration_s, 6.0);
  // Stages skipped, repeated or beyond the chain: not this cost model's chains.
  EXPECT_TRUE(RecordedItems(chains, {{plan::Chain::kForward, 0, 0}}).empty());
  EXPECT_TRUE(RecordedItems(chains, {{plan::Chain::kForward, 1, 0},
                                     {plan::Chain::kForward, 0, 1},
                                     {plan::Chain::kOffload, 0, 1}})
                  .empty());
  EXPECT_TRUE(RecordedItems(chains, {{plan::Chain::kForward, 0, 0},
                                     {plan::Chain::kForward, 1, 1},
                                     {plan::Chain::kForward, 2, 2},
                                     {plan::Chain::kOffload, 0, 2}})
                  .empty());
}

TEST(ServedPlansTest, OptionsNeedBothThePoliciesAndTheFile) {
  const std::string model = kModels + "/tiny-moe.json";
  auto o = ParseOptions({"--model", model, "--policy", "plans"});
  ASSERT_FALSE(o.ok());
  EXPECT_NE(o.status().message().find("--policy plans: needs --plans FILE"), std::string::npos);
  o = ParseOptions({"--model", model, "--plans", "p.json", "--policy", "L4"});
  ASSERT_FALSE(o.ok());
  EXPECT_NE(o.status().message().find("--plans"), std::string::npos);
  o = ParseOptions({"--model", model, "--plans", "/no/such/p.json"});
  ASSERT_TRUE(o.ok());
  ASSERT_EQ(o->policies, std::vector<Policy>{Policy::kPlans});
  auto c = BuildConfig(*o);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("cannot open '/no/such/p.json'"), std::string::npos);
  // Not in the groups.
  auto all = ParsePolicies("all");
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(std::count(all->begin(), all->end(), Policy::kPlans), 0);
}

}  // namespace
}  // namespace bgl::sim
