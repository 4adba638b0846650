// The instances the planner's tests used before issue 23 (the Table II models and the captured
// Hugging Face layer graphs at a grid of budgets and loads, the random stages and edge cases of
// mitigation_test.cc), each with a label, for the no-regression check of
// mitigation_regression_test.cc, and the real-sized instances of issue 23. Plain values; build them
// on any thread.
#pragma once

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "governor/planner/model_config.h"
#include "governor/planner/stage_graph.h"
#include "real_instances.h"
#include "test_graphs.h"

namespace bgl::plan::testing {

struct RegressionInstance {
  std::string label;
  StageGraph graph;
  HardwareProfile hw;
  double r = 1;
  double budget = 0;
};

// Budgets as fractions of the way from M0 to keep-all, and loads, for the model files.
inline constexpr double kRegressionFractions[] = {0, 0.001, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99};
inline constexpr double kRegressionLoads[] = {1.0, 1.6, 2.6};

inline void AddModelInstances(const std::string& path, const std::string& name,
                              std::vector<RegressionInstance>& out) {
  auto config = LoadModelConfig(path);
  if (!config.ok()) {
    std::fprintf(stderr, "%s: %s\n", path.c_str(), config.status().message().c_str());
    return;
  }
  auto hw = HardwareProfileByName(config->gpu);
  if (!hw.ok()) return;
  auto g = BuildStageGraph(*config, *hw);
  if (!g.ok()) return;
  for (double r : kRegressionLoads) {
    for (double f : kRegressionFractions) {
      RegressionInstance x;
      x.label = name + " r=" + std::to_string(r) + " f=" + std::to_string(f);
      x.graph = *g;
      x.hw = *hw;
      x.r = r;
      x.budget = g->M0(r) + f * (g->KeepAllBytes(r) - g->M0(r));
      out.push_back(std::move(x));
    }
  }
}

// `models_dir`: the repository's models/; `data_dir`: tests/unit/planner/data.
inline std::vector<RegressionInstance> RegressionInstances(const std::string& models_dir,
                                                           const std::string& data_dir) {
  std::vector<RegressionInstance> out;
  for (const char* m :
       {"glm-188b-a20b", "glm-319b-a30b", "glm-423b-a30b", "glm-629b-a30b", "glm-783b-a35b",
        "glm-835b-a30b", "glm-1041b-a35b-8192gpu", "glm-1041b-a35b-12288gpu", "tiny-moe"}) {
    AddModelInstances(models_dir + "/" + m + ".json", m, out);
  }
  for (const char* m : {"hf-mixtral", "hf-qwen3-moe", "hf-deepseek-v3"}) {
    AddModelInstances(data_dir + "/" + m + ".json", m, out);
  }
  const HardwareProfile h200 = *HardwareProfileByName("h200");
  {
    // mitigation_test.cc's RandomStages, drawn in the same order.
    std::mt19937 rng(20261129);
    for (int instance = 0; instance < 240; ++instance) {
      std::uniform_int_distribution<int> size(3, 7);
      RegressionInstance x;
      x.graph = RandomGraph(rng, size(rng));
      x.hw = h200;
      std::uniform_real_distribution<double> load(0.8, 2.6);
      x.r = load(rng);
      std::uniform_real_distribution<double> where(0.0, 1.0);
      x.budget = x.graph.M0(x.r) + where(rng) * (x.graph.KeepAllBytes(x.r) - x.graph.M0(x.r));
      x.label = "random #" + std::to_string(instance);
      out.push_back(std::move(x));
    }
  }
  {
    // mitigation_test.cc's EdgeCases.
    std::mt19937 rng(20261130);
    for (int instance = 0; instance < 1000; ++instance) {
      EdgeCase e = RandomEdgeCase(rng);
      RegressionInstance x;
      x.graph = std::move(e.graph);
      x.hw = h200;
      x.r = e.r;
      x.budget = e.budget;
      x.label = "edge #" + std::to_string(instance);
      out.push_back(std::move(x));
    }
  }
  // The real-sized instances of real_size_test.cc (issue 23), as the planner of that time
  // answered them.
  for (RealInstance& r : RealInstances(data_dir, 2323, 100, 18)) {
    RegressionInstance x;
    x.label = "real " + r.label;
    x.graph = std::move(r.graph);
    x.hw = h200;
    x.r = r.r;
    x.budget = r.budget;
    out.push_back(std::move(x));
  }
  return out;
}

}  // namespace bgl::plan::testing
