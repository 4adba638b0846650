// Orders the per-process rows of a Watch frame by a user-chosen key (--sort, or a key press).
#pragma once

#include <optional>
#include <string_view>
#include <vector>

#include "bagualu/v1/governor.pb.h"
#include "base/status.h"

namespace bgl::top {

// What the process table is sorted by.
enum class SortKey { kMemory, kPeak, kPid, kUser, kJob, kRank, kOoms, kGpu };

// "memory"/"mem", "peak", "pid", "user", "job", "rank", "ooms", "gpu"; the error lists them.
Result<SortKey> ParseSortKey(std::string_view name);
std::string_view SortKeyName(SortKey key);
// The interactive key that selects a sort key ('m', 'e', 'p', 'u', 'j', 'r', 'o', 'g').
std::optional<SortKey> SortKeyForPress(int ch);

// A process row and the GPU it runs on.
struct ProcessRef {
  const bagualu::v1::GpuState* gpu;
  const bagualu::v1::ProcessRow* row;
};

// Every process of `frame`, sorted. Sizes and counts sort largest first, names and ids
// smallest first; `reverse` flips that. Ties break by GPU index, then pid.
std::vector<ProcessRef> SortedProcesses(const bagualu::v1::WatchResponse& frame, SortKey key,
                                        bool reverse);

}  // namespace bgl::top
