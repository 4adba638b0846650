// Command line of bglctl: global flags, one subcommand and its flags. Errors name the flag so
// they can be shown as is (exit status 2).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"

namespace bgl::ctl {

// The subcommands.
enum class Command { kHealth, kSessions, kSnapshot, kPlan, kHelp };

// Everything one bglctl run was asked to do.
struct CtlOptions {
  std::string governor;    // empty: $BGL_GOVERNOR, else the default socket
  double timeout_s = 3.0;  // deadline of each call
  Command command = Command::kHelp;
  bool json = false;
  // health
  std::string service;  // empty: the server as a whole
  // snapshot, plan
  std::string session_id;
  std::string out_path;  // snapshot: empty means stdout
  // plan
  std::string phase = "unspecified";
  std::optional<int32_t> forward_micro_batch;
  int32_t forward_chunk = 0;
  std::optional<int32_t> backward_micro_batch;
  int32_t backward_chunk = 0;
  double load_factor = 0;
  std::optional<int64_t> bytes_in_use;
  // plan without --session: a throwaway session of this model (registered, planned, ended)
  std::string model_path;
  int64_t capacity_bytes = 0;
  int32_t gpu_index = 0;
  int64_t budget_step_bytes = 0;  // RegisterRequest.budget_step_bytes; 0: the daemon's default
};

// Parses argv without the program name.
Result<CtlOptions> ParseCtlOptions(const std::vector<std::string>& args);

extern const char* const kCtlUsage;

}  // namespace bgl::ctl
