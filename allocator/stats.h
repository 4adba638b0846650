// Stats: counters and gauges of one pool (PyTorch memory_stats-like, plus bad-input counters).
#pragma once

#include <cstdint>

namespace bgl::alloc {

// A byte or count gauge with its high-water mark.
struct Gauge {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  void add(std::int64_t v) {
    current += v;
    if (current > peak) peak = current;
  }
  void sub(std::int64_t v) { current -= v; }
  void reset_peak() { peak = current; }
};

// Everything a pool counts. Byte gauges: allocated = rounded block bytes handed out; requested =
// bytes asked for; active = allocated plus blocks freed but awaiting other streams' events;
// reserved = bytes mapped (or segment bytes) from the backend.
struct Stats {
  Gauge allocated_bytes, requested_bytes, active_bytes, reserved_bytes;
  Gauge allocations;  // live allocations
  Gauge segments;     // contiguous mapped ranges (expandable) or segments
  std::uint64_t num_allocs = 0;
  std::uint64_t num_frees = 0;
  std::uint64_t num_maps = 0;    // map / segment allocate calls
  std::uint64_t num_unmaps = 0;  // unmap / segment free calls
  std::uint64_t num_ooms = 0;
  std::uint64_t num_steals = 0;    // events recorded to reuse another stream's free blocks
  std::uint64_t num_syncs = 0;     // waits on events (slow path)
  std::uint64_t num_releases = 0;  // cache releases (empty_cache, pressure, defrag)
  std::uint64_t num_pressure_calls = 0;
  std::uint64_t pressure_bytes_freed = 0;
  // Bad input.
  std::uint64_t num_invalid_size = 0;  // zero or unsatisfiable sizes
  std::uint64_t num_foreign_free = 0;  // pointer not from this allocator
  std::uint64_t num_double_free = 0;
  std::uint64_t num_wrong_size = 0;    // free with a size other than the allocated one
  std::uint64_t num_wrong_device = 0;  // free naming another device
  // Computed at read time.
  std::uint64_t inactive_bytes = 0;  // free (cached) bytes in mapped memory
  std::uint64_t largest_free_block = 0;
  double fragmentation = 0.0;  // 1 - largest_free_block / inactive_bytes (0 when none free)
  std::uint64_t limit_bytes = 0;
  std::uint64_t physical_bytes = 0;
};

}  // namespace bgl::alloc
