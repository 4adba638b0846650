// A model whose plan would run for minutes without a deadline: the tiny model's shape, 16 layers
// of an explicit graph with 200 operators each (alternating compute and communication, each
// saving its own tensor), no static memory. Registered with 1 GiB its keep-all (3.2 GiB) does not
// fit, so every plan runs the greedy: the daemon tests use it to hold a plan in progress.
#pragma once

#include <nlohmann/json.hpp>

#include "tests/integration/daemon_process.h"
#include "tests/unit/planner/heavy_graph.h"

namespace bgl::gov::testing {

inline std::string HeavyModelJson() {
  nlohmann::json model = nlohmann::json::parse(TinyModelJson());
  for (const char* key : {"layers", "pp", "gpus", "micro_batches", "vp"}) model.erase(key);
  model.update({{"layers", 16},
                {"pp", 1},
                {"gpus", 1},
                {"workspace", 0},
                {"param_bytes", 0},
                {"grad_bytes", 0},
                {"optimizer_bytes", 0}});
  model["layer_graph"] = plan::testing::HeavyLayerGraph();
  return model.dump();
}

}  // namespace bgl::gov::testing
