#include "governor/planner/model_config.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "base/utf8.h"
#include "governor/planner/assignment.h"
#include "governor/planner/dual_batch.h"
#include "governor/planner/mitigation.h"
#include "governor/planner/planner.h"

namespace bgl::plan {
namespace {

nlohmann::json Tiny() {
  return {{"name", "t"},   {"layers", 8}, {"hidden", 512},  {"moe_hidden", 256},
          {"experts", 16}, {"top_k", 4},  {"head_dim", 64}, {"gpus", 4},
          {"dp", 1},       {"tp", 1},     {"ep", 1},        {"pp", 4}};
}

void ExpectError(const nlohmann::json& doc, const std::string& fragment) {
  auto c = ModelConfigFromJson(doc, "test.json");
  ASSERT_FALSE(c.ok()) << "accepted: " << doc.dump();
  EXPECT_NE(c.status().message().find(fragment), std::string::npos) << c.status().message();
}

TEST(ModelConfig, ShippedModelsLoadAndPlan) {
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator(BGL_MODELS_DIR)) {
    auto c = LoadModelConfig(entry.path().string());
    ASSERT_TRUE(c.ok()) << entry.path() << ": " << c.status().message();
    auto hw = HardwareProfileByName(c->gpu);
    ASSERT_TRUE(hw.ok());
    auto planner = StagePlanner::Create(*c, *hw, {});
    ASSERT_TRUE(planner.ok()) << entry.path() << ": " << planner.status().message();
    ++count;
  }
  EXPECT_GE(count, 9);  // eight Table II rows and the demo model
}

TEST(ModelConfig, YamlAndJsonAgree) {
  auto json = LoadModelConfig(std::string(BGL_MODELS_DIR) + "/tiny-moe.json");
  auto yaml = LoadModelConfig(std::string(BGL_MODELS_DIR) + "/tiny-moe.yaml");
  ASSERT_TRUE(json.ok());
  ASSERT_TRUE(yaml.ok()) << yaml.status().message();
  EXPECT_EQ(json->hidden, yaml->hidden);
  EXPECT_EQ(json->workspace_bytes, yaml->workspace_bytes);
  EXPECT_EQ(json->MicroBatches(), yaml->MicroBatches());
}

TEST(ModelConfig, MissingFieldIsNamed) {
  auto doc = Tiny();
  doc.erase("hidden");
  ExpectError(doc, "missing field 'hidden'");
}

TEST(ModelConfig, NegativeSizeIsNamed) {
  auto doc = Tiny();
  doc["moe_hidden"] = -256;
  ExpectError(doc, "'moe_hidden' must be positive");
  doc = Tiny();
  doc["workspace"] = "-3GiB";
  ExpectError(doc, "workspace");
}

TEST(ModelConfig, WrongTypeAndUnknownField) {
  auto doc = Tiny();
  doc["layers"] = "eight";
  ExpectError(doc, "'layers' must be an integer");
  doc = Tiny();
  doc["hiddden"] = 3;
  ExpectError(doc, "unknown field 'hiddden'");
}

TEST(ModelConfig, ImpossibleParallelDegrees) {
  auto doc = Tiny();
  doc["gpus"] = 6;
  ExpectError(doc, "gpus (6) != dp x tp x pp");
  doc = Tiny();
  doc["ep"] = 3;
  ExpectError(doc, "not divisible by ep");
  doc = Tiny();
  doc["layers"] = 10;
  ExpectError(doc, "not divisible by pp");
}

TEST(ModelConfig, MissingFileAndBadSyntax) {
  EXPECT_EQ(LoadModelConfig("/nonexistent/model.json").status().code(), StatusCode::kNotFound);
  const std::string path = ::testing::TempDir() + "/broken.yaml";
  FILE* f = std::fopen(path.c_str(), "w");
  std::fputs("name: [unclosed\n", f);
  std::fclose(f);
  auto c = LoadModelConfig(path);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("YAML"), std::string::npos);
}

