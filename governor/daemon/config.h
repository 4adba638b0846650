// DaemonConfig: bgl-governord's settings, from defaults, then a YAML file, then environment
// variables BGL_GOVERNOR_<KEY>, then command-line flags (later wins). SIGHUP re-reads them;
// only the limits, the admin group, the reap interval and the log level change without restart.
#pragma once

#include <sys/types.h>

#include <map>
#include <string>
#include <vector>

#include "base/status.h"
#include "governor/common/registration.h"

namespace bgl::gov {

struct DaemonConfig {
  std::string listen = "unix:///run/bagualu/governor.sock";
  std::string tcp_listen;  // "" (default): no TCP; e.g. "127.0.0.1:7787"
  mode_t socket_mode = 0660;
  std::string socket_group;  // "" : the daemon's group
  std::string admin_group;   // members read every session ("" : root only)
  std::string metrics_address = "0.0.0.0";
  int metrics_port = 9478;   // 0: no metrics endpoint
  RequestLimits limits;
  int max_watch_streams = 64;         // concurrent Watch streams in total (each holds a thread)
  int max_watch_streams_per_uid = 8;  // ... per caller uid
  int reap_interval_ms = 2000;
  int drain_timeout_ms = 5000;
  std::string log_level = "info";  // debug, info, warning, error
};

// Flags as given on the command line (key -> value, keys as in the YAML file).
using ConfigOverrides = std::map<std::string, std::string>;

// Every key the file, the environment and flags accept.
const std::vector<std::string>& ConfigKeys();
// Sets one key from its text form; errors name the key.
Status ApplyConfigValue(const std::string& key, const std::string& value, DaemonConfig& config);
// Defaults <- file (if non-empty) <- environment <- overrides.
Result<DaemonConfig> LoadDaemonConfig(const std::string& file, const ConfigOverrides& overrides);

}  // namespace bgl::gov
