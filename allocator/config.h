// Config: the allocator settings, parsed from BGL_ALLOC_CONF ("key:value,key:value").
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "allocator/pool.h"

namespace bgl::alloc {

// Every key of BGL_ALLOC_CONF (documented in docs/allocator.md).
struct Config {
  std::string backend = "auto";  // auto | host | cuda-vmm | cuda-async
  // Host backend: simulated devices, their capacity and page size.
  int devices = 1;
  std::size_t capacity = std::size_t{8} << 30;
  std::size_t page_size = std::size_t{2} << 20;
  // expandable: grow by mapping pages into a reserved range (host, cuda-vmm); false: segments.
  bool expandable = true;
  PoolOptions pool;  // limit, small_max, round_divisions, defrag, defrag_slack, history, log
};

// Parses `text` over the defaults. On error returns false and sets `error` to a message that
// names the offending key or value.
bool parse_config(std::string_view text, Config* config, std::string* error);

// Parses "8GiB", "512MiB", "1.5GB", "4096" (K/M/G/T and KiB/MiB/GiB/TiB are binary, KB/MB/GB/TB
// decimal). False on a malformed or overflowing value.
bool parse_size(std::string_view text, std::size_t* out);

}  // namespace bgl::alloc