// A model file with a byte that is no UTF-8 (found by mutating the shipped files: bgl-plan aborted
// on the JSON library's exception when an error message showed the value): a clear error naming
// the line and the byte, in a value, in a key, where a number is expected, and a truncated
// sequence at the end; well-formed multi-byte text stays accepted.
TEST(ModelConfig, InvalidUtf8IsNamedNotThrown) {
  const std::string path = ::testing::TempDir() + "/bad_utf8.yaml";
  const std::string good = "name: t\nlayers: 8\nhidden: 512\n";
  for (const std::string& text :
       {good + "gpu: h2\xcc"
               "0\n",
        std::string("layers: 8\xcc\nname: t\n"), good + "na\xffme: x\n",
        good + "description: caf\xc3", good + "x: \xed\xa0\x80\n", good + "x: \xc0\xaf\n"}) {
    FILE* f = std::fopen(path.c_str(), "wb");
    std::fwrite(text.data(), 1, text.size(), f);
    std::fclose(f);
    auto c = LoadModelConfig(path);
    ASSERT_FALSE(c.ok());
    EXPECT_NE(c.status().message().find("not valid UTF-8 at line"), std::string::npos)
        << c.status().message();
  }
  EXPECT_EQ(FirstInvalidUtf8("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"), std::nullopt);
  EXPECT_EQ(FirstInvalidUtf8("ab\xcc"), std::optional<std::size_t>(2));
  EXPECT_EQ(FirstInvalidUtf8("\xf4\x90\x80\x80"), std::optional<std::size_t>(0));
  // A wrong type whose value holds such bytes (JSON documents built in memory): named, no throw.
  auto doc = Tiny();
  doc["layers"] = std::string("8\xcc");
  ExpectError(doc, "must be an integer");
}

nlohmann::json CustomGraph() {
  auto doc = Tiny();
  doc["layer_graph"] = {
      {"operators",
       {{{"name", "norm"}, {"kind", "norm"}, {"forward_ms", 0.1}, {"backward_ms", 0.2}},
        {{"name", "fc"}, {"kind", "linear"}, {"forward_ms", 1.0}, {"backward_ms", 2.0}},
        {{"name", "act"}, {"kind", "activation_typo"}, {"forward_ms", 0.1}, {"backward_ms", 0.2}}}},
      {"tensors",
       {{{"name", "x"}, {"bytes", 1000}, {"block_input", true}, {"consumers", {"norm"}}},
        {{"name", "y"}, {"bytes", 2000}, {"producer", "norm"}, {"consumers", {"fc"}}}}}};
  return doc;
}

TEST(ModelConfig, CustomGraphErrorsNameTheProblem) {
  auto doc = CustomGraph();
  auto config = ModelConfigFromJson(doc, "custom.json");
  ASSERT_TRUE(config.ok()) << config.status().message();
  auto hw = HardwareProfileByName("h200");
  // Unknown operator kind.
  auto g = BuildStageGraph(*config, *hw);
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.status().message().find("unknown operator kind 'activation_typo'"),
            std::string::npos);
  // Unknown operator in a consumer list.
  doc["layer_graph"]["operators"][2]["kind"] = "other";
  doc["layer_graph"]["tensors"][1]["consumers"] = {"fc", "nosuchop"};
  config = ModelConfigFromJson(doc, "custom.json");
  g = BuildStageGraph(*config, *hw);
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.status().message().find("'nosuchop'"), std::string::npos);
  // A consumer that runs before the producer: a cycle.
  doc["layer_graph"]["tensors"][1]["consumers"] = {"fc"};
  doc["layer_graph"]["tensors"][1]["producer"] = "act";
  config = ModelConfigFromJson(doc, "custom.json");
  g = BuildStageGraph(*config, *hw);
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.status().message().find("cyclic consumer list"), std::string::npos);
  // Fixed: builds, replicated over the chunk's layers, with the layer input retained.
  doc["layer_graph"]["tensors"][1]["producer"] = "norm";
  config = ModelConfigFromJson(doc, "custom.json");
  g = BuildStageGraph(*config, *hw);
  ASSERT_TRUE(g.ok()) << g.status().message();
  EXPECT_EQ(g->ops.size(), 3u * config->LayersPerChunk());
  EXPECT_EQ(g->M0(1.0), 1000.0 * static_cast<double>(config->LayersPerChunk()));
}

