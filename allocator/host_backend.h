// HostBackend: a simulated device on host memory, with a capacity, page mapping on a reserved
// range (mmap/mprotect) and HostStream ordering, so pool behaviour is testable without a GPU.
#pragma once

#include <atomic>
#include <cstddef>
#include <string>

#include "allocator/backend.h"

namespace bgl::alloc {

// Options of the simulated device.
struct HostBackendOptions {
  int device = 0;
  std::size_t capacity = std::size_t{8} << 30;   // physical bytes
  std::size_t page_size = std::size_t{2} << 20;  // mapping granularity
  bool expandable = true;                        // false: segment mode (like cuda-async)
};

// See file comment. Streams are HostStream*; null or unknown handles are idle streams.
class HostBackend final : public Backend {
 public:
  explicit HostBackend(const HostBackendOptions& options);

  const char* name() const override { return "host"; }
  int device() const override { return options_.device; }
  std::size_t physical_capacity() const override { return options_.capacity; }
  std::size_t page_size() const override { return options_.page_size; }
  bool supports_reserve() const override { return options_.expandable; }

  void* reserve(std::size_t bytes) override;
  void unreserve(void* base, std::size_t bytes) override;
  bool map(void* addr, std::size_t bytes) override;
  void unmap(void* addr, std::size_t bytes) override;
  void* allocate_segment(std::size_t bytes, Stream stream) override;
  void free_segment(void* ptr, std::size_t bytes) override;

  Event record(Stream stream) override;
  bool query(const Event& event) override;
  void wait(const Event& event) override;
  bool wait_for(const Event& event, std::chrono::milliseconds timeout) override;

  std::string last_error() const override { return last_error_; }
  // Bytes of simulated physical memory in use.
  std::size_t used() const { return used_.load(); }

 private:
  bool take(std::size_t bytes);

  HostBackendOptions options_;
  std::atomic<std::size_t> used_{0};
  std::string last_error_;
};

}  // namespace bgl::alloc
