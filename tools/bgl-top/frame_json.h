// One dashboard frame as JSON (--json): GPUs with their figures and history, and the sorted
// process rows. Byte fields are integers in bytes; names follow the proto's fields.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "bagualu/v1/governor.pb.h"
#include "tools/bgl-top/history.h"
#include "tools/bgl-top/process_sort.h"

namespace bgl::top {

nlohmann::json FrameToJson(const bagualu::v1::WatchResponse& frame, const History& history,
                           SortKey sort, bool reverse, const std::string& address);

}  // namespace bgl::top
