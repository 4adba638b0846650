// Command-line options of bgl-sim and the checks that turn bad input into a clear error (exit
// status 2): unknown files or names, impossible parallel degrees, capacity below the weights.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tools/bgl-sim/load_trace.h"
#include "tools/bgl-sim/policy.h"
#include "tools/bgl-sim/simulator.h"

namespace bgl::sim {

// What the user asked for.
struct SimOptions {
  std::string model_path;
  std::string policies_text = "all";
  bool policies_given = false;  // --policy on the command line
  std::vector<Policy> policies;
  int iterations = 200;
  bool iterations_given = false;  // --iterations on the command line (caps a --loads replay)
  uint64_t seed = 1;
  bool json = false;
  std::string out_dir;
  std::string loads_path;
  std::string plans_path;  // --plans: the plans a run was served (served_plans.h)
  std::string gpu;
  std::string calibration_path;  // --calibration: applied on top of the GPU profile
  int64_t capacity_bytes = 0;
  int64_t seq_len = 0;  // 0: the model file's
  int64_t top_k = 0;    // 0: the model file's
  int64_t micro_batches = 0;
  std::vector<int> ranks;
  LoadSpec load;
  double design_load = 1.2;
  double restart_s = 284;
  int cooldown = 0;
  bool exec_override = false;
  ExecModel exec = ExecModel::kSerial;
  int trace_iteration = -1;  // -1: the first iteration with the largest load
  bool progress = false;
  std::string node_path;  // --node: simulate the GPUs of one node (node.h)
  bool help = false;
};

// Parses argv (without the program name). Errors name the flag.
Result<SimOptions> ParseOptions(const std::vector<std::string>& args);

// Loads the model, applies overrides and validates everything a run needs; every failure is an
// InvalidArgument or NotFound whose message can be shown as is.
Result<SimConfig> BuildConfig(const SimOptions& options);

extern const char* const kUsage;

}  // namespace bgl::sim