// An operator that cannot be rerun alone (inside a compiled block under per-operator
// placements) is never recomputed: CostEvaluator::Allowed, which every search consults.
TEST(ModelConfig, RecomputeAllowedPerOperator) {
  auto doc = CustomGraph();
  doc["layer_graph"]["operators"][2]["kind"] = "other";
  doc["layer_graph"]["tensors"][1]["producer"] = "norm";
  doc["layer_graph"]["tensors"][1]["consumers"] = {"norm"};
  auto hw = HardwareProfileByName("h200");
  auto config = ModelConfigFromJson(doc, "custom.json");
  ASSERT_TRUE(config.ok()) << config.status().message();
  auto g = BuildStageGraph(*config, *hw);
  ASSERT_TRUE(g.ok()) << g.status().message();
  EXPECT_TRUE(CostEvaluator(*g, *hw).Allowed(0, Strategy::kRecompute));
  doc["layer_graph"]["operators"][0]["recompute_allowed"] = false;
  config = ModelConfigFromJson(doc, "custom.json");
  ASSERT_TRUE(config.ok()) << config.status().message();
  g = BuildStageGraph(*config, *hw);
  ASSERT_TRUE(g.ok()) << g.status().message();
  CostEvaluator eval(*g, *hw);
  EXPECT_FALSE(eval.Allowed(0, Strategy::kRecompute));
  EXPECT_TRUE(eval.Allowed(0, Strategy::kOffload));
  EXPECT_TRUE(eval.Allowed(0, Strategy::kFp8));
  // Every operator barred from recompute, under a budget that needs something moved: the
  // searches (the priced greedy took "may recompute" for "saves something movable" and
  // crashed) plan offloads, and nothing recomputes.
  for (auto& od : doc["layer_graph"]["operators"]) od["recompute_allowed"] = false;
  config = ModelConfigFromJson(doc, "custom.json");
  ASSERT_TRUE(config.ok()) << config.status().message();
  g = BuildStageGraph(*config, *hw);
  ASSERT_TRUE(g.ok()) << g.status().message();
  CostEvaluator none(*g, *hw);
  const double m0 = g->M0(1.0);
  auto plan = SelectMitigation(none, 1.0, m0 + 100.0);
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  EXPECT_TRUE(plan->fits);
  bool moved = false;
  for (Strategy s : plan->assignment) {
    EXPECT_NE(s, Strategy::kRecompute);
    moved |= s != Strategy::kKeep;
  }
  EXPECT_TRUE(moved);
  doc["layer_graph"]["operators"][0]["recompute_allowed"] = "no";
  config = ModelConfigFromJson(doc, "custom.json");
  std::string message = config.ok() ? "" : config.status().message();
  if (config.ok()) {
    auto bad = BuildStageGraph(*config, *hw);
    ASSERT_FALSE(bad.ok());
    message = bad.status().message();
  }
  EXPECT_NE(message.find("recompute_allowed"), std::string::npos) << message;
}

