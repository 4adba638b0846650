// CudaVmmBackend: device memory through the CUDA virtual memory API (cuMemAddressReserve,
// cuMemCreate, cuMemMap, cuMemSetAccess), resolved at run time; libcuda is never linked.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "allocator/backend.h"

namespace bgl::alloc {

// Creates the backend for `device`; null with `error` set when CUDA or VMM is unavailable.
// `page_size` is rounded up to the device's allocation granularity.
std::unique_ptr<Backend> make_cuda_vmm_backend(int device, std::size_t page_size,
                                               std::string* error);

}  // namespace bgl::alloc
