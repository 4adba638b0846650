// Snapshot: pools rendered in PyTorch's memory-snapshot layout (segments, device_traces,
// allocator_settings), so pytorch.org/memory_viz can open it once pickled.
#pragma once

#include <nlohmann/json.hpp>
#include <vector>

#include "allocator/config.h"
#include "allocator/pool.h"

namespace bgl::alloc {

// `pools[d]` is device d's pool or null. Streams and addresses are integers.
nlohmann::json snapshot_to_json(const std::vector<const Pool*>& pools, const Config& config);

// Statistics of one pool as a flat JSON object (names as in the C struct bgl_alloc_stats).
nlohmann::json stats_to_json(const Stats& s);

const char* block_state_name(BlockState s);

}  // namespace bgl::alloc
