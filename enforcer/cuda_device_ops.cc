// DeviceOps on the CUDA runtime: cudaMemcpyAsync, cudaStreamWaitEvent, recycled events,
// cudaHostAlloc, and the kernels/ FP8 launchers.
#include <cuda_runtime_api.h>

#include <chrono>
#include <mutex>
#include <string>
#include <thread>

#include "allocator/cuda_events.h"
#include "allocator/detail/fault.h"
#include "enforcer/device_ops.h"
#include "kernels/fp8_cast.h"

namespace bgl::enf {
namespace {

using alloc::CudaEvents;
using alloc::DeviceGuard;

class CudaDeviceOps final : public DeviceOps {
 public:
  explicit CudaDeviceOps(int device) : device_(device), events_(device) {}

  const char* name() const override { return "cuda"; }

  Status create_stream(Stream* out) override {
    DeviceGuard guard(device_);
    cudaStream_t s = nullptr;
    if (!ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate")) {
      return Status::kBackendError;
    }
    *out = s;
    return Status::kOk;
  }
  void destroy_stream(Stream s) override {
    if (s != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(s));
  }
  Status synchronize(Stream s) override {
    DeviceGuard guard(device_);
    return poll_until("the stream's work", [&] {
      return cudaStreamQuery(static_cast<cudaStream_t>(s)) != cudaErrorNotReady;
    });
  }

  Event record(Stream s) override { return events_.record(s); }
  bool query(const Event& e) override { return events_.query(e); }
  Status wait(const Event& e) override {
    return poll_until("the stream work before an event", [&] { return events_.query(e); });
  }
  void release(const Event& e) override { events_.release(e); }
  Status stream_wait(Stream s, const Event& e) override {
    if (e.handle == nullptr) return Status::kOk;
    return ok(cudaStreamWaitEvent(static_cast<cudaStream_t>(s), static_cast<cudaEvent_t>(e.handle),
                                  0),
              "cudaStreamWaitEvent")
               ? Status::kOk
               : Status::kBackendError;
  }

  Status copy(void* dst, const void* src, std::size_t n, Stream s) override {
    DeviceGuard guard(device_);
    return ok(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, static_cast<cudaStream_t>(s)),
              "cudaMemcpyAsync")
               ? Status::kOk
               : Status::kBackendError;
  }
  Status cast_to_fp8(const void* src, kern::DType t, std::size_t n, std::uint8_t* dst,
                     float* scales, std::size_t block, Stream s) override {
    DeviceGuard guard(device_);
    return ok(static_cast<cudaError_t>(kern::cast_to_fp8(src, t, n, dst, scales, block, s)),
              "fp8 cast kernel")
               ? Status::kOk
               : Status::kBackendError;
  }
  Status cast_from_fp8(const std::uint8_t* src, const float* scales, std::size_t n,
                       std::size_t block, kern::DType t, void* dst, Stream s) override {
    DeviceGuard guard(device_);
    return ok(static_cast<cudaError_t>(kern::cast_from_fp8(src, scales, n, block, t, dst, s)),
              "fp8 uncast kernel")
               ? Status::kOk
               : Status::kBackendError;
  }

  void* host_alloc(std::size_t bytes) override {
    void* p = nullptr;
    if (!ok(cudaHostAlloc(&p, bytes, cudaHostAllocPortable), "cudaHostAlloc")) return nullptr;
    return p;
  }
  void host_free(void* p) override { cudaFreeHost(p); }

  std::string last_error() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return last_error_;
  }

 private:
  // Polls `done` until true or the wait timeout (alloc/detail/fault.h) passed: a bounded wait.
  template <typename Done>
  Status poll_until(const char* what, Done&& done) {
    const auto deadline = std::chrono::steady_clock::now() + alloc::detail::wait_timeout();
    for (int spins = 0; !done(); ++spins) {
      if (std::chrono::steady_clock::now() >= deadline) {
        std::lock_guard<std::mutex> lock(mu_);
        last_error_ = alloc::detail::wait_timeout_message(what);
        return Status::kBackendError;
      }
      if (spins < 64) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
    return Status::kOk;
  }

  bool ok(cudaError_t e, const char* what) {
    if (e == cudaSuccess) return true;
    std::lock_guard<std::mutex> lock(mu_);
    last_error_ = std::string(what) + ": " + cudaGetErrorString(e);
    return false;
  }

  int device_;
  CudaEvents events_;
  mutable std::mutex mu_;
  std::string last_error_;
};

}  // namespace

std::unique_ptr<DeviceOps> make_cuda_device_ops(int device) {
  return std::make_unique<CudaDeviceOps>(device);
}

}  // namespace bgl::enf
