#include "tools/bgl-top/process_sort.h"

#include <algorithm>
#include <string>
#include <tuple>

namespace bgl::top {

Result<SortKey> ParseSortKey(std::string_view name) {
  if (name == "memory" || name == "mem" || name == "m") return SortKey::kMemory;
  if (name == "peak") return SortKey::kPeak;
  if (name == "pid") return SortKey::kPid;
  if (name == "user") return SortKey::kUser;
  if (name == "job") return SortKey::kJob;
  if (name == "rank") return SortKey::kRank;
  if (name == "ooms") return SortKey::kOoms;
  if (name == "gpu") return SortKey::kGpu;
  return InvalidArgument("--sort: unknown key '" + std::string(name) +
                         "' (memory, peak, pid, user, job, rank, ooms, gpu)");
}

std::string_view SortKeyName(SortKey key) {
  switch (key) {
    case SortKey::kMemory:
      return "memory";
    case SortKey::kPeak:
      return "peak";
    case SortKey::kPid:
      return "pid";
    case SortKey::kUser:
      return "user";
    case SortKey::kJob:
      return "job";
    case SortKey::kRank:
      return "rank";
    case SortKey::kOoms:
      return "ooms";
    case SortKey::kGpu:
      return "gpu";
  }
  return "memory";
}

std::optional<SortKey> SortKeyForPress(int ch) {
  switch (ch) {
    case 'm':
      return SortKey::kMemory;
    case 'e':
      return SortKey::kPeak;
    case 'p':
      return SortKey::kPid;
    case 'u':
      return SortKey::kUser;
    case 'j':
      return SortKey::kJob;
    case 'r':
      return SortKey::kRank;
    case 'o':
      return SortKey::kOoms;
    case 'g':
      return SortKey::kGpu;
    default:
      return std::nullopt;
  }
}

std::vector<ProcessRef> SortedProcesses(const bagualu::v1::WatchResponse& frame, SortKey key,
                                        bool reverse) {
  std::vector<ProcessRef> rows;
  for (const auto& gpu : frame.gpus()) {
    for (const auto& row : gpu.processes()) rows.push_back({&gpu, &row});
  }
  // Negative means a sorts before b under the key's natural direction.
  auto compare = [key](const ProcessRef& a, const ProcessRef& b) -> int {
    auto three = [](auto x, auto y) { return x < y ? -1 : (y < x ? 1 : 0); };
    const auto& ra = *a.row;
    const auto& rb = *b.row;
    switch (key) {
      case SortKey::kMemory:
        return three(rb.in_use_bytes(), ra.in_use_bytes());
      case SortKey::kPeak:
        return three(rb.peak_bytes(), ra.peak_bytes());
      case SortKey::kOoms:
        return three(rb.ooms_avoided(), ra.ooms_avoided());
      case SortKey::kPid:
        return three(ra.session().pid(), rb.session().pid());
      case SortKey::kUser:
        return three(ra.session().user(), rb.session().user());
      case SortKey::kJob:
        return three(ra.session().job_id(), rb.session().job_id());
      case SortKey::kRank:
        return three(ra.session().pipeline_rank(), rb.session().pipeline_rank());
      case SortKey::kGpu:
        return three(a.gpu->gpu_index(), b.gpu->gpu_index());
    }
    return 0;
  };
  std::stable_sort(rows.begin(), rows.end(), [&](const ProcessRef& a, const ProcessRef& b) {
    const int c = compare(a, b);
    if (c != 0) return reverse ? c > 0 : c < 0;
    return std::tuple(a.gpu->gpu_index(), a.row->session().pid()) <
           std::tuple(b.gpu->gpu_index(), b.row->session().pid());
  });
  return rows;
}

}  // namespace bgl::top
