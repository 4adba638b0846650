// Backend: where a Pool gets device memory from and how it orders work on streams.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace bgl::alloc {

// Opaque stream handle: a cudaStream_t for CUDA backends, a HostStream* (or null) for host.
using Stream = void*;

// A point in a stream's work queue; complete when all work queued before it has run.
struct Event {
  void* handle = nullptr;  // backend-specific (cudaEvent_t, HostStream*)
  std::uint64_t value = 0;
  // Host backend: the stream's serial (HostStream::serial_of), so that an event whose stream
  // was destroyed since (its work all ran first) reads as complete, never through the freed
  // stream.
  std::uint64_t serial = 0;
};

// Device memory and stream ordering for one device. Two growth modes:
//  - reserve/map/unmap (expandable): the pool reserves one virtual range and maps pages into it;
//  - allocate_segment/free_segment: each growth is an independent segment.
// Methods are called with the owning pool's lock held; a backend need not be thread safe
// beyond that, except record/query/wait which may be called concurrently from pools.
class Backend {
 public:
  virtual ~Backend() = default;

  virtual const char* name() const = 0;
  virtual int device() const = 0;
  // Physical bytes of the device (the ceiling for the pool's capacity limit).
  virtual std::size_t physical_capacity() const = 0;
  // Mapping granularity in bytes (a power of two).
  virtual std::size_t page_size() const = 0;
  // True when reserve/map/unmap are available.
  virtual bool supports_reserve() const = 0;

  // Reserves `bytes` of address space (no memory behind it); null on failure.
  virtual void* reserve(std::size_t /*bytes*/) { return nullptr; }
  virtual void unreserve(void* /*base*/, std::size_t /*bytes*/) {}
  // Backs [addr, addr+bytes) (page aligned, inside a reservation) with memory. False when the
  // device has no memory left or the call failed (the reason goes to last_error()).
  virtual bool map(void* /*addr*/, std::size_t /*bytes*/) { return false; }
  // Releases the memory behind a mapped range. No queued work may still use it.
  virtual void unmap(void* /*addr*/, std::size_t /*bytes*/) {}

  // Segment mode: a new independent allocation of `bytes`; null when out of memory.
  virtual void* allocate_segment(std::size_t /*bytes*/, Stream /*stream*/) { return nullptr; }
  virtual void free_segment(void* /*ptr*/, std::size_t /*bytes*/) {}

  // Stream ordering.
  virtual Event record(Stream stream) = 0;
  virtual bool query(const Event& event) = 0;
  virtual void wait(const Event& event) = 0;
  // As wait, for at most `timeout`; false when the event had not completed by then (the pool
  // waits this way: a stalled stream makes an allocation fail, never hang).
  virtual bool wait_for(const Event& event, std::chrono::milliseconds /*timeout*/) {
    wait(event);
    return true;
  }
  virtual void release(const Event& /*event*/) {}

  // Description of the most recent failure, for error messages.
  virtual std::string last_error() const { return {}; }
};

}  // namespace bgl::alloc
