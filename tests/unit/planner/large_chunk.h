// Test support (issue 43): the large-chunk stage and the 40 points that bench/plan_bench.cc's
// BM_PlanLargeChunk* and first_answer_study.cc's miss mode both plan. GLM-423B-A30B with 144
// layers and 9 per virtual stage, so a chunk holds 9 layers of 14 operators (126, about issue
// 23's 32 x 4), copy engines at a twentieth of the paper's so plans have an overhead, 141 GB.
// Needs BGL_MODELS_DIR. Plain functions of their arguments: any thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "governor/planner/planner.h"

namespace bgl::plan::testing {

// The stage's model (errors: the model file's).
inline Result<ModelConfig> LargeChunkConfig() {
  auto doc = LoadJsonOrYaml(std::string(BGL_MODELS_DIR) + "/glm-423b-a30b.json", "model");
  if (!doc.ok()) return doc.status();
  (*doc)["layers"] = 144;
  (*doc)["vp"] = 9;
  return ModelConfigFromJson(*doc, "glm-423b-a30b.json");
}

// The paper's profile with copy engines at a twentieth of its bandwidth.
inline HardwareProfile LargeChunkHardware() {
  HardwareProfile hw = *HardwareProfileByName("paper");
  hw.offload.peak_bytes_per_s /= 20;
  hw.reload.peak_bytes_per_s /= 20;
  return hw;
}

// 141 GB of device memory; anytime_min_ops 0: the full search on the call, 64: the first answer
// on the call and the full search on the refiner's thread.
inline PlannerOptions LargeChunkOptions(int anytime_min_ops) {
  PlannerOptions options;
  options.capacity_bytes = int64_t{141} * 1000 * 1000 * 1000;
  options.anytime_min_ops = anytime_min_ops;
  return options;
}

// The forward of micro-batch 0 at loads 1 to 2.6 with budgets from near M0 to near keep-all
// (through bytes_in_use): 40 keys.
inline std::vector<SchedulePoint> LargeChunkPoints(const StagePlanner& planner) {
  std::vector<SchedulePoint> points;
  const double m0 = planner.m0(), keep = planner.graph().KeepAllBytes(1.0);
  for (int b = 0; b < 10; ++b) {
    for (double r : {1.0, 1.3, 2.0, 2.6}) {
      SchedulePoint p;
      p.forward_micro_batch = 0;
      p.load_factor = r;
      const double budget = 1.05 * m0 + (keep - 1.05 * m0) * b / 10.0;
      p.bytes_in_use = static_cast<int64_t>(planner.activation_capacity() - budget);
      points.push_back(p);
    }
  }
  return points;
}

}  // namespace bgl::plan::testing
