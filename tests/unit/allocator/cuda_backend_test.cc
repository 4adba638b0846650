// CUDA backends (cuda-vmm, cuda-async) on a real device; every test skips without one.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <vector>

#include "allocator/allocator.h"
#include "allocator/cuda_async_backend.h"
#include "tests/unit/allocator/test_util.h"

namespace bgl::alloc {
namespace {

using testing::kMiB;

class CudaBackendTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  }
  std::unique_ptr<Pool> make(std::size_t limit = 0) {
    return testing::make_backend_pool(GetParam(), limit);
  }
};

TEST_P(CudaBackendTest, AllocateWriteReadFree) {
  auto p = make();
  ASSERT_NE(p, nullptr);
  const std::size_t n = 5 * kMiB + 123;
  void* d = p->allocate(n, nullptr);
  ASSERT_NE(d, nullptr) << last_error();
  ASSERT_EQ(cudaMemset(d, 0x3c, n), cudaSuccess);
  std::vector<unsigned char> h(n);
  ASSERT_EQ(cudaMemcpy(h.data(), d, n, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(h[0], 0x3c);
  EXPECT_EQ(h[n - 1], 0x3c);
  EXPECT_EQ(p->deallocate(d, n, nullptr), Status::kOk);
  std::string why;
  EXPECT_TRUE(p->check_invariants(&why)) << why;
}

TEST_P(CudaBackendTest, CrossStreamReuseWaitsForEvent) {
  auto p = make(64 * kMiB);
  ASSERT_NE(p, nullptr);
  cudaStream_t a, b;
  ASSERT_EQ(cudaStreamCreate(&a), cudaSuccess);
  ASSERT_EQ(cudaStreamCreate(&b), cudaSuccess);
  const std::size_t n = 64 * kMiB;
  void* x = p->allocate(n, a);
  ASSERT_NE(x, nullptr);
  for (int i = 0; i < 20; ++i) cudaMemsetAsync(x, 0xAA, n, a);  // queued work on A
  p->deallocate(x, n, a);
  void* y = p->allocate(n, b);  // only A's block fits: must wait for A
  ASSERT_EQ(y, x);
  ASSERT_EQ(cudaMemsetAsync(y, 0xBB, n, b), cudaSuccess);
  cudaStreamSynchronize(b);
  cudaStreamSynchronize(a);
  unsigned char h = 0;
  cudaMemcpy(&h, static_cast<char*>(y) + n - 1, 1, cudaMemcpyDeviceToHost);
  EXPECT_EQ(h, 0xBB);
  p->deallocate(y, n, b);
  cudaStreamDestroy(a);
  cudaStreamDestroy(b);
}

TEST_P(CudaBackendTest, EmptyCacheAndOomMessage) {
  auto p = make(256 * kMiB);
  ASSERT_NE(p, nullptr);
  int maps = 0;
  p->add_segment_hook([&](int, void*, std::size_t, bool m) { maps += m ? 1 : -1; });
  void* x = p->allocate(100 * kMiB, nullptr);
  ASSERT_NE(x, nullptr);
  EXPECT_EQ(p->allocate(300 * kMiB, nullptr), nullptr);
  EXPECT_NE(last_error().find("out of memory"), std::string::npos);
  p->deallocate(x, 100 * kMiB, nullptr);
  EXPECT_GT(p->empty_cache(), 0u);
  EXPECT_EQ(p->stats().reserved_bytes.current, 0);
  EXPECT_EQ(maps, 0);
}

INSTANTIATE_TEST_SUITE_P(Backends, CudaBackendTest, ::testing::Values("cuda-vmm", "cuda-async"));

}  // namespace
}  // namespace bgl::alloc
