// Malformed and hostile inputs to the model format, the calibration and the planner (issue 12,
// items 1, 2, 8, 9, 10): each is refused with an error naming what is wrong, or planned by the
// documented rule, and nothing crashes or runs away.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "bgl/planner.h"
#include "governor/planner/dual_batch.h"
#include "governor/planner/json_limits.h"
#include "governor/planner/mitigation.h"
#include "governor/planner/planner.h"
#include "tests/unit/planner/heavy_graph.h"

namespace bgl::plan {
namespace {

using nlohmann::json;

std::string WriteFile(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

// A stage of `layers` layers with an explicit graph and no static memory, like the documents the
// PyTorch package writes: the capacity is the activation capacity.
json GraphModel(json graph, int layers = 1) {
  return {{"name", "g"},
          {"layers", layers},
          {"hidden", 64},
          {"moe_hidden", 64},
          {"experts", 1},
          {"top_k", 1},
          {"head_dim", 64},
          {"gpus", 1},
          {"dp", 1},
          {"tp", 1},
          {"ep", 1},
          {"pp", 1},
          {"param_bytes", 0},
          {"grad_bytes", 0},
          {"optimizer_bytes", 0},
          {"workspace", 0},
          {"safety_margin", 0.0},
          {"layer_graph", std::move(graph)}};
}

json SmallGraph() {
  return {{"operators",
           {{{"name", "norm"}, {"kind", "norm"}, {"forward_ms", 0.1}, {"backward_ms", 0.2}},
            {{"name", "fc"}, {"kind", "linear"}, {"forward_ms", 1.0}, {"backward_ms", 2.0}}}},
          {"tensors",
           {{{"name", "x"}, {"bytes", 4 << 20}, {"block_input", true}, {"consumers", {"norm"}}},
            {{"name", "y"}, {"bytes", 56 << 20}, {"producer", "norm"}, {"consumers", {"fc"}}}}}};
}

Result<StageGraph> Build(const json& model) {
  auto config = ModelConfigFromJson(model, "m.json");
  if (!config.ok()) return config.status();
  return BuildStageGraph(*config, *HardwareProfileByName("h200"));
}

void ExpectGraphError(const json& model, const std::string& fragment,
                      const std::string& absent = "") {
  auto g = Build(model);
  ASSERT_FALSE(g.ok()) << "accepted: " << model["layer_graph"].dump();
  EXPECT_NE(g.status().message().find(fragment), std::string::npos) << g.status().message();
  if (!absent.empty()) {
    EXPECT_EQ(g.status().message().find(absent), std::string::npos) << g.status().message();
  }
}

// ---- Item 1: deep nesting is refused before anything recurses over it.

TEST(Hardening, DeeplyNestedJsonModelIsRefusedNotACrash) {
  const std::string deep = std::string(80000, '[') + std::string(80000, ']');
  auto c = LoadModelConfig(WriteFile("deep.json", deep));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("nested deeper than 64 levels"), std::string::npos)
      << c.status().message();
  // Inside a field's value, as the attack sent it.
  const std::string field = R"({"name": "x", "layer_graph": )" + deep + "}";
  c = LoadModelConfig(WriteFile("deep_field.json", field));
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("nested deeper"), std::string::npos);
  // Brackets inside strings are text, not nesting.
  EXPECT_TRUE(CheckJsonNesting(R"({"a": "[[[[[[[[[[\"[[[[["})", 2, "t").ok());
  EXPECT_FALSE(CheckJsonNesting(R"({"a": [[{"b": 1}]]})", 3, "t").ok());
  EXPECT_TRUE(CheckJsonNesting(R"({"a": [[{"b": 1}]]})", 4, "t").ok());
}

TEST(Hardening, DeeplyNestedYamlModelIsRefused) {
  for (const std::string& text : {std::string("name: x\nlayer_graph: ") + std::string(80000, '['),
                                  std::string("name: x\nlayer_graph:\n  ") + [] {
                                    std::string dashes;
                                    for (int i = 0; i < 40000; ++i) dashes += "- ";
                                    return dashes + "1\n";
                                  }()}) {
    auto c = LoadModelConfig(WriteFile("deep.yaml", text));
    ASSERT_FALSE(c.ok());
    EXPECT_NE(c.status().message().find("nested deeper than 64 levels"), std::string::npos)
        << c.status().message();
  }
  // The shipped YAML model is far inside the limit.
  EXPECT_TRUE(LoadModelConfig(std::string(BGL_MODELS_DIR) + "/tiny-moe.yaml").ok());
}

// Found by fuzz/model_yaml_fuzz (issue 45; the input is fuzz/regressions/model_yaml_fuzz/
// billion-laughs.yaml): anchors naming anchors, 530 bytes standing for 10^9 strings, took
// minutes and gigabytes to convert. Refused once the conversion passes its budget.
TEST(Hardening, YamlAliasExpansionIsRefused) {
  std::string text = "a0: &a0 [\"" + std::string(40, 'x') + "\", x, x, x, x, x, x, x, x, x]\n";
  for (int i = 1; i < 9; ++i) {
    text += "a" + std::to_string(i) + ": &a" + std::to_string(i) + " [";
    for (int j = 0; j < 10; ++j) text += (j ? ", *a" : "*a") + std::to_string(i - 1);
    text += "]\n";
  }
  auto c = LoadModelConfig(WriteFile("aliases.yaml", text));
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("YAML aliases"), std::string::npos) << c.status().message();
  // Aliases within the budget still load: a graph's repeated operator written once.
  auto doc = YamlToJson("a: &a {n: 1}\nb: [*a, *a, *a]\n", "t");
  ASSERT_TRUE(doc.ok()) << doc.status().message();
  EXPECT_EQ((*doc)["b"].size(), 3u);
  EXPECT_EQ((*doc)["b"][2]["n"], 1);
}

TEST(Hardening, DeepParsedDocumentsAndTheCApiAreRefused) {
  json deep = json::array();
  for (int i = 0; i < 200; ++i) deep = json::array({std::move(deep)});
  json model = GraphModel(SmallGraph());
  model["layer_graph"]["operators"][0]["comment"] = deep;
  auto c = ModelConfigFromJson(model, "doc");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("nested deeper"), std::string::npos);

  const std::string text = R"({"name": )" + std::string(80000, '[') + "}";
  EXPECT_EQ(bgl_planner_create(text.c_str(), nullptr), nullptr);
  EXPECT_NE(std::string(bgl_planner_last_error()).find("nested deeper"), std::string::npos);
}

TEST(Hardening, DeeplyNestedCalibrationFileIsRefused) {
  HardwareProfile hw = *HardwareProfileByName("h200");
  Status s = ApplyCalibrationFile(
      WriteFile("deep_cal.json", R"({"peak_tflops": )" + std::string(80000, '[') + "}"), hw);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("nested deeper"), std::string::npos) << s.message();
}

// ---- Item 2: absurd calibration values are refused, naming the field.

TEST(Hardening, SubnormalAndAbsurdCalibrationIsRefused) {
  for (const char* key : {"peak_tflops", "matmul_efficiency", "hbm_GBps", "memory_efficiency",
                          "kernel_launch_us", "intra_node_GBps", "inter_node_GBps", "memory_GiB"}) {
    for (double v : {5e-324, 1e-300, 1e300}) {
      HardwareProfile hw = *HardwareProfileByName("h200");
      Status s = ApplyCalibration(json{{key, v}}, hw);
      ASSERT_FALSE(s.ok()) << key << " = " << v;
      EXPECT_NE(s.message().find(key), std::string::npos) << s.message();
      EXPECT_NE(s.message().find("must be in"), std::string::npos) << s.message();
    }
  }
  HardwareProfile hw = *HardwareProfileByName("h200");
  Status s = ApplyCalibration(json{{"rooflines", {{"offload", {{"peak_GBps", 5e-324}}}}}}, hw);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("rooflines.offload.peak_GBps"), std::string::npos) << s.message();
  // The calibration the GPU suite measured still applies.
  hw = *HardwareProfileByName("h200");
  EXPECT_TRUE(ApplyCalibration(json{{"peak_tflops", 989},
                                    {"matmul_efficiency", 0.62},
                                    {"rooflines", {{"fp8_cast", {{"launch_floor_us", 6.16}}}}}},
                               hw)
                  .ok());
}

TEST(Hardening, PlanThatExceedsItsDeadlineIsRefusedAndStateIsKept) {
  json model = GraphModel(testing::HeavyLayerGraph(), 16);
  auto config = ModelConfigFromJson(model, "heavy");
  ASSERT_TRUE(config.ok()) << config.status().message();
  PlannerOptions options;
  options.capacity_bytes = int64_t{1} << 30;  // keep-all is ~3.2 GiB: the greedy must work
  auto planner = StagePlanner::Create(*config, *HardwareProfileByName("h200"), options);
  ASSERT_TRUE(planner.ok()) << planner.status().message();
  SchedulePoint point;
  point.forward_micro_batch = 0;
  const double used = (*planner)->used_bytes();
  auto plan = (*planner)->PlanPoint(point, Deadline(50, nullptr));
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(plan.status().message().find("plan_timeout_ms"), std::string::npos)
      << plan.status().message();
  EXPECT_EQ((*planner)->used_bytes(), used);
  // A draining host cancels: UNAVAILABLE.
  std::atomic<bool> cancel{true};
  plan = (*planner)->PlanPoint(point, Deadline(0, &cancel));
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kUnavailable);
  // The state was kept: the micro-batch was never planned, so reporting it is still an error.
  EXPECT_EQ((*planner)->Report(0, 0, 1).code(), StatusCode::kNotFound);
}

TEST(Hardening, DualBatchDpFallsBackPastItsStateLimit) {
  Chains chains;
  const Resource resources[] = {Resource::kCompute, Resource::kComm, Resource::kD2H,
                                Resource::kH2D};
  for (int c = 0; c < kChainCount; ++c) {
    for (int i = 0; i < 100; ++i) {
      chains[c].push_back({i % 2 ? Resource::kComm : resources[c], 1e-3 * (1 + i % 3), i, i});
    }
  }
  // 101^4 states: over the limit, so the better of the two simple orders, at once.
  const DualBatchSchedule s = SolveDualBatch(chains);
  const DualBatchSchedule lockstep = LockstepSchedule(chains);
  const DualBatchSchedule serial = SerialSchedule(chains);
  EXPECT_EQ(s.overlapped_s, std::min(lockstep.overlapped_s, serial.overlapped_s));
  EXPECT_EQ(s.rounds.size(),
            (lockstep.overlapped_s <= serial.overlapped_s ? lockstep : serial).rounds.size());
}

// ---- Item 8: wrong layer graphs are refused with the right message.

TEST(Hardening, EmptyOperatorListIsRefused) {
  json graph = SmallGraph();
  graph["operators"] = json::array();
  ExpectGraphError(GraphModel(graph), "operators: empty");
}

TEST(Hardening, UnknownFieldsAtAnyDepthOfTheLayerGraphAreRefused) {
  json graph = SmallGraph();
  graph["operators"][1]["forwrd_ms"] = 1.0;
  ExpectGraphError(GraphModel(graph), "unknown field 'forwrd_ms'");
  graph = SmallGraph();
  graph["tensors"][1]["prodcuer"] = "norm";
  ExpectGraphError(GraphModel(graph), "unknown field 'prodcuer'");
  graph = SmallGraph();
  graph["tensor"] = json::array();
  ExpectGraphError(GraphModel(graph), "unknown field 'tensor'");
  // Wrong types are errors too, not exceptions.
  graph = SmallGraph();
  graph["operators"][0]["scales_with_load"] = "yes";
  ExpectGraphError(GraphModel(graph), "'scales_with_load' must be true or false");
  graph = SmallGraph();
  graph["tensors"][1]["consumers"] = {7};
  ExpectGraphError(GraphModel(graph), "consumers names");
}

TEST(Hardening, ByteCountsThatOverflowOrAreNotWholeBytesAreRefused) {
  json graph = SmallGraph();
  graph["tensors"][1]["bytes"] = INT64_MAX;
  ExpectGraphError(GraphModel(graph), "9223372036854775807");
  graph["tensors"][1]["bytes"] = UINT64_MAX;
  ExpectGraphError(GraphModel(graph), "must be a whole number of bytes");
  graph["tensors"][1]["bytes"] = 1e30;
  ExpectGraphError(GraphModel(graph), "field 'bytes' must be a whole number of bytes",
                   "missing field");
  graph["tensors"][1]["bytes"] = "10^30";
  ExpectGraphError(GraphModel(graph), "'10^30' is not a size", "missing field");
  graph["tensors"][1]["bytes"] = 1.5;
  ExpectGraphError(GraphModel(graph), "got 1.5");
  // A size string is a size.
  graph["tensors"][1]["bytes"] = "64MiB";
  auto g = Build(GraphModel(graph));
  ASSERT_TRUE(g.ok()) << g.status().message();
  EXPECT_EQ(g->tensors[1].bytes, int64_t{64} << 20);
  // Sums are checked: 2^50-byte tensors over 16 layers overflow the 2^56 chunk limit.
  graph["tensors"][1]["bytes"] = int64_t{1} << 50;
  graph["tensors"].push_back({{"name", "z"}, {"bytes", int64_t{1} << 50}, {"producer", "fc"}});
  graph["tensors"].push_back({{"name", "w"}, {"bytes", int64_t{1} << 50}, {"producer", "fc"}});
  graph["tensors"].push_back({{"name", "v"}, {"bytes", int64_t{1} << 50}, {"producer", "fc"}});
  ExpectGraphError(GraphModel(graph, 16), "more than 2^56 bytes");
}

TEST(Hardening, SavedTensorMadeOutsideTheLayerIsRetainedNotCountedAsFreed) {
  json graph = SmallGraph();
  // "rope" has no producer and is not the block input: made before the layer.
  graph["tensors"].push_back({{"name", "rope"}, {"bytes", 1024 << 20}, {"consumers", {"fc"}}});
  auto g = Build(GraphModel(graph));
  ASSERT_TRUE(g.ok()) << g.status().message();
  const HardwareProfile hw = *HardwareProfileByName("h200");
  CostEvaluator eval(*g, hw);
  // Full recompute cannot regenerate it: 4 MiB of input plus the 1 GiB tensor stay.
  EXPECT_EQ(g->M0(1.0), double((4 << 20) + (int64_t{1024} << 20)));
  EXPECT_EQ(eval.Evaluate(FullRecompute(eval), 1.0).device_bytes, g->M0(1.0));
}

// ---- Item 9: one scaling rule.

TEST(Hardening, TensorsScaleWithTheirProducerUnlessTheySayOtherwise) {
  json graph = SmallGraph();
  graph["operators"][0]["scales_with_load"] = true;  // norm scales; y is its output
  auto g = Build(GraphModel(graph));
  ASSERT_TRUE(g.ok()) << g.status().message();
  EXPECT_TRUE(g->tensors[1].scales_with_load);
  EXPECT_EQ(g->tensors[1].Bytes(2.0), 2.0 * (56 << 20));
  graph["tensors"][1]["scales_with_load"] = false;  // explicit wins
  g = Build(GraphModel(graph));
  ASSERT_TRUE(g.ok());
  EXPECT_FALSE(g->tensors[1].scales_with_load);
  // An operator that does not scale can still produce a tensor that does.
  graph = SmallGraph();
  graph["tensors"][1]["scales_with_load"] = true;
  g = Build(GraphModel(graph));
  ASSERT_TRUE(g.ok());
  EXPECT_TRUE(g->tensors[1].scales_with_load);
}

TEST(Hardening, ScalingBlockInputScalesInEveryLayer) {
  json graph = SmallGraph();
  graph["tensors"][0]["scales_with_load"] = true;
  auto g = Build(GraphModel(graph, 4));
  ASSERT_TRUE(g.ok()) << g.status().message();
  // Every layer's input is retained under full recompute; all four scale.
  EXPECT_EQ(g->M0(2.0), 2.0 * g->M0(1.0));
  EXPECT_EQ(g->M0(1.0), 4.0 * (4 << 20));
}

// ---- Item 10: a budget at or above keep-all plans keep-all, whatever the step.

TEST(Hardening, BudgetAboveKeepAllKeepsEverythingWhateverTheStep) {
  auto config = ModelConfigFromJson(GraphModel(SmallGraph()), "small");
  ASSERT_TRUE(config.ok()) << config.status().message();
  for (int64_t step : {int64_t{64} << 20, int64_t{1} << 20, int64_t{1} << 30}) {
    PlannerOptions options;
    options.capacity_bytes = int64_t{63} << 20;
    options.budget_step_bytes = step;
    auto planner = StagePlanner::Create(*config, *HardwareProfileByName("h200"), options);
    ASSERT_TRUE(planner.ok()) << planner.status().message();
    SchedulePoint point;
    point.forward_micro_batch = 0;
    auto plan = (*planner)->PlanPoint(point);
    ASSERT_TRUE(plan.ok()) << plan.status().message();
    ASSERT_GE(plan->budget_bytes, int64_t{60} << 20);
    EXPECT_EQ(plan->keep_all_bytes, int64_t{60} << 20);
    EXPECT_EQ(plan->predicted_bytes, plan->keep_all_bytes) << "step " << step;
    for (Strategy s : plan->strategies) EXPECT_EQ(s, Strategy::kKeep) << "step " << step;
  }
}

}  // namespace
}  // namespace bgl::plan
