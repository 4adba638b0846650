// Segment hooks driving NCCL buffer registration, the way PyTorch's allocator registers its
// segments for ProcessGroupNCCL: ncclCommRegister after a map, ncclCommDeregister before the
// unmap. Single-rank communicator on device 0; every test skips without a CUDA device.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <nccl.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "allocator/allocator.h"
#include "allocator/pool.h"
#include "tests/unit/allocator/test_util.h"

namespace bgl::alloc {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

// One ncclCommRegister call and what became of it.
struct Registration {
  std::uintptr_t begin;
  std::uintptr_t end;
  void* handle;  // NCCL may hand back null when it skips registration; null deregisters fine
  int deregistrations = 0;
};

// The hook's bookkeeping. Unmapped ranges need not match mapped ones: on the expandable backend
// adjacent maps coalesce and are released together, and defragmentation releases part of a
// mapped run. So an unmap deregisters every registration it touches and registers again the
// parts that stay mapped; a registration is never left covering unmapped memory.
class NcclRegistry {
 public:
  explicit NcclRegistry(ncclComm_t comm) : comm_(comm) {}

  void OnSegment(void* addr, std::size_t bytes, bool mapped) {
    const auto lo = reinterpret_cast<std::uintptr_t>(addr);
    const auto hi = lo + bytes;
    if (mapped) {
      ++maps_;
      Register(lo, hi);
      return;
    }
    ++unmaps_;
    std::size_t covered = 0;
    // Index loop: Register() appends while we walk.
    for (std::size_t i = 0; i < regs_.size(); ++i) {
      Registration r = regs_[i];
      if (r.deregistrations != 0 || r.end <= lo || r.begin >= hi) continue;
      covered += std::min(r.end, hi) - std::max(r.begin, lo);
      Check(ncclCommDeregister(comm_, r.handle), "ncclCommDeregister");
      ++regs_[i].deregistrations;
      if (r.begin < lo) Register(r.begin, lo);
      if (r.end > hi) Register(hi, r.end);
    }
    if (covered != bytes) {
      errors_.push_back("unmap of " + std::to_string(bytes) + " bytes, registered " +
                        std::to_string(covered));
    }
  }

  // True when [addr, addr + bytes) lies in live registrations (they are disjoint).
  bool Covers(const void* addr, std::size_t bytes) const {
    const auto lo = reinterpret_cast<std::uintptr_t>(addr);
    std::size_t covered = 0;
    for (const Registration& r : regs_) {
      if (r.deregistrations != 0 || r.end <= lo || r.begin >= lo + bytes) continue;
      covered += std::min(r.end, lo + bytes) - std::max(r.begin, lo);
    }
    return covered == bytes;
  }

  const std::vector<Registration>& registrations() const { return regs_; }
  const std::vector<std::string>& errors() const { return errors_; }
  int maps() const { return maps_; }
  int unmaps() const { return unmaps_; }

 private:
  void Register(std::uintptr_t begin, std::uintptr_t end) {
    void* handle = nullptr;
    if (Check(ncclCommRegister(comm_, reinterpret_cast<void*>(begin), end - begin, &handle),
              "ncclCommRegister")) {
      regs_.push_back(Registration{begin, end, handle});
    }
  }
  bool Check(ncclResult_t r, const char* what) {
    if (r == ncclSuccess) return true;
    errors_.push_back(std::string(what) + ": " + ncclGetErrorString(r));
    return false;
  }

  ncclComm_t comm_;
  std::vector<Registration> regs_;
  std::vector<std::string> errors_;
  int maps_ = 0;
  int unmaps_ = 0;
};

// Both CUDA backends report their segments to the hooks: cuda-vmm per page range mapped into
// its reservation, cuda-async per cudaMallocFromPoolAsync segment.
class NcclHooksTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      cudaGetLastError();  // clear the sticky no-device error
      GTEST_SKIP() << "no CUDA device";
    }
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    const int dev = 0;
    const ncclResult_t r = ncclCommInitAll(&comm_, 1, &dev);
    ASSERT_EQ(r, ncclSuccess) << ncclGetErrorString(r);
  }
  void TearDown() override {
    if (comm_ != nullptr) {
      EXPECT_EQ(ncclCommDestroy(comm_), ncclSuccess);
    }
  }

  std::unique_ptr<Pool> MakePool() { return testing::make_backend_pool(GetParam()); }

  ncclComm_t comm_ = nullptr;
};

TEST_P(NcclHooksTest, RegistersSegmentsAndAllReducesPoolBuffers) {
  NcclRegistry registry(comm_);
  auto pool = MakePool();
  ASSERT_NE(pool, nullptr);
  const int hook = pool->add_segment_hook([&](int, void* addr, std::size_t bytes, bool mapped) {
    registry.OnSegment(addr, bytes, mapped);
  });
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);

  // Small and large arenas, and a buffer spanning several pages.
  const std::size_t count = (3 * kMiB + 4096) / sizeof(float);
  const std::size_t bytes = count * sizeof(float);
  const std::vector<std::size_t> sizes = {64 * 1024, bytes, bytes, 10 * kMiB};
  std::vector<void*> bufs;
  for (std::size_t n : sizes) {
    void* p = pool->allocate(n, stream);
    ASSERT_NE(p, nullptr) << last_error();
    EXPECT_TRUE(registry.Covers(p, n)) << "buffer of " << n << " bytes not registered";
    bufs.push_back(p);
  }
  EXPECT_GT(registry.maps(), 0);

  // Sum over one rank: recv == send. Out of place, so both buffers are touched by NCCL.
  std::vector<float> host(count);
  for (std::size_t i = 0; i < count; ++i) host[i] = static_cast<float>(i % 1000) + 0.5f;
  ASSERT_EQ(cudaMemcpyAsync(bufs[1], host.data(), bytes, cudaMemcpyHostToDevice, stream),
            cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(bufs[2], 0, bytes, stream), cudaSuccess);
  const ncclResult_t ar = ncclAllReduce(bufs[1], bufs[2], count, ncclFloat, ncclSum, comm_, stream);
  ASSERT_EQ(ar, ncclSuccess) << ncclGetErrorString(ar);
  std::vector<float> out(count, -1.0f);
  ASSERT_EQ(cudaMemcpyAsync(out.data(), bufs[2], bytes, cudaMemcpyDeviceToHost, stream),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(out, host);

  for (std::size_t i = 0; i < bufs.size(); ++i) {
    EXPECT_EQ(pool->deallocate(bufs[i], sizes[i], stream), Status::kOk);
  }
  EXPECT_GT(pool->empty_cache(), 0u);
  EXPECT_EQ(pool->stats().reserved_bytes.current, 0);
  EXPECT_GT(registry.unmaps(), 0);

  EXPECT_FALSE(registry.registrations().empty());
  for (const Registration& r : registry.registrations()) {
    EXPECT_EQ(r.deregistrations, 1) << "registration at 0x" << std::hex << r.begin;
  }
  EXPECT_TRUE(registry.errors().empty()) << registry.errors().front();
  std::string why;
  EXPECT_TRUE(pool->check_invariants(&why)) << why;

  // The hook captures the registry: detach it before either goes away.
  pool->remove_segment_hook(hook);
  pool.reset();
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

INSTANTIATE_TEST_SUITE_P(Backends, NcclHooksTest, ::testing::Values("cuda-vmm", "cuda-async"));

}  // namespace
}  // namespace bgl::alloc
