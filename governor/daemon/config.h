// DaemonConfig: bgl-governord's settings, from defaults, then a YAML file, then environment
// variables BGL_GOVERNOR_<KEY>, then command-line flags (later wins). SIGHUP re-reads them;
// only the limits, the admin group, the reap interval and the log level change without restart
// (the node's budget, floor and links do not: they take a restart, docs/operations.md).
#pragma once

#include <sys/types.h>

#include <map>
#include <string>
#include <vector>

#include "base/status.h"
#include "governor/common/node_arbiter.h"
#include "governor/common/registration.h"

namespace bgl::gov {

struct DaemonConfig {
  std::string listen = "unix:///run/bagualu/governor.sock";
  std::string tcp_listen;  // "" (default): no TCP; e.g. "127.0.0.1:7787"
  mode_t socket_mode = 0660;
  std::string socket_group;  // "" : the daemon's group
  std::string admin_group;   // members read every session ("" : root only)
  std::string metrics_address = "0.0.0.0";
  int metrics_port = 9478;  // 0: no metrics endpoint
  RequestLimits limits;
  int max_watch_streams = 64;         // concurrent Watch streams in total (each holds a thread)
  int max_watch_streams_per_uid = 8;  // ... per caller uid
  int reap_interval_ms = 2000;
  int drain_timeout_ms = 5000;
  std::string log_level = "info";  // debug, info, warning, error
  // A calibration file (docs/planner.md, "Calibration"): this machine's measured rooflines for
  // every session ("" : the profiles as they are; sessions may send their own on top).
  std::string calibration;
  // The node (issue 14). -1: defaults resolved by ResolveNodeDefaults.
  int64_t host_budget_bytes = -1;  // default: host_budget_fraction of MemTotal (/proc/meminfo)
  double host_budget_fraction = 0.5;
  int64_t host_floor_bytes = -1;  // default: 256 MiB, capped at budget / node_max_sessions
  int node_max_sessions = 64;     // sessions the budget covers at the floor
  int node_gpus = -1;             // GPUs on the node; -1: NVIDIA devices under /sys (0: none)
  bool links_set = false;         // `links` given (else: from /sys NUMA nodes)
  std::vector<NodeLink> links;
  std::string links_source;  // where the links came from, for the log: "config", "sysfs", ...
};

// The node's settings as the arbiter takes them.
NodeConfig NodeConfigOf(const DaemonConfig& config);
// Parses the flag/environment spelling of `links`: groups separated by ';', GPU indices by ',',
// an optional "@GBPS" after a group for its measured peak ("0,1,2,3@25;4,5,6,7"). "" or "none":
// every GPU alone. Errors name "links".
Result<std::vector<NodeLink>> ParseLinks(const std::string& text);
// Fills the node defaults (budget from /proc/meminfo, floor, links from /sys) and checks the
// links against node_gpus; errors name the field. `sysfs_root` is "/sys" but for tests.
Status ResolveNodeDefaults(DaemonConfig& config, const std::string& sysfs_root = "/sys",
                           const std::string& meminfo = "/proc/meminfo");

// Flags as given on the command line (key -> value, keys as in the YAML file).
using ConfigOverrides = std::map<std::string, std::string>;

// Every key the file, the environment and flags accept.
const std::vector<std::string>& ConfigKeys();
// Sets one key from its text form; errors name the key.
Status ApplyConfigValue(const std::string& key, const std::string& value, DaemonConfig& config);
// Defaults <- file (if non-empty) <- environment <- overrides.
Result<DaemonConfig> LoadDaemonConfig(const std::string& file, const ConfigOverrides& overrides);

}  // namespace bgl::gov
