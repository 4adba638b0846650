// A model whose plan would run for minutes without a deadline: the tiny model's shape, 16 layers
// of an explicit graph with 200 operators each (alternating compute and communication, each
// saving its own tensor), no static memory. Registered with 1 GiB its keep-all (3.2 GiB) does not
// fit, so every plan runs the greedy: the daemon tests use it to hold a plan in progress.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "tests/integration/daemon_process.h"

namespace bgl::gov::testing {

inline std::string HeavyModelJson() {
  nlohmann::json ops = nlohmann::json::array(), tensors = nlohmann::json::array();
  tensors.push_back(
      {{"name", "x"}, {"bytes", 1 << 20}, {"block_input", true}, {"consumers", {"op0"}}});
  for (int i = 0; i < 200; ++i) {
    const std::string name = "op" + std::to_string(i);
    ops.push_back({{"name", name},
                   {"kind", i % 2 ? "comm" : "linear"},
                   {"forward_ms", 0.01 + 0.001 * (i % 7)},
                   {"backward_ms", 0.02}});
    if (i + 1 < 200) {
      tensors.push_back({{"name", "t" + std::to_string(i)},
                         {"bytes", (1 << 20) + 4096 * (i % 5)},
                         {"producer", name},
                         {"consumers", {"op" + std::to_string(i + 1)}}});
    }
  }
  nlohmann::json model = nlohmann::json::parse(TinyModelJson());
  for (const char* key : {"layers", "pp", "gpus", "micro_batches", "vp"}) model.erase(key);
  model.update({{"layers", 16},
                {"pp", 1},
                {"gpus", 1},
                {"workspace", 0},
                {"param_bytes", 0},
                {"grad_bytes", 0},
                {"optimizer_bytes", 0}});
  model["layer_graph"] = {{"operators", ops}, {"tensors", tensors}};
  return model.dump();
}

}  // namespace bgl::gov::testing
