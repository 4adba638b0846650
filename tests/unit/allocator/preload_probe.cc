// A CUDA runtime client for the LD_PRELOAD test: calls cudaMalloc/cudaFree and, when the shim
// is loaded, checks the allocator's statistics through the C ABI found with dlsym.
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "bgl/alloc.h"

#define REQUIRE(c)                                             \
  do {                                                         \
    if (!(c)) {                                                \
      std::fprintf(stderr, "preload_probe: failed: %s\n", #c); \
      return 1;                                                \
    }                                                          \
  } while (0)

int main(int argc, char** argv) {
  const bool expect_bgl = argc > 1 && std::string(argv[1]) == "--expect-bgl";
  using StatsFn = int (*)(int, bgl_alloc_stats*);
  auto stats = reinterpret_cast<StatsFn>(dlsym(RTLD_DEFAULT, "bgl_alloc_get_stats"));
  constexpr size_t kSize = 3 << 20;
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, kSize);
  if (expect_bgl) {
    REQUIRE(stats != nullptr);
    REQUIRE(e == cudaSuccess);
    REQUIRE(p != nullptr);
    std::memset(p, 0x5a, kSize);  // host backend memory
    bgl_alloc_stats st{};
    REQUIRE(stats(0, &st) == BGL_OK);
    REQUIRE(st.allocated_bytes == static_cast<int64_t>(kSize));
    REQUIRE(st.requested_bytes == static_cast<int64_t>(kSize));
    REQUIRE(st.num_allocs == 1);
    void* q = nullptr;
    REQUIRE(cudaMallocAsync(&q, 1000, nullptr) == cudaSuccess);
    REQUIRE(cudaFreeAsync(q, nullptr) == cudaSuccess);
    REQUIRE(cudaFree(p) == cudaSuccess);
    REQUIRE(stats(0, &st) == BGL_OK);
    REQUIRE(st.allocated_bytes == 0);
    REQUIRE(st.num_frees == 2);
    REQUIRE(st.reserved_bytes > 0);
    std::printf("preload_probe: served by bgl_alloc (reserved %lld bytes, %llu allocs)\n",
                static_cast<long long>(st.reserved_bytes),
                static_cast<unsigned long long>(st.num_allocs));
    return 0;
  }
  REQUIRE(stats == nullptr);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0) {
    REQUIRE(e == cudaSuccess);
    cudaFree(p);
    std::printf("preload_probe: a CUDA device is present; the runtime served cudaMalloc\n");
    return 0;
  }
  REQUIRE(e != cudaSuccess);
  std::printf("preload_probe: runtime error without the shim: %s\n", cudaGetErrorName(e));
  return 0;
}
