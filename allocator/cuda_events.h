// CudaEvents: a recycled pool of timing-free CUDA events, the stream ordering of CUDA backends.
#pragma once

#include <cuda_runtime_api.h>

#include <mutex>
#include <string>
#include <vector>

#include "allocator/backend.h"
#include "allocator/export.h"

namespace bgl::alloc {

// Records, polls and waits on cudaEvent_t objects, reusing them (cudaEventCreate is slow).
class BGL_ALLOC_INTERNAL CudaEvents {
 public:
  explicit CudaEvents(int device) : device_(device) {}
  ~CudaEvents();
  Event record(Stream stream);
  bool query(const Event& e);
  void wait(const Event& e);
  // Polls until `e` completed or `timeout` passed; false on the timeout.
  bool wait_for(const Event& e, std::chrono::milliseconds timeout);
  void release(const Event& e);
  std::string last_error() const;

 private:
  int device_;
  mutable std::mutex mu_;
  std::vector<cudaEvent_t> free_;
  std::string last_error_;
};

// Makes `device` current for the scope, restoring the previous device after.
class BGL_ALLOC_INTERNAL DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();

 private:
  int prev_ = -1;
  bool changed_ = false;
};

}  // namespace bgl::alloc
