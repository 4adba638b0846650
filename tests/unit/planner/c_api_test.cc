#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "bgl/planner.h"

namespace {

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string Take(char* text) {
  std::string out = text ? text : "";
  bgl_planner_free_string(text);
  return out;
}

TEST(PlannerCApi, PlansAndReports) {
  const std::string model = Slurp(std::string(BGL_MODELS_DIR) + "/tiny-moe.json");
  bgl_planner* p = bgl_planner_create(
      model.c_str(), R"({"capacity_bytes": 2147483648, "budget_step_bytes": 1048576})");
  ASSERT_NE(p, nullptr) << bgl_planner_last_error();
  const auto described = nlohmann::json::parse(Take(bgl_planner_describe(p)));
  EXPECT_EQ(described["micro_batches"], 8);
  EXPECT_FALSE(described["operators"].empty());
  const std::string plan =
      Take(bgl_planner_plan(p, R"({"forward_micro_batch": 0, "load_factor": 2.6})"));
  ASSERT_FALSE(plan.empty()) << bgl_planner_last_error();
  const auto j = nlohmann::json::parse(plan);
  EXPECT_EQ(j["micro_batch"], 0);
  EXPECT_EQ(j["operators"].size(), described["operators"].size());
  EXPECT_EQ(bgl_planner_report(p, 0, 0, j["predicted_bytes"].get<int64_t>()), 0);
  EXPECT_FALSE(Take(bgl_planner_plan_after_gate(p, 0, 0, 0, 2.6)).empty());
  bgl_planner_reset_iteration(p);
  bgl_planner_destroy(p);
}

// bgl_planner_warm_up starts the warm-up before any point (a planner registered again between
// iterations warms up in the gap); its bad arguments and a planner without a warm-up are refused
// with a message, and the planner plans on.
TEST(PlannerCApi, TheWarmUpStartsWhenAskedBeforeAnyPoint) {
  const std::string model = Slurp(std::string(BGL_MODELS_DIR) + "/tiny-moe.json");
  bgl_planner* off = bgl_planner_create(model.c_str(), R"({"budget_step_bytes": 1048576})");
  ASSERT_NE(off, nullptr) << bgl_planner_last_error();
  EXPECT_EQ(bgl_planner_warm_up(off, -1, 1.0), -1);
  EXPECT_NE(std::string(bgl_planner_last_error()).find("without the warm-up"), std::string::npos);
  bgl_planner_destroy(off);
  EXPECT_EQ(bgl_planner_warm_up(nullptr, -1, 1.0), -1);
  bgl_planner* p = bgl_planner_create(model.c_str(), R"({"capacity_bytes": 2147483648,
      "budget_step_bytes": 1048576, "warm_up": true, "warm_spike_bound": 1.5})");
  ASSERT_NE(p, nullptr) << bgl_planner_last_error();
  for (double share : {0.0, -1.0, 1.5}) {
    EXPECT_EQ(bgl_planner_warm_up(p, -1, share), -1) << share;
    EXPECT_NE(std::string(bgl_planner_last_error()).find("bandwidth_share"), std::string::npos);
  }
  EXPECT_EQ(bgl_planner_warm_up(p, -7, 1.0), -1);
  EXPECT_NE(std::string(bgl_planner_last_error()).find("host_limit_bytes"), std::string::npos);
  auto stats = [&] { return nlohmann::json::parse(Take(bgl_planner_stats(p))); };
  EXPECT_EQ(stats()["warm_rounds"], 0);  // nothing started by the refusals
  ASSERT_EQ(bgl_planner_warm_up(p, -1, 1.0), 0) << bgl_planner_last_error();
  // started, with no point planned (a round that landed may have started the next one)
  EXPECT_GE(stats()["warm_rounds"], 1);
  EXPECT_EQ(bgl_planner_warm_up(p, -1, 1.0), 0);  // a second call succeeds (already started)
  EXPECT_FALSE(Take(bgl_planner_plan(p, R"({"forward_micro_batch": 0})")).empty())
      << bgl_planner_last_error();
  bgl_planner_destroy(p);
}

TEST(PlannerCApi, ScheduleWithoutAModel) {
  // Rank 0 of 2, 4 micro-batches, 2 chunks: Megatron's warm-up of (2-0-1)*2 + (2-1)*2 = 4.
  const auto steps = nlohmann::json::parse(Take(bgl_planner_schedule(2, 0, 4, 2)));
  ASSERT_EQ(steps.size(), 16u);
  int warmup = 0;
  for (const auto& s : steps) warmup += s["phase"] == "warmup";
  EXPECT_EQ(warmup, 4);
  EXPECT_EQ(steps[2]["chunk"], 1);
  EXPECT_EQ(steps[2]["micro_batch"], 0);
  EXPECT_EQ(bgl_planner_schedule(2, 0, 3, 2), nullptr);
  EXPECT_NE(std::string(bgl_planner_last_error()).find("divisible"), std::string::npos);
  EXPECT_EQ(bgl_planner_schedule(2, 2, 4, 1), nullptr);
  EXPECT_NE(std::string(bgl_planner_last_error()).find("pipeline_rank"), std::string::npos);
}

