// History: a bounded ring of allocator events in PyTorch's memory-snapshot trace vocabulary.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "allocator/backend.h"

namespace bgl::alloc {

// Trace actions, named as in PyTorch's device_traces.
enum class Action : std::uint8_t {
  kAlloc,
  kFreeRequested,
  kFreeCompleted,
  kSegmentMap,
  kSegmentUnmap,
  kSegmentAlloc,
  kSegmentFree,
  kOom,
};
const char* action_name(Action a);

// One event. For kOom, `addr` holds the free bytes (PyTorch's device_free).
struct TraceEntry {
  Action action;
  std::uintptr_t addr;
  std::size_t size;
  Stream stream;
  std::int64_t time_us;
};

// Fixed-capacity ring; capacity 0 records nothing.
class History {
 public:
  void set_capacity(std::size_t n);
  std::size_t capacity() const { return cap_; }
  bool enabled() const { return cap_ != 0; }
  void add(const TraceEntry& e);
  // Oldest first.
  std::vector<TraceEntry> entries() const;
  bool overflowed() const { return total_ > cap_; }

 private:
  std::vector<TraceEntry> ring_;
  std::size_t cap_ = 0;
  std::size_t total_ = 0;
};

// Microseconds since the epoch (what PyTorch's time_us holds).
std::int64_t now_us();

}  // namespace bgl::alloc
