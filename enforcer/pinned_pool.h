// PinnedPool: a caching pool of page-locked host memory (cudaHostAlloc on CUDA, page-aligned
// host memory on the host backend) with a capacity, reused across micro-batches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "enforcer/device_ops.h"

namespace bgl::enf {

// Counters of a PinnedPool (bytes are rounded block sizes).
struct PinnedStats {
  std::size_t capacity = 0;
  std::size_t in_use = 0;  // handed out, including blocks waiting for their last copy
  std::size_t cached = 0;  // free, kept for reuse
  std::size_t peak = 0;    // peak in_use
  std::uint64_t allocs = 0, hits = 0, misses = 0, failures = 0, releases = 0;
};

// See file comment. Thread safe.
class PinnedPool {
 public:
  PinnedPool(DeviceOps* ops, std::size_t capacity);
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // Host memory for `bytes`. kPinnedExhausted (message in *error) when in-use blocks plus the
  // request exceed the capacity or the system refuses; nothing changes then.
  Status allocate(std::size_t bytes, void** out, std::string* error);
  // Returns `p` once `after` has completed (a null event: now). `after` is released by the pool.
  void free_after(void* p, const Event& after);
  // As free_after, after both events (a block two streams' copies may still use).
  void free_after_both(void* p, const Event& first, const Event& second);
  // Frees every cached block; returns the bytes released.
  std::size_t trim();
  // A new capacity (the node's grant changed): cached blocks beyond it are freed at once; blocks
  // in use above it stay until they come back, and allocations fail until the pool fits.
  void set_capacity(std::size_t capacity);
  PinnedStats stats() const;
  // Size class a request of `bytes` is rounded to.
  static std::size_t round(std::size_t bytes);

 private:
  struct Pending {
    void* p;
    Event event;
    Event also;  // a second event the block waits for (null handle: none)
  };
  void reap(bool wait);
  void cache(void* p);
  std::size_t release_cached(std::size_t goal);

  DeviceOps* ops_;
  mutable std::mutex mu_;
  std::multimap<std::size_t, void*> free_;       // size -> block
  std::unordered_map<void*, std::size_t> size_;  // every block the pool holds
  std::vector<Pending> pending_;
  PinnedStats stats_;
};

}  // namespace bgl::enf
