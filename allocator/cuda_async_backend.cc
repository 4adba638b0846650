#include "allocator/cuda_async_backend.h"

#include <cuda_runtime_api.h>

#include <cstdint>

#include "allocator/cuda_events.h"

namespace bgl::alloc {
namespace {

class CudaAsyncBackend final : public Backend {
 public:
  CudaAsyncBackend(int device, cudaMemPool_t pool, std::size_t segment, std::size_t total)
      : device_(device), pool_(pool), segment_(segment), total_(total), events_(device) {}
  ~CudaAsyncBackend() override { cudaMemPoolDestroy(pool_); }

  const char* name() const override { return "cuda-async"; }
  int device() const override { return device_; }
  std::size_t physical_capacity() const override { return total_; }
  std::size_t page_size() const override { return segment_; }
  bool supports_reserve() const override { return false; }

  void* allocate_segment(std::size_t bytes, Stream stream) override {
    DeviceGuard guard(device_);
    void* p = nullptr;
    cudaError_t err = cudaMallocFromPoolAsync(&p, bytes, pool_, static_cast<cudaStream_t>(stream));
    if (err != cudaSuccess) {
      cudaGetLastError();
      last_error_ = std::string("cudaMallocFromPoolAsync: ") + cudaGetErrorString(err);
      return nullptr;
    }
    return p;
  }

  void free_segment(void* ptr, std::size_t /*bytes*/) override {
    // The pool only releases segments whose last use has completed; cudaFree synchronizes.
    DeviceGuard guard(device_);
    cudaFree(ptr);
    cudaMemPoolTrimTo(pool_, 0);
  }

  Event record(Stream stream) override { return events_.record(stream); }
  bool query(const Event& e) override { return events_.query(e); }
  void wait(const Event& e) override { events_.wait(e); }
  bool wait_for(const Event& e, std::chrono::milliseconds timeout) override {
    return events_.wait_for(e, timeout);
  }
  void release(const Event& e) override { events_.release(e); }
  std::string last_error() const override { return last_error_; }

 private:
  int device_;
  cudaMemPool_t pool_;
  std::size_t segment_;
  std::size_t total_;
  CudaEvents events_;
  std::string last_error_;
};

}  // namespace

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

std::unique_ptr<Backend> make_cuda_async_backend(int device, std::size_t segment_size,
                                                 std::string* error) {
  if (device < 0 || device >= cuda_device_count()) {
    *error = "cuda-async: no CUDA device " + std::to_string(device);
    return nullptr;
  }
  DeviceGuard guard(device);
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.handleTypes = cudaMemHandleTypeNone;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  cudaMemPool_t pool = nullptr;
  if (cudaMemPoolCreate(&pool, &props) != cudaSuccess) {
    *error =
        std::string("cuda-async: cudaMemPoolCreate: ") + cudaGetErrorString(cudaGetLastError());
    return nullptr;
  }
  std::uint64_t threshold = UINT64_MAX;
  cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold);
  std::size_t free_b = 0, total = 0;
  cudaMemGetInfo(&free_b, &total);
  return std::make_unique<CudaAsyncBackend>(device, pool, segment_size, total);
}

}  // namespace bgl::alloc
