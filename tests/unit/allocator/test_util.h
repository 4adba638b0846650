// Helpers shared by the allocator tests: a host-backed pool with chosen capacity and policy, and
// a pool on a named backend (the CUDA tests).
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "allocator/allocator.h"
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

// A pool on device 0 of `backend` (expandable on cuda-vmm, segments otherwise); null, with a
// test failure naming the reason, when the backend cannot start.
inline std::unique_ptr<Pool> make_backend_pool(const std::string& backend,
                                               std::size_t limit_bytes = 0) {
  Config c;
  c.backend = backend;
  c.expandable = backend == "cuda-vmm";
  c.pool.limit_bytes = limit_bytes;
  c.pool.log = false;
  std::string err;
  auto b = make_backend(c, 0, &err);
  EXPECT_NE(b, nullptr) << err;
  if (b == nullptr) return nullptr;
  return std::make_unique<Pool>(std::move(b), c.pool);
}

}  // namespace bgl::alloc::testing
