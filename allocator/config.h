// Config: the allocator settings, parsed from BGL_ALLOC_CONF ("key:value,key:value").
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "allocator/pool.h"

namespace bgl::alloc {

// Default page of the host backend and segment rounding of cuda-async.
inline constexpr std::size_t kDefaultPageSize = std::size_t{2} << 20;
// Default page of cuda-vmm. Each page is one cuMemCreate + cuMemMap; on an H200, replaying the
// shipped MoE traces with 2 MiB pages cost 5-36 us per operation even once the pool was warm
// (defragmentation unmaps and maps pages again), 32 MiB pages 0.2-0.5 us, for peak reserved
// over live of 1.015-1.023 instead of 1.004-1.014 (docs/benchmarks/allocator.md, section "On an
// H200").
inline constexpr std::size_t kCudaVmmPageSize = std::size_t{32} << 20;

// Every key of BGL_ALLOC_CONF (documented in docs/allocator.md).
struct Config {
  std::string backend = "auto";  // auto | host | cuda-vmm | cuda-async
  // Host backend: simulated devices, their capacity and page size.
  int devices = 1;
  std::size_t capacity = std::size_t{8} << 30;
  // 0: the backend's own (host 2 MiB, cuda-vmm kCudaVmmPageSize, cuda-async 2 MiB).
  std::size_t page_size = 0;
  // expandable: grow by mapping pages into a reserved range (host, cuda-vmm); false: segments.
  bool expandable = true;
  PoolOptions pool;  // limit, small_max, round_divisions, defrag, defrag_slack, history, log
};

// Parses `text` over the defaults; sizes follow the project's one rule (bgl::ParseBytes, so a
// bare "8G" is refused). On error returns false and sets `error` to a message that names the
// offending key or value.
bool parse_config(std::string_view text, Config* config, std::string* error);

}  // namespace bgl::alloc