TEST(PlannerCApi, BadInputFailsWithAMessage) {
  EXPECT_EQ(bgl_planner_create("{", nullptr), nullptr);
  EXPECT_NE(std::string(bgl_planner_last_error()).find("model_json"), std::string::npos);
  EXPECT_EQ(bgl_planner_create(R"({"name": "x"})", nullptr), nullptr);
  EXPECT_NE(std::string(bgl_planner_last_error()).find("missing field"), std::string::npos);
  const std::string model = Slurp(std::string(BGL_MODELS_DIR) + "/tiny-moe.json");
  EXPECT_EQ(bgl_planner_create(model.c_str(), R"({"capacity_bytes": "lots"})"), nullptr);
  EXPECT_NE(std::string(bgl_planner_last_error()).find("capacity_bytes"), std::string::npos);
  EXPECT_EQ(bgl_planner_create(model.c_str(), R"({"budget_step_bytes": 0})"), nullptr);
  EXPECT_NE(std::string(bgl_planner_last_error()).find("budget_step_bytes"), std::string::npos);
  // An unknown option is refused by name (a misspelt "warm_up" planned without a warm-up).
  EXPECT_EQ(bgl_planner_create(model.c_str(), R"({"warmup": true})"), nullptr);
  EXPECT_NE(std::string(bgl_planner_last_error()).find("options_json: unknown field 'warmup'"),
            std::string::npos);
  for (const char* bad : {R"({"gate_search_share": -0.1})", R"({"gate_search_share": 1.5})"}) {
    EXPECT_EQ(bgl_planner_create(model.c_str(), bad), nullptr) << bad;
    EXPECT_NE(std::string(bgl_planner_last_error()).find("gate_search_share: "), std::string::npos)
        << bad;
  }
  EXPECT_EQ(bgl_planner_create(model.c_str(), R"({"issue_policy": "eager"})"), nullptr);
  EXPECT_NE(std::string(bgl_planner_last_error()).find("must be dual-batch, lockstep or serial"),
            std::string::npos);
  // Every option docs/planner.md and bgl/planner.h name is read (the reads are the one list of
  // the known fields): all of them at once plan.
  bgl_planner* all = bgl_planner_create(model.c_str(), R"({
      "gpu": "h200", "capacity_bytes": 8589934592, "pipeline_rank": 0, "dual_batch": true,
      "issue_policy": "lockstep", "allow_offload": true, "allow_fp8": false,
      "allow_recompute": true, "calibration": null, "budget_step_bytes": 1048576,
      "load_bucket": 0.05, "schedule_load_class": 0.25, "anytime_min_ops": 64, "warm_up": false,
      "warm_spike_bound": 3.0, "warm_max_keys": 64, "warm_nice": 19, "refine_nice": 19,
      "gate_search_share": 0.25})");
  ASSERT_NE(all, nullptr) << bgl_planner_last_error();
  EXPECT_FALSE(Take(bgl_planner_plan(all, R"({"forward_micro_batch": 0})")).empty())
      << bgl_planner_last_error();
  bgl_planner_destroy(all);
  bgl_planner* shared = bgl_planner_create(model.c_str(), R"({"gate_search_share": 0})");
  ASSERT_NE(shared, nullptr) << bgl_planner_last_error();
  const nlohmann::json stats = nlohmann::json::parse(Take(bgl_planner_stats(shared)));
  for (const char* key : {"gate_searches", "gate_searches_cut", "gate_search_s"}) {
    EXPECT_EQ(stats.at(key), 0) << key;
  }
  bgl_planner_destroy(shared);
  bgl_planner* p = bgl_planner_create(model.c_str(), nullptr);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(bgl_planner_plan(p, R"({"forward_micro_batch": 99})"), nullptr);
  EXPECT_NE(std::string(bgl_planner_last_error()).find("forward_micro_batch"), std::string::npos);
  EXPECT_EQ(bgl_planner_plan(p, "[]"), nullptr);
  // A point's fields are refused by name too: a misspelt load planned at load 1.0, silently.
  EXPECT_EQ(bgl_planner_plan(p, R"({"forward_micro_batch": 0, "load": 2.6})"), nullptr);
  EXPECT_NE(std::string(bgl_planner_last_error()).find("point_json: unknown field 'load'"),
            std::string::npos)
      << bgl_planner_last_error();
  EXPECT_EQ(bgl_planner_plan(p, R"({"forward_micro_batch": 0, "load_factor": "2.6"})"), nullptr);
  EXPECT_NE(std::string(bgl_planner_last_error())
                .find("point_json: field 'load_factor' has the wrong type"),
            std::string::npos)
      << bgl_planner_last_error();
  // null is absent: the point's defaults
  EXPECT_FALSE(
      Take(bgl_planner_plan(p, R"({"forward_micro_batch": 0, "load_factor": null})")).empty())
      << bgl_planner_last_error();
  EXPECT_EQ(bgl_planner_report(p, 3, 0, 10), -1);
  EXPECT_EQ(bgl_planner_plan(nullptr, "{}"), nullptr);
  bgl_planner_destroy(p);
}

}  // namespace
