// A layer graph whose plan takes far longer than any sane limit without a deadline: 200
// operators, alternating compute and communication, each saving its own ~1 MiB tensor. The
// planner, service and daemon tests use it to hold a plan in progress.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace bgl::plan::testing {

inline nlohmann::json HeavyLayerGraph() {
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
  return {{"operators", ops}, {"tensors", tensors}};
}

}  // namespace bgl::plan::testing
