// Helpers shared by the allocator tests: a host-backed pool with chosen capacity and policy.
#pragma once

#include <memory>

#include "allocator/host_backend.h"
#include "allocator/pool.h"

namespace bgl::alloc::testing {

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kGiB = std::size_t{1} << 30;

inline std::unique_ptr<Pool> make_pool(std::size_t capacity, PoolOptions options = {},
                                       bool expandable = true, std::size_t page = 2 * kMiB) {
  HostBackendOptions b;
  b.capacity = capacity;
  b.page_size = page;
  b.expandable = expandable;
  options.log = false;
  return std::make_unique<Pool>(std::make_unique<HostBackend>(b), options);
}

}  // namespace bgl::alloc::testing
