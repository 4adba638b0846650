// Session: one training process's planning state in the daemon: its StagePlanner (not
// thread-safe, so every use holds `planner_mu`) and the figures Watch and the metrics show
// (under `mu`). Lock order: planner_mu before mu. `mu` is only ever held for a copy, never while
// planning, so Watch, the metrics and the watchdog's housekeeping never wait for a plan.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "bagualu/v1/governor.pb.h"
#include "governor/planner/planner.h"

namespace bgl::gov {

struct Session {
  bagualu::v1::Session info;       // identity; immutable after registration
  int64_t capacity_bytes = 0;      // effective: the request's or the GPU profile's
  uint64_t node_id = 0;            // its key in the core's NodeArbiter; immutable
  int64_t host_request_bytes = 0;  // the pinned host memory it asked of the node; immutable

  // Guards the planner's mutable state; its graph, config and hardware are immutable after
  // registration and may be read without it.
  std::mutex planner_mu;
  std::unique_ptr<plan::StagePlanner> planner;

  std::mutex mu;  // guards everything below
  int64_t in_use_bytes = 0;
  int64_t peak_bytes = 0;
  int64_t reserved_bytes = 0;
  int64_t budget_bytes = 0;
  double load_factor = 1.0;
  std::map<std::string, int64_t> strategy_counts;
  int64_t ooms_avoided = 0;
  int64_t oom_count = 0;
  uint64_t plans = 0;
  int64_t host_used_bytes = 0;  // reported (stats.host_used_bytes), else the last plan's
  bool host_used_reported = false;
  double bandwidth_share = 1.0;    // as of its last plan
  bool offloading = false;         // its last plan puts bytes on host
  plan::CacheCounters plan_cache;  // the planner's mitigation-cache counters after its last plan
  // The warm-up's figures after its last plan (set when the session warms up).
  std::optional<bagualu::v1::WarmUpStats> warm_up;
  // Its micro-batches in flight under the plans it serves, as of its latest report with them.
  std::optional<bagualu::v1::InEffect> in_effect;
  std::string snapshot_json;
  int64_t snapshot_unix_ms = 0;
};

}  // namespace bgl::gov
