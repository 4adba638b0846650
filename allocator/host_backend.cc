#include "allocator/host_backend.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "allocator/host_stream.h"

namespace bgl::alloc {

HostBackend::HostBackend(const HostBackendOptions& options) : options_(options) {}

bool HostBackend::take(std::size_t bytes) {
  std::size_t used = used_.load();
  do {
    if (bytes > options_.capacity - used) {
      last_error_ = "simulated device " + std::to_string(options_.device) + " is full";
      return false;
    }
  } while (!used_.compare_exchange_weak(used, used + bytes));
  return true;
}

void* HostBackend::reserve(std::size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    last_error_ = std::string("mmap reserve failed: ") + std::strerror(errno);
    return nullptr;
  }
  return p;
}

void HostBackend::unreserve(void* base, std::size_t bytes) { munmap(base, bytes); }

bool HostBackend::map(void* addr, std::size_t bytes) {
  if (!take(bytes)) return false;
  if (mprotect(addr, bytes, PROT_READ | PROT_WRITE) != 0) {
    last_error_ = std::string("mprotect failed: ") + std::strerror(errno);
    used_ -= bytes;
    return false;
  }
  return true;
}

void HostBackend::unmap(void* addr, std::size_t bytes) {
  // Drop the pages (the next map sees zeros) and make the range inaccessible again.
  madvise(addr, bytes, MADV_DONTNEED);
  mprotect(addr, bytes, PROT_NONE);
  used_ -= bytes;
}

void* HostBackend::allocate_segment(std::size_t bytes, Stream /*stream*/) {
  if (!take(bytes)) return nullptr;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    last_error_ = std::string("mmap failed: ") + std::strerror(errno);
    used_ -= bytes;
    return nullptr;
  }
  return p;
}

void HostBackend::free_segment(void* ptr, std::size_t bytes) {
  munmap(ptr, bytes);
  used_ -= bytes;
}

Event HostBackend::record(Stream stream) {
  const std::uint64_t serial = HostStream::serial_of(stream);
  if (serial == 0) return Event{};  // idle stream: complete at once
  auto* s = static_cast<HostStream*>(stream);
  return Event{s, s->enqueued(), serial};
}

// An event whose stream was destroyed since it was recorded is complete (the destructor ran
// every queued item); it is never read through the freed stream (issue 45: the pool queried a
// free's event on an enforcer's copy stream after bgl_enf_destroy; enforcer_capi_fuzz).
bool HostBackend::query(const Event& event) {
  if (event.handle == nullptr) return true;
  return HostStream::done_if_live(event.handle, event.serial, event.value);
}

void HostBackend::wait(const Event& event) {
  if (event.handle == nullptr || !HostStream::same_stream(event.handle, event.serial)) return;
  static_cast<HostStream*>(event.handle)->wait(event.value);
}

bool HostBackend::wait_for(const Event& event, std::chrono::milliseconds timeout) {
  return event.handle == nullptr || !HostStream::same_stream(event.handle, event.serial) ||
         static_cast<HostStream*>(event.handle)->wait_for(event.value, timeout);
}

}  // namespace bgl::alloc
