#include "allocator/cuda_events.h"

#include <chrono>
#include <thread>

namespace bgl::alloc {

DeviceGuard::DeviceGuard(int device) {
  if (cudaGetDevice(&prev_) == cudaSuccess && prev_ != device) {
    changed_ = cudaSetDevice(device) == cudaSuccess;
  }
}

DeviceGuard::~DeviceGuard() {
  if (changed_) cudaSetDevice(prev_);
}

CudaEvents::~CudaEvents() {
  // Events are leaked at process exit on purpose when the runtime is already gone.
  for (cudaEvent_t e : free_) cudaEventDestroy(e);
}

Event CudaEvents::record(Stream stream) {
  cudaEvent_t ev = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!free_.empty()) {
      ev = free_.back();
      free_.pop_back();
    }
  }
  DeviceGuard guard(device_);
  if (ev == nullptr && cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) {
    std::lock_guard<std::mutex> lock(mu_);
    last_error_ = std::string("cudaEventCreate: ") + cudaGetErrorString(cudaGetLastError());
    // Fall back to a device sync: the work is done when this returns.
    cudaDeviceSynchronize();
    return Event{};
  }
  if (cudaEventRecord(ev, static_cast<cudaStream_t>(stream)) != cudaSuccess) {
    std::lock_guard<std::mutex> lock(mu_);
    last_error_ = std::string("cudaEventRecord: ") + cudaGetErrorString(cudaGetLastError());
    cudaDeviceSynchronize();
    free_.push_back(ev);
    return Event{};
  }
  return Event{ev, 0};
}

bool CudaEvents::query(const Event& e) {
  if (e.handle == nullptr) return true;
  cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(e.handle));
  if (err == cudaErrorNotReady) return false;
  if (err != cudaSuccess) {
    cudaGetLastError();
    wait(e);
  }
  return true;
}

void CudaEvents::wait(const Event& e) {
  if (e.handle != nullptr) cudaEventSynchronize(static_cast<cudaEvent_t>(e.handle));
}

bool CudaEvents::wait_for(const Event& e, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (int spins = 0; !query(e); ++spins) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    if (spins < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  return true;
}

void CudaEvents::release(const Event& e) {
  if (e.handle == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  free_.push_back(static_cast<cudaEvent_t>(e.handle));
}

std::string CudaEvents::last_error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_error_;
}

}  // namespace bgl::alloc
