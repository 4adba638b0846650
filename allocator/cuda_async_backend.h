// CudaAsyncBackend: segments from cudaMallocFromPoolAsync on a private memory pool (the
// driver's stream-ordered allocator), under the same caching Pool.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "allocator/backend.h"

namespace bgl::alloc {

// Creates the backend for `device`; null with `error` set when CUDA is unavailable.
std::unique_ptr<Backend> make_cuda_async_backend(int device, std::size_t segment_size,
                                                 std::string* error);

// Number of CUDA devices (0 when no driver or device, or when built without CUDA).
int cuda_device_count();

}  // namespace bgl::alloc