// A captured layer's operators nest (a module and the modules it calls, each timed whole), so
// their times add up to more than the layer takes. The layer graph's "forward_ms" (the layer's
// own time) sets the copy windows; a rerun still costs its operator's own time.
TEST(ModelConfig, LayerForwardTimeSetsTheCopyWindowsNotTheReruns) {
  auto doc = CustomGraph();
  auto& ops = doc["layer_graph"]["operators"];
  ops[0]["forward_ms"] = 0.5;
  ops[0]["backward_ms"] = 1.0;
  ops[1]["forward_ms"] = 2.0;
  ops[1]["backward_ms"] = 4.0;
  ops[2] = {{"name", "act"}, {"kind", "other"}, {"forward_ms", 0.5}, {"backward_ms", 1.0}};
  doc["layer_graph"]["tensors"][1]["bytes"] = 128 << 20;
  auto hw = HardwareProfileByName("h200");
  ASSERT_TRUE(hw.ok());
  auto build = [&](const nlohmann::json& d) {
    auto config = ModelConfigFromJson(d, "custom.json");
    EXPECT_TRUE(config.ok()) << config.status().message();
    return BuildStageGraph(*config, *hw);
  };
  auto summed = build(doc);
  ASSERT_TRUE(summed.ok()) << summed.status().message();
  doc["layer_graph"]["forward_ms"] = 1.5;  // half the operators' sum
  auto nested = build(doc);
  ASSERT_TRUE(nested.ok()) << nested.status().message();
  const double layers = static_cast<double>(nested->layers);
  EXPECT_DOUBLE_EQ(summed->ForwardTime(1.0), 3.0e-3 * layers);
  EXPECT_DOUBLE_EQ(nested->ForwardTime(1.0), 1.5e-3 * layers);
  EXPECT_DOUBLE_EQ(nested->BackwardTime(1.0), 3.0e-3 * layers);
  // Offloading fc's input (y): a copy the summed forward would hide, the layer's own does not.
  Assignment offload(nested->ops.size(), Strategy::kKeep);
  for (size_t o = 1; o < offload.size(); o += 3) offload[o] = Strategy::kOffload;
  const AssignmentCost s = CostEvaluator(*summed, *hw).Evaluate(offload, 1.0);
  const AssignmentCost n = CostEvaluator(*nested, *hw).Evaluate(offload, 1.0);
  ASSERT_EQ(hw->copy_overlap, 1.0);
  ASSERT_GT(n.d2h_s, nested->ForwardTime(1.0));
  ASSERT_LT(n.d2h_s, summed->ForwardTime(1.0));
  EXPECT_EQ(s.exposed_s, 0.0);
  EXPECT_NEAR(n.exposed_s, n.d2h_s - nested->ForwardTime(1.0), 1e-12);
  // Recomputing fc's input reruns norm at norm's own time in both.
  Assignment rerun(nested->ops.size(), Strategy::kKeep);
  for (size_t o = 1; o < rerun.size(); o += 3) rerun[o] = Strategy::kRecompute;
  EXPECT_DOUBLE_EQ(CostEvaluator(*nested, *hw).Evaluate(rerun, 1.0).recompute_s, 0.5e-3 * layers);
  EXPECT_DOUBLE_EQ(CostEvaluator(*summed, *hw).Evaluate(rerun, 1.0).recompute_s, 0.5e-3 * layers);
  // A layer time that is not a positive number of milliseconds is refused by name.
  for (const nlohmann::json& bad :
       {nlohmann::json(0.0), nlohmann::json(-1.0), nlohmann::json("1ms")}) {
    doc["layer_graph"]["forward_ms"] = bad;
    auto config = ModelConfigFromJson(doc, "custom.json");
    std::string message = config.ok() ? "" : config.status().message();
    if (config.ok()) {
      auto g = BuildStageGraph(*config, *hw);
      ASSERT_FALSE(g.ok()) << "accepted forward_ms " << bad.dump();
      message = g.status().message();
    }
    EXPECT_NE(message.find("forward_ms"), std::string::npos) << message;
  }
}

