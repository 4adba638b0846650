// The checks the model-file targets (JSON, YAML) share.
#pragma once

#include <string>

#include "governor/planner/hardware.h"
#include "governor/planner/model_config.h"
#include "governor/planner/stage_graph.h"

namespace bgl::fuzz {

// Loads the model file at `path`; when it loads, evaluates the derived values every planner
// caller reads and builds the stage graph. Errors are returned values and end the check.
inline void CheckModelFile(const std::string& path) {
  auto config = plan::LoadModelConfig(path);
  if (!config.ok()) return;
  const plan::ModelConfig& c = *config;
  volatile double sink = c.ParamsPerGpu() + c.StaticBytesPerGpu();
  // Each as a double: their integer sum may overflow (a hidden size near INT64_MAX loads).
  sink = sink + static_cast<double>(c.LayersPerChunk()) + static_cast<double>(c.Heads()) +
         static_cast<double>(c.SharedHidden()) + static_cast<double>(c.MicroBatches()) +
         static_cast<double>(c.Chunks());
  (void)sink;
  auto hw = plan::HardwareProfileByName(c.gpu);
  if (!hw.ok()) return;
  auto graph = plan::BuildStageGraph(c, *hw);
  (void)graph.ok();
}

}  // namespace bgl::fuzz
