// DeviceOps: the stream work the enforcer queues (copies, FP8 casts, cross-stream waits, events,
// pinned host memory) for one backend: host streams on the host backend, the CUDA runtime else.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "enforcer/allocator_names.h"
#include "kernels/fp8_block.h"

namespace bgl::enf {

// See file comment. Thread safe. Failures return a status and set last_error().
class DeviceOps {
 public:
  virtual ~DeviceOps() = default;
  virtual const char* name() const = 0;

  virtual Status create_stream(Stream* out) = 0;
  virtual void destroy_stream(Stream s) = 0;
  // Blocks until the work queued on `s` ran; kBackendError (last_error() says so) when it did
  // not within alloc::detail::wait_timeout() (BGL_WAIT_TIMEOUT_MS): every host wait is bounded.
  virtual Status synchronize(Stream s) = 0;

  // An event after all work queued on `s` so far (complete at once for an idle/null stream).
  virtual Event record(Stream s) = 0;
  virtual bool query(const Event& e) = 0;
  // Blocks the calling thread until `e` completed; bounded as synchronize.
  virtual Status wait(const Event& e) = 0;
  // Gives the event back once nobody will query it again.
  virtual void release(const Event& /*e*/) {}
  // Work queued on `s` after this call starts only after `e` completed.
  virtual Status stream_wait(Stream s, const Event& e) = 0;

  // Copies n bytes (device<->host or device<->device) in order on `s`.
  virtual Status copy(void* dst, const void* src, std::size_t n, Stream s) = 0;
  // FP8 casts in order on `s` (kernels/fp8_cast.h).
  virtual Status cast_to_fp8(const void* src, kern::DType t, std::size_t n, std::uint8_t* dst,
                             float* scales, std::size_t block, Stream s) = 0;
  virtual Status cast_from_fp8(const std::uint8_t* src, const float* scales, std::size_t n,
                               std::size_t block, kern::DType t, void* dst, Stream s) = 0;

  // Page-locked host memory (page-aligned host memory on the host backend); null on failure.
  virtual void* host_alloc(std::size_t bytes) = 0;
  virtual void host_free(void* p) = 0;

  virtual std::string last_error() const = 0;
};

// Ops for the backend called `backend_name` ("host", "cuda-vmm", "cuda-async") on `device`;
// null with `error` set when that backend has none in this build.
std::unique_ptr<DeviceOps> make_device_ops(const std::string& backend_name, int device,
                                           std::string* error);
std::unique_ptr<DeviceOps> make_host_device_ops();
#if BGL_ALLOC_HAVE_CUDA
std::unique_ptr<DeviceOps> make_cuda_device_ops(int device);
#endif

}  // namespace bgl::enf
