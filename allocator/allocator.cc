#include "allocator/allocator.h"

#include <nlohmann/json.hpp>

#include "allocator/host_backend.h"
#include "allocator/snapshot.h"
#if BGL_ALLOC_HAVE_CUDA
#include "allocator/cuda_async_backend.h"
#include "allocator/cuda_vmm_backend.h"
#endif

namespace bgl::alloc {

std::unique_ptr<Backend> make_backend(const Config& config, int device, std::string* error) {
  if (config.backend == "host") {
    HostBackendOptions o;
    o.device = device;
    o.capacity = config.capacity;
    o.page_size = config.page_size != 0 ? config.page_size : kDefaultPageSize;
    o.expandable = config.expandable;
    return std::make_unique<HostBackend>(o);
  }
#if BGL_ALLOC_HAVE_CUDA
  if (config.backend == "cuda-vmm") {
    if (!config.expandable) {
      *error = "backend cuda-vmm needs expandable:true (use cuda-async for segments)";
      return nullptr;
    }
    return make_cuda_vmm_backend(
        device, config.page_size != 0 ? config.page_size : kCudaVmmPageSize, error);
  }
  if (config.backend == "cuda-async") {
    return make_cuda_async_backend(
        device, config.page_size != 0 ? config.page_size : kDefaultPageSize, error);
  }
#else
  if (config.backend == "cuda-vmm" || config.backend == "cuda-async") {
    *error = "backend " + config.backend + " is not available: built without CUDA";
    return nullptr;
  }
#endif
  *error = "unknown backend '" + config.backend + "'";
  return nullptr;
}

std::unique_ptr<Allocator> Allocator::create(const Config& config, std::string* error) {
  Config c = config;
  int devices = c.devices;
#if BGL_ALLOC_HAVE_CUDA
  const int cuda_devices = cuda_device_count();
#else
  const int cuda_devices = 0;
#endif
  if (c.backend == "auto") c.backend = cuda_devices > 0 ? "cuda-vmm" : "host";
  if (c.backend != "host") {
    if (cuda_devices == 0) {
#if BGL_ALLOC_HAVE_CUDA
      *error = "backend " + c.backend + ": no CUDA device";
#else
      *error = "backend " + c.backend + " is not available: built without CUDA";
#endif
      return nullptr;
    }
    devices = cuda_devices;
  }
  if (c.backend == "host" && !c.expandable) {
    c.pool.small_segment = c.page_size != 0 ? c.page_size : kDefaultPageSize;
  }
  devices = std::min(devices, kMaxDevices);
  return std::unique_ptr<Allocator>(new Allocator(c, devices));
}

Allocator::~Allocator() {
  for (auto& p : pools_) delete p.load();
}

Pool* Allocator::existing_pool(int device) const {
  if (device < 0 || device >= devices_) return nullptr;
  return pools_[device].load(std::memory_order_acquire);
}

Pool* Allocator::pool(int device) {
  if (device < 0 || device >= devices_) {
    report_error(config_.pool.log, "device " + std::to_string(device) + " out of range (" +
                                       std::to_string(devices_) + " devices, backend " +
                                       config_.backend + ")");
    return nullptr;
  }
  Pool* p = pools_[device].load(std::memory_order_acquire);
  if (p != nullptr) return p;
  std::lock_guard<std::mutex> lock(mu_);
  p = pools_[device].load(std::memory_order_acquire);
  if (p != nullptr) return p;
  std::string error;
  std::unique_ptr<Backend> backend = make_backend(config_, device, &error);
  if (backend == nullptr) {
    report_error(config_.pool.log, error);
    return nullptr;
  }
  p = new Pool(std::move(backend), config_.pool);
  pools_[device].store(p, std::memory_order_release);
  return p;
}

void* Allocator::allocate(std::size_t bytes, int device, Stream stream) {
  Pool* p = pool(device);
  return p == nullptr ? nullptr : p->allocate(bytes, stream);
}

Status Allocator::deallocate(void* ptr, std::size_t bytes, int device, Stream stream) {
  if (ptr == nullptr) return Status::kOk;
  Pool* p = existing_pool(device);
  if (p != nullptr && p->is_allocated(ptr)) return p->deallocate(ptr, bytes, stream);
  for (int d = 0; d < devices_; ++d) {
    Pool* other = existing_pool(d);
    if (other == nullptr || other == p || !other->is_allocated(ptr)) continue;
    other->count_wrong_device();
    report_error(config_.pool.log, "free of a pointer of device " + std::to_string(d) +
                                       " named device " + std::to_string(device) +
                                       "; freed by its owner");
    other->deallocate(ptr, bytes, stream);
    return Status::kWrongDevice;
  }
  if (p == nullptr) {
    // No pool: nothing was allocated on that device; count it on the first pool if any.
    for (int d = 0; d < devices_; ++d) {
      if (Pool* any = existing_pool(d)) return any->deallocate(ptr, bytes, stream);
    }
    report_error(config_.pool.log, "free of a foreign pointer; nothing was allocated");
    return Status::kForeignPointer;
  }
  return p->deallocate(ptr, bytes, stream);  // reports double or foreign free
}

std::string Allocator::snapshot_json() const {
  std::vector<const Pool*> pools;
  for (int d = 0; d < devices_; ++d) pools.push_back(existing_pool(d));
  return snapshot_to_json(pools, config_).dump();
}

}  // namespace bgl::alloc