// The layer graph's "backward_ms" (the layer's own backward, measured by the capture) sets the
// backward window and the issue order's backward chain; without it the backward stays in
// proportion to the forward (the operators' backward times, twice their forward ones). A rerun
// still costs its operator's forward time.
TEST(ModelConfig, LayerBackwardTimeSetsTheBackwardWindowAndChain) {
  auto doc = CustomGraph();
  auto& ops = doc["layer_graph"]["operators"];
  ops[0]["forward_ms"] = 0.5;
  ops[0]["backward_ms"] = 1.0;
  ops[1]["forward_ms"] = 2.0;
  ops[1]["backward_ms"] = 4.0;
  ops[2] = {{"name", "act"}, {"kind", "other"}, {"forward_ms", 0.5}, {"backward_ms", 1.0}};
  doc["layer_graph"]["tensors"][1]["bytes"] = 128 << 20;
  doc["layer_graph"]["forward_ms"] = 1.5;  // half the operators' sum
  auto hw = HardwareProfileByName("h200");
  ASSERT_TRUE(hw.ok());
  auto build = [&](const nlohmann::json& d) {
    auto config = ModelConfigFromJson(d, "custom.json");
    EXPECT_TRUE(config.ok()) << config.status().message();
    return BuildStageGraph(*config, *hw);
  };
  auto twice = build(doc);
  ASSERT_TRUE(twice.ok()) << twice.status().message();
  doc["layer_graph"]["backward_ms"] = 2.25;  // 1.5x the layer's forward, not 2x
  auto measured = build(doc);
  ASSERT_TRUE(measured.ok()) << measured.status().message();
  const double layers = static_cast<double>(measured->layers);
  EXPECT_DOUBLE_EQ(twice->BackwardTime(1.0), 3.0e-3 * layers);
  EXPECT_DOUBLE_EQ(measured->ForwardTime(1.0), 1.5e-3 * layers);
  EXPECT_DOUBLE_EQ(measured->BackwardTime(1.0), 2.25e-3 * layers);
  // Offloading fc's input (y): its reload hides under a backward of 2x the forward, not under
  // the measured one.
  Assignment offload(measured->ops.size(), Strategy::kKeep);
  for (size_t o = 1; o < offload.size(); o += 3) offload[o] = Strategy::kOffload;
  const AssignmentCost t = CostEvaluator(*twice, *hw).Evaluate(offload, 1.0);
  const AssignmentCost m = CostEvaluator(*measured, *hw).Evaluate(offload, 1.0);
  ASSERT_EQ(hw->copy_overlap, 1.0);
  ASSERT_GT(m.h2d_s, measured->BackwardTime(1.0));
  EXPECT_NEAR(
      t.exposed_s - m.exposed_s,
      std::max(0.0, m.h2d_s - twice->BackwardTime(1.0)) - (m.h2d_s - measured->BackwardTime(1.0)),
      1e-12);
  EXPECT_LT(t.exposed_s, m.exposed_s);
  // The issue order's chains: F at the layer's forward, B at its measured backward.
  Assignment keep(measured->ops.size(), Strategy::kKeep);
  PointUnits u;
  u.forward = &keep;
  u.backward = &keep;
  const CostEvaluator eval(*measured, *hw);
  const Chains chains = BuildChains(eval, u);
  auto total = [](const std::vector<ChainStage>& chain) {
    double s = 0;
    for (const ChainStage& c : chain) s += c.duration_s;
    return s;
  };
  EXPECT_NEAR(total(chains[0]), 1.5e-3 * layers, 1e-12);
  EXPECT_NEAR(total(chains[1]), 2.25e-3 * layers, 1e-12);
  // Recomputing fc's input reruns norm at norm's own forward time.
  Assignment rerun(measured->ops.size(), Strategy::kKeep);
  for (size_t o = 1; o < rerun.size(); o += 3) rerun[o] = Strategy::kRecompute;
  EXPECT_DOUBLE_EQ(eval.Evaluate(rerun, 1.0).recompute_s, 0.5e-3 * layers);
  // A backward time that is not a positive number of milliseconds, or is absurd, is refused by
  // name.
  for (const nlohmann::json& bad :
       {nlohmann::json(0.0), nlohmann::json(-1.0), nlohmann::json("1ms"), nlohmann::json(1e12),
        nlohmann::json(std::nan("")), nlohmann::json(nullptr)}) {
    doc["layer_graph"]["backward_ms"] = bad;
    auto config = ModelConfigFromJson(doc, "custom.json");
    std::string message = config.ok() ? "" : config.status().message();
    if (config.ok()) {
      auto g = BuildStageGraph(*config, *hw);
      ASSERT_FALSE(g.ok()) << "accepted backward_ms " << bad.dump();
      message = g.status().message();
    }
    EXPECT_NE(message.find("backward_ms"), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace bgl::plan
