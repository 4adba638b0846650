// Short text for a plan's strategy counts ("keep 40 rc 8 off 4 fp8 2").
#pragma once

#include <cstdint>
#include <string>

#include "google/protobuf/map.h"

namespace bgl::top {

// Counts in a fixed order (keep, recompute, offload, fp8, then other keys by name), zero
// counts left out; "-" when there are none. Keys may be "recompute" or "STRATEGY_RECOMPUTE".
std::string StrategyText(const google::protobuf::Map<std::string, int64_t>& counts);

}  // namespace bgl::top
