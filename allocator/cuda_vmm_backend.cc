#include "allocator/cuda_vmm_backend.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <unordered_map>

#include "allocator/cuda_events.h"

namespace bgl::alloc {
namespace {

// Driver entry points, looked up through the runtime (no link against libcuda).
struct Driver {
  PFN_cuMemAddressReserve_v10020 reserve = nullptr;
  PFN_cuMemAddressFree_v10020 address_free = nullptr;
  PFN_cuMemCreate_v10020 create = nullptr;
  PFN_cuMemRelease_v10020 release = nullptr;
  PFN_cuMemMap_v10020 map = nullptr;
  PFN_cuMemUnmap_v10020 unmap = nullptr;
  PFN_cuMemSetAccess_v10020 set_access = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 granularity = nullptr;

  bool load(std::string* error) {
    auto get = [&](const char* name, auto* fn) {
      void* p = nullptr;
      cudaDriverEntryPointQueryResult q{};
      if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
          q != cudaDriverEntryPointSuccess || p == nullptr) {
        cudaGetLastError();
        *error = std::string("cuda-vmm: driver entry point ") + name + " not found";
        return false;
      }
      *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(p);
      return true;
    };
    return get("cuMemAddressReserve", &reserve) && get("cuMemAddressFree", &address_free) &&
           get("cuMemCreate", &create) && get("cuMemRelease", &release) && get("cuMemMap", &map) &&
           get("cuMemUnmap", &unmap) && get("cuMemSetAccess", &set_access) &&
           get("cuMemGetAllocationGranularity", &granularity);
  }
};

class CudaVmmBackend final : public Backend {
 public:
  CudaVmmBackend(int device, const Driver& drv, std::size_t page, std::size_t total)
      : device_(device), drv_(drv), page_(page), total_(total), events_(device) {}

  const char* name() const override { return "cuda-vmm"; }
  int device() const override { return device_; }
  std::size_t physical_capacity() const override { return total_; }
  std::size_t page_size() const override { return page_; }
  bool supports_reserve() const override { return true; }

  void* reserve(std::size_t bytes) override {
    DeviceGuard guard(device_);
    CUdeviceptr p = 0;
    CUresult r = drv_.reserve(&p, bytes, page_, 0, 0);
    if (r != CUDA_SUCCESS) {
      last_error_ = "cuMemAddressReserve failed with CUresult " + std::to_string(r);
      return nullptr;
    }
    return reinterpret_cast<void*>(p);
  }

  void unreserve(void* base, std::size_t bytes) override {
    drv_.address_free(reinterpret_cast<CUdeviceptr>(base), bytes);
  }

  bool map(void* addr, std::size_t bytes) override {
    DeviceGuard guard(device_);
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device_;
    const auto base = reinterpret_cast<CUdeviceptr>(addr);
    // One handle per page, so any page can later be unmapped on its own.
    for (std::size_t off = 0; off < bytes; off += page_) {
      CUmemGenericAllocationHandle h = 0;
      CUresult r = drv_.create(&h, page_, &prop, 0);
      if (r == CUDA_SUCCESS) {
        r = drv_.map(base + off, page_, 0, h, 0);
        if (r != CUDA_SUCCESS) drv_.release(h);
      }
      if (r != CUDA_SUCCESS) {
        last_error_ = r == CUDA_ERROR_OUT_OF_MEMORY
                          ? "cuMemCreate: device out of memory"
                          : "cuMemCreate/cuMemMap failed with CUresult " + std::to_string(r);
        if (off > 0) unmap(addr, off);
        return false;
      }
      handles_[base + off] = h;
    }
    CUmemAccessDesc desc{};
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = device_;
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CUresult r = drv_.set_access(base, bytes, &desc, 1);
    if (r != CUDA_SUCCESS) {
      last_error_ = "cuMemSetAccess failed with CUresult " + std::to_string(r);
      unmap(addr, bytes);
      return false;
    }
    return true;
  }

  void unmap(void* addr, std::size_t bytes) override {
    DeviceGuard guard(device_);
    const auto base = reinterpret_cast<CUdeviceptr>(addr);
    for (std::size_t off = 0; off < bytes; off += page_) {
      auto it = handles_.find(base + off);
      if (it == handles_.end()) continue;
      drv_.unmap(base + off, page_);
      drv_.release(it->second);
      handles_.erase(it);
    }
  }

  Event record(Stream stream) override { return events_.record(stream); }
  bool query(const Event& e) override { return events_.query(e); }
  void wait(const Event& e) override { events_.wait(e); }
  bool wait_for(const Event& e, std::chrono::milliseconds timeout) override {
    return events_.wait_for(e, timeout);
  }
  void release(const Event& e) override { events_.release(e); }
  std::string last_error() const override {
    return last_error_.empty() ? events_.last_error() : last_error_;
  }

 private:
  int device_;
  Driver drv_;
  std::size_t page_;
  std::size_t total_;
  CudaEvents events_;
  std::unordered_map<CUdeviceptr, CUmemGenericAllocationHandle> handles_;
  std::string last_error_;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_vmm_backend(int device, std::size_t page_size,
                                               std::string* error) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
    cudaGetLastError();
    *error = "cuda-vmm: no CUDA device " + std::to_string(device);
    return nullptr;
  }
  DeviceGuard guard(device);
  cudaFree(nullptr);  // creates the primary context
  Driver drv;
  if (!drv.load(error)) return nullptr;
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  std::size_t gran = 0;
  if (drv.granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS ||
      gran == 0) {
    *error =
        "cuda-vmm: cuMemGetAllocationGranularity failed (no virtual memory management on "
        "device " +
        std::to_string(device) + "?)";
    return nullptr;
  }
  std::size_t page = (page_size + gran - 1) / gran * gran;
  std::size_t free_b = 0, total = 0;
  if (cudaMemGetInfo(&free_b, &total) != cudaSuccess) {
    cudaGetLastError();
    *error = "cuda-vmm: cudaMemGetInfo failed";
    return nullptr;
  }
  return std::make_unique<CudaVmmBackend>(device, drv, page, total);
}

}  // namespace bgl::alloc
