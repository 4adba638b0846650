// The model document the governor unit tests register: models/tiny-moe.json.
#pragma once

#include <fstream>
#include <sstream>
#include <string>

namespace bgl::gov::testing {

inline std::string TinyModel() {
  std::ifstream in(std::string(BGL_MODELS_DIR) + "/tiny-moe.json");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace bgl::gov::testing
