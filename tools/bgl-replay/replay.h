// Replay: runs a Trace through a Pool and measures peak live/reserved bytes and time per op.
#pragma once

#include <cstdint>
#include <string>

#include "allocator/config.h"
#include "tools/bgl-replay/trace.h"

namespace bgl::alloc::replay {

// What a replay measured.
struct ReplayResult {
  std::size_t ops = 0;
  std::size_t ooms = 0;
  std::int64_t peak_live = 0;      // peak of the bytes the trace had live (requested sizes)
  std::int64_t peak_reserved = 0;  // pool's peak reserved bytes
  std::int64_t peak_allocated = 0;
  double ratio = 0;            // peak_reserved / peak_live
  double ns_per_op = 0;        // mean over all repeats
  double first_ns_per_op = 0;  // the first repeat: the pool grows (maps pages) as it goes
  double warm_ns_per_op = 0;   // later repeats: the pool reuses what it holds (as in training)
  std::uint64_t maps = 0, unmaps = 0;
};

// Replays `trace` `repeat` times (the first run is measured for memory; time is the mean over
// all runs) on a fresh allocator built from `config`, device 0.
bool run_replay(const Trace& trace, const Config& config, int repeat, ReplayResult* out,
                std::string* error);

}  // namespace bgl::alloc::replay
