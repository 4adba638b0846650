#include "allocator/history.h"

#include <chrono>

namespace bgl::alloc {

const char* action_name(Action a) {
  switch (a) {
    case Action::kAlloc:
      return "alloc";
    case Action::kFreeRequested:
      return "free_requested";
    case Action::kFreeCompleted:
      return "free_completed";
    case Action::kSegmentMap:
      return "segment_map";
    case Action::kSegmentUnmap:
      return "segment_unmap";
    case Action::kSegmentAlloc:
      return "segment_alloc";
    case Action::kSegmentFree:
      return "segment_free";
    case Action::kOom:
      return "oom";
  }
  return "unknown";
}

void History::set_capacity(std::size_t n) {
  std::vector<TraceEntry> old = entries();
  cap_ = n;
  ring_.clear();
  total_ = 0;
  ring_.reserve(n);
  std::size_t start = old.size() > n ? old.size() - n : 0;
  for (std::size_t i = start; i < old.size(); ++i) add(old[i]);
}

void History::add(const TraceEntry& e) {
  if (cap_ == 0) return;
  if (ring_.size() < cap_) {
    ring_.push_back(e);
  } else {
    ring_[total_ % cap_] = e;
  }
  ++total_;
}

std::vector<TraceEntry> History::entries() const {
  std::vector<TraceEntry> out;
  out.reserve(ring_.size());
  if (ring_.size() < cap_ || cap_ == 0) return ring_;
  std::size_t head = total_ % cap_;
  for (std::size_t i = 0; i < cap_; ++i) out.push_back(ring_[(head + i) % cap_]);
  return out;
}

std::int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace bgl::alloc
