// The enforcer and FP8 kernels on the CUDA backend (label gpu; skips without a device).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <random>
#include <vector>

#include "allocator/allocator.h"
#include "enforcer/enforcer.h"
#include "kernels/fp8_cast.h"

namespace bgl::enf {
namespace {

using alloc::Config;
using alloc::make_backend;

bool have_device() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0 && kern::cuda_kernels_available();
}

struct CudaEnv {
  CudaEnv() {
    Config c;
    c.backend = "cuda-vmm";
    c.pool.log = false;
    std::string error;
    auto backend = make_backend(c, 0, &error);
    EXPECT_NE(backend, nullptr) << error;
    pool = std::make_unique<Pool>(std::move(backend), c.pool);
    EnforcerOptions eo;
    eo.pinned_capacity = std::size_t{2} << 30;
    enf = Enforcer::create(pool.get(), make_cuda_device_ops(0), eo, &error);
    EXPECT_NE(enf, nullptr) << error;
    cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking);
  }
  ~CudaEnv() {
    cudaStreamSynchronize(compute);
    enf.reset();
    pool.reset();
    cudaStreamDestroy(compute);
  }
  std::uint64_t make(const std::vector<std::uint8_t>& data, ElemType t = ElemType::kBytes) {
    void* p = pool->allocate(data.size(), compute);
    cudaMemcpyAsync(p, data.data(), data.size(), cudaMemcpyHostToDevice, compute);
    cudaStreamSynchronize(compute);
    TensorDesc d{p, data.size(), t, 0, -1, 0, compute, true};
    std::uint64_t h = 0;
    EXPECT_EQ(enf->register_tensor(d, &h), Status::kOk) << last_error();
    return h;
  }
  std::vector<std::uint8_t> fetch(std::uint64_t h, std::size_t n) {
    void* p = nullptr;
    EXPECT_EQ(enf->acquire(h, -1, compute, &p), Status::kOk) << last_error();
    std::vector<std::uint8_t> out(n);
    cudaMemcpyAsync(out.data(), p, n, cudaMemcpyDeviceToHost, compute);
    cudaStreamSynchronize(compute);
    return out;
  }
  std::unique_ptr<Pool> pool;
  std::unique_ptr<Enforcer> enf;
  cudaStream_t compute = nullptr;
};

std::vector<std::uint8_t> random_bytes(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<std::uint8_t> v(n);
  for (auto& b : v) b = static_cast<std::uint8_t>(rng());
  return v;
}

// Holds a CUDA stream in a host function until opened.
struct Gate {
  explicit Gate(cudaStream_t s) {
    cudaLaunchHostFunc(
        s,
        [](void* f) {
          while (!static_cast<std::atomic<bool>*>(f)->load()) {
          }
        },
        &open_);
  }
  void open() { open_ = true; }
  std::atomic<bool> open_{false};
};

TEST(EnforcerGpu, OffloadThenReloadIsBitIdentical) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  CudaEnv env;
  for (std::size_t n : {1, 7, 513, 65537, 1048579, 33554433}) {
    const auto data = random_bytes(n, static_cast<unsigned>(n));
    const auto h = env.make(data);
    ASSERT_EQ(env.enf->offload(h), Status::kOk) << last_error();
    EXPECT_EQ(env.fetch(h, n), data) << n;
    env.enf->release(h, -1, env.compute);
  }
}

TEST(EnforcerGpu, ReloadWaitsForTheOffloadAndTheBlockIsNotReusedEarly) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  CudaEnv env;
  const std::size_t n = 64 << 20;
  const auto data = random_bytes(n, 1);
  const auto h = env.make(data);
  Gate gate(static_cast<cudaStream_t>(env.enf->d2h_stream()));
  ASSERT_EQ(env.enf->offload(h), Status::kOk);
  void* other = env.pool->allocate(n, env.compute);
  cudaMemsetAsync(other, 0xEE, n, env.compute);
  ASSERT_EQ(env.enf->reload(h), Status::kOk);
  gate.open();
  EXPECT_EQ(env.fetch(h, n), data);
  env.pool->deallocate(other, 0, env.compute);
  env.enf->release(h, -1, env.compute);
}

