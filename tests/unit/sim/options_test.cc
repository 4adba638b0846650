#include "tools/bgl-sim/options.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>

namespace bgl::sim {
namespace {

const std::string kModels = BGL_MODELS_DIR;

Status Build(const std::vector<std::string>& args) {
  auto options = ParseOptions(args);
  if (!options.ok()) return options.status();
  auto config = BuildConfig(*options);
  return config.ok() ? OkStatus() : config.status();
}

// Writes the 423B model with one field replaced.
std::string Variant(const std::string& name, const std::string& field, int value) {
  std::ifstream in(kModels + "/glm-423b-a30b.json");
  nlohmann::json doc = nlohmann::json::parse(in);
  doc[field] = value;
  const std::string path = ::testing::TempDir() + "/" + name + ".json";
  std::ofstream(path) << doc.dump();
  return path;
}

TEST(OptionsTest, ParsesARun) {
  auto o = ParseOptions({"--model", kModels + "/tiny-moe.json", "--policy", "ablation,static-over",
                         "--iterations", "30", "--seed", "9", "--spike-max", "3", "--capacity",
                         "80GB", "--ranks", "0,3", "--exec", "lockstep", "--json"});
  ASSERT_TRUE(o.ok()) << o.status().message();
  EXPECT_EQ(o->policies.size(), 5u);
  EXPECT_EQ(o->iterations, 30);
  EXPECT_EQ(o->seed, 9u);
  EXPECT_DOUBLE_EQ(o->load.spike_max, 3);
  EXPECT_EQ(o->capacity_bytes, 80'000'000'000);
  EXPECT_EQ(o->ranks, (std::vector<int>{0, 3}));
  EXPECT_EQ(o->exec, ExecModel::kLockstep);
  EXPECT_TRUE(o->json);
  EXPECT_TRUE(BuildConfig(*o).ok());
}

TEST(OptionsTest, BadInputIsAClearError) {
  const std::string tiny = kModels + "/tiny-moe.json";
  auto message = [](const Status& s) { return s.message(); };
  EXPECT_NE(message(Build({"--model", kModels + "/nope.json"})).find("nope.json"),
            std::string::npos);
  EXPECT_NE(message(Build({"--model", tiny, "--policy", "magic"})).find("unknown policy 'magic'"),
            std::string::npos);
  EXPECT_NE(message(Build({"--model", tiny, "--gpu", "tpu"})).find("tpu"), std::string::npos);
  EXPECT_NE(message(Build({"--model", tiny, "--iterations", "0"})).find("--iterations"),
            std::string::npos);
  EXPECT_NE(message(Build({"--model", tiny, "--spike-max", "1.1"})).find("--spike-max"),
            std::string::npos);
  EXPECT_NE(message(Build({"--model", tiny, "--ranks", "0,9"})).find("--ranks"), std::string::npos);
  EXPECT_NE(message(Build({"--model", tiny, "--bogus", "1"})).find("unknown argument"),
            std::string::npos);
  EXPECT_NE(message(Build({"--model"})).find("needs a value"), std::string::npos);
  EXPECT_NE(message(Build({})).find("--model is required"), std::string::npos);
}

// --calibration applies a calibration document on top of the GPU profile (the rates a run's
// copies took, as the planner reads them); a missing or bad file is named.
TEST(OptionsTest, CalibrationFileSetsTheRates) {
  const std::string tiny = kModels + "/tiny-moe.json";
  const std::string path = ::testing::TempDir() + "/sim-calibration.json";
  std::ofstream(path) << R"({"copy_overlap": 1, "rooflines": {"offload": {"peak_GBps": 0.5,
      "launch_floor_us": 2}, "reload": {"peak_GBps": 0.25, "launch_floor_us": 2}}})";
  auto o = ParseOptions({"--model", tiny, "--gpu", "h200", "--calibration", path});
  ASSERT_TRUE(o.ok()) << o.status().message();
  auto config = BuildConfig(*o);
  ASSERT_TRUE(config.ok()) << config.status().message();
  EXPECT_DOUBLE_EQ(config->hw.offload.peak_bytes_per_s, 0.5e9);
  EXPECT_DOUBLE_EQ(config->hw.reload.peak_bytes_per_s, 0.25e9);
  EXPECT_NE(Build({"--model", tiny, "--calibration", path + ".nope"}).message().find(".nope"),
            std::string::npos);
  const std::string bad = ::testing::TempDir() + "/sim-calibration-bad.json";
  std::ofstream(bad) << R"({"rooflines": {"offload": {"peak_GBps": -1}}})";
  EXPECT_NE(Build({"--model", tiny, "--calibration", bad}).message().find("peak_GBps"),
            std::string::npos);
}

TEST(OptionsTest, ImpossibleLayoutsAndCapacity) {
  const Status gpus = Build({"--model", Variant("gpus", "gpus", 500)});
  EXPECT_NE(gpus.message().find("impossible parallel degrees"), std::string::npos)
      << gpus.message();
  const Status experts = Build({"--model", Variant("experts", "experts", 100)});
  EXPECT_NE(experts.message().find("experts (100)"), std::string::npos) << experts.message();
  const Status capacity = Build({"--model", kModels + "/glm-423b-a30b.json", "--capacity", "12GB"});
  EXPECT_NE(capacity.message().find("capacity"), std::string::npos) << capacity.message();
}

}  // namespace
}  // namespace bgl::sim
