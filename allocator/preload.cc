// LD_PRELOAD shim: cudaMalloc, cudaFree, cudaMallocAsync and cudaFreeAsync (and the _ptsz
// variants) served by the BaGuaLu allocator; other pointers and failures fall through to the
// real CUDA runtime. Works for programs that link libcudart dynamically.
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cstdio>

#include "allocator/global.h"
#include "bgl/alloc.h"

namespace {

using bgl::alloc::global_allocator;
using bgl::alloc::global_owns;

template <typename Fn>
Fn real(const char* name) {
  return reinterpret_cast<Fn>(dlsym(RTLD_NEXT, name));
}

int current_device() {
  using GetDevice = cudaError_t (*)(int*);
  static GetDevice get = real<GetDevice>("cudaGetDevice");
  int d = 0;
  if (get == nullptr || get(&d) != cudaSuccess) return 0;  // no CUDA device: host backend
  return d;
}

cudaError_t do_malloc(void** ptr, size_t size, cudaStream_t stream, const char* real_name,
                      bool async) {
  if (ptr == nullptr) return cudaErrorInvalidValue;
  if (size == 0) {
    *ptr = nullptr;
    return cudaSuccess;
  }
  if (global_allocator() == nullptr) {
    // Bad BGL_ALLOC_CONF (already reported): behave like the plain runtime.
    if (async) {
      using Fn = cudaError_t (*)(void**, size_t, cudaStream_t);
      Fn fn = real<Fn>(real_name);
      return fn == nullptr ? cudaErrorNotSupported : fn(ptr, size, stream);
    }
    using Fn = cudaError_t (*)(void**, size_t);
    Fn fn = real<Fn>(real_name);
    return fn == nullptr ? cudaErrorNotSupported : fn(ptr, size);
  }
  *ptr = bgl_alloc(size, current_device(), stream);
  return *ptr == nullptr ? cudaErrorMemoryAllocation : cudaSuccess;
}

cudaError_t do_free(void* ptr, cudaStream_t stream, const char* real_name, bool async) {
  int device = 0;
  if (global_owns(ptr, &device)) {
    bgl_free(ptr, 0, device, stream);
    return cudaSuccess;
  }
  // Null (cudaFree(0) initializes the context) and foreign pointers go to the runtime.
  if (async) {
    using Fn = cudaError_t (*)(void*, cudaStream_t);
    Fn fn = real<Fn>(real_name);
    return fn == nullptr ? cudaErrorNotSupported : fn(ptr, stream);
  }
  using Fn = cudaError_t (*)(void*);
  Fn fn = real<Fn>(real_name);
  return fn == nullptr ? cudaErrorNotSupported : fn(ptr);
}

}  // namespace

#define BGL_EXPORT __attribute__((visibility("default")))

extern "C" {

BGL_EXPORT cudaError_t cudaMalloc(void** devPtr, size_t size) {
  return do_malloc(devPtr, size, nullptr, "cudaMalloc", false);
}

BGL_EXPORT cudaError_t cudaFree(void* devPtr) {
  return do_free(devPtr, nullptr, "cudaFree", false);
}

BGL_EXPORT cudaError_t cudaMallocAsync(void** devPtr, size_t size, cudaStream_t stream) {
  return do_malloc(devPtr, size, stream, "cudaMallocAsync", true);
}

BGL_EXPORT cudaError_t cudaFreeAsync(void* devPtr, cudaStream_t stream) {
  return do_free(devPtr, stream, "cudaFreeAsync", true);
}

BGL_EXPORT cudaError_t cudaMallocAsync_ptsz(void** devPtr, size_t size, cudaStream_t stream) {
  return do_malloc(devPtr, size, stream, "cudaMallocAsync_ptsz", true);
}

BGL_EXPORT cudaError_t cudaFreeAsync_ptsz(void* devPtr, cudaStream_t stream) {
  return do_free(devPtr, stream, "cudaFreeAsync_ptsz", true);
}

}  // extern "C"