TEST(EnforcerGpu, Fp8KernelsMatchTheHostTwinBitForBit) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  for (kern::DType t : {kern::DType::kF32, kern::DType::kF16, kern::DType::kBF16}) {
    for (std::size_t block :
         {std::size_t{128}, std::size_t{32}, std::size_t{100}, std::size_t{1024}}) {
      for (std::size_t n :
           {std::size_t{1}, std::size_t{1000}, std::size_t{1} << 20, std::size_t{1000003}}) {
        std::mt19937 rng(static_cast<unsigned>(n + block));
        std::normal_distribution<float> normal(0, 3);
        std::vector<std::uint8_t> src(n * kern::dtype_size(t));
        for (std::size_t i = 0; i < n; ++i) kern::store_elem(src.data(), t, i, normal(rng));
        const std::size_t nb = kern::fp8_num_blocks(n, block);
        std::vector<std::uint8_t> q(n), qd(n), back(src.size()), backd(src.size());
        std::vector<float> sc(nb), scd(nb);
        kern::cast_to_fp8_host(src.data(), t, n, q.data(), sc.data(), block);
        kern::cast_from_fp8_host(q.data(), sc.data(), n, block, t, back.data());
        void *ds, *dq, *dsc, *db;
        cudaMalloc(&ds, src.size());
        cudaMalloc(&dq, n);
        cudaMalloc(&dsc, nb * 4);
        cudaMalloc(&db, src.size());
        cudaMemcpy(ds, src.data(), src.size(), cudaMemcpyHostToDevice);
        ASSERT_EQ(kern::cast_to_fp8(ds, t, n, static_cast<std::uint8_t*>(dq),
                                    static_cast<float*>(dsc), block, nullptr),
                  0);
        ASSERT_EQ(kern::cast_from_fp8(static_cast<std::uint8_t*>(dq), static_cast<float*>(dsc), n,
                                      block, t, db, nullptr),
                  0);
        cudaMemcpy(qd.data(), dq, n, cudaMemcpyDeviceToHost);
        cudaMemcpy(scd.data(), dsc, nb * 4, cudaMemcpyDeviceToHost);
        cudaMemcpy(backd.data(), db, src.size(), cudaMemcpyDeviceToHost);
        EXPECT_EQ(q, qd) << "dtype " << int(t) << " block " << block << " n " << n;
        EXPECT_EQ(0, std::memcmp(sc.data(), scd.data(), nb * 4));
        EXPECT_EQ(back, backd);
        cudaFree(ds);
        cudaFree(dq);
        cudaFree(dsc);
        cudaFree(db);
      }
    }
  }
}

TEST(EnforcerGpu, Fp8StoreAndRestoreThroughTheEnforcer) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  CudaEnv env;
  const std::size_t n = 300001;
  std::vector<std::uint8_t> src(2 * n);
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0, 1);
  for (std::size_t i = 0; i < n; ++i)
    kern::store_elem(src.data(), kern::DType::kBF16, i, normal(rng));
  const auto h = env.make(src, ElemType::kBF16);
  ASSERT_EQ(env.enf->store_fp8(h), Status::kOk) << last_error();
  std::vector<std::uint8_t> q(n), want(2 * n);
  std::vector<float> sc(kern::fp8_num_blocks(n, 128));
  kern::cast_to_fp8_host(src.data(), kern::DType::kBF16, n, q.data(), sc.data(), 128);
  kern::cast_from_fp8_host(q.data(), sc.data(), n, 128, kern::DType::kBF16, want.data());
  EXPECT_EQ(env.fetch(h, 2 * n), want);
  env.enf->release(h, -1, env.compute);
}

}  // namespace
}  // namespace bgl::enf
