// Enforcer benchmarks on the host path: offload+reload round trips on host streams (bytes/s),
// FP8 host-twin cast and uncast, tracker register/release and the scheduler's issue cost.
#include <benchmark/benchmark.h>

#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "allocator/host_backend.h"
#include "allocator/host_stream.h"
#include "enforcer/enforcer.h"
#include "kernels/fp8_cast.h"
#include "kernels/stream_copy.h"

namespace bgl::enf {
namespace {

using alloc::HostBackend;
using alloc::HostBackendOptions;
using alloc::HostStream;
using alloc::PoolOptions;

struct Rig {
  Rig() {
    HostBackendOptions bo;
    bo.capacity = std::size_t{4} << 30;
    PoolOptions po;
    po.log = false;
    pool = std::make_unique<Pool>(std::make_unique<HostBackend>(bo), po);
    EnforcerOptions eo;
    eo.pinned_capacity = std::size_t{2} << 30;
    eo.d2h = &d2h;
    eo.h2d = &h2d;
    std::string error;
    enf = Enforcer::create(pool.get(), make_host_device_ops(), eo, &error);
  }
  ~Rig() {
    enf.reset();
    compute.synchronize();
  }
  std::uint64_t reg(void* p, std::size_t n, ElemType t = ElemType::kBytes) {
    TensorDesc d{p, n, t, 0, 0, 0, &compute, true};
    std::uint64_t h = 0;
    enf->register_tensor(d, &h);
    return h;
  }
  HostStream compute, d2h, h2d;
  std::unique_ptr<Pool> pool;
  std::unique_ptr<Enforcer> enf;
};

// One tensor offloaded to pinned host and reloaded, waiting for the data each time.
void BM_OffloadReload(benchmark::State& state) {
  Rig rig;
  const auto n = static_cast<std::size_t>(state.range(0));
  for (auto _ : state) {
    void* p = rig.pool->allocate(n, &rig.compute);
    std::memset(p, 1, 64);
    const auto h = rig.reg(p, n);
    rig.enf->offload(h);
    void* q = nullptr;
    rig.enf->acquire(h, -1, &rig.compute, &q);
    rig.compute.synchronize();
    rig.enf->release(h, -1, &rig.compute);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * n * 2));
}
BENCHMARK(BM_OffloadReload)
    ->Arg(64 << 10)
    ->Arg(1 << 20)
    ->Arg(16 << 20)
    ->Arg(64 << 20)
    ->UseRealTime();

// Baseline: the same bytes copied twice by memcpy on the calling thread.
void BM_MemcpyBaseline(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  std::vector<std::uint8_t> a(n, 1), b(n);
  for (auto _ : state) {
    std::memcpy(b.data(), a.data(), n);
    std::memcpy(a.data(), b.data(), n);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * n * 2));
}
BENCHMARK(BM_MemcpyBaseline)->Arg(64 << 10)->Arg(1 << 20)->Arg(16 << 20)->Arg(64 << 20);

// The host backend's copy as offloads and reloads make it: each copy from a source the
// "framework" just wrote into a destination not touched since the last round, over 256 blocks
// (more than the caches hold at 64 KiB and up), against memcpy. Arg 1: 1 streaming, 0 memcpy.
void BM_CopyCold(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const bool streaming = state.range(1) != 0;
  constexpr int kBlocks = 256;
  std::vector<std::vector<std::uint8_t>> src(kBlocks, std::vector<std::uint8_t>(n, 1));
  std::vector<std::vector<std::uint8_t>> dst(kBlocks, std::vector<std::uint8_t>(n, 0));
  int i = 0;
  for (auto _ : state) {
    state.PauseTiming();
    for (std::size_t j = 0; j < n; j += 64) ++src[i][j];  // the producer wrote it
    state.ResumeTiming();
    if (streaming) {
      kern::stream_copy_host(dst[i].data(), src[i].data(), n);
    } else {
      std::memcpy(dst[i].data(), src[i].data(), n);
    }
    benchmark::ClobberMemory();
    i = (i + 1) % kBlocks;
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * n));
}
BENCHMARK(BM_CopyCold)
    ->ArgsProduct({{64 << 10, 512 << 10}, {0, 1}})
    ->ArgNames({"bytes", "streaming"});

void BM_Fp8CastHost(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  std::vector<std::uint16_t> src(n);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0, 1);
  for (auto& v : src) v = kern::float_to_bf16(normal(rng));
  std::vector<std::uint8_t> q(n);
  std::vector<float> sc(kern::fp8_num_blocks(n, 128));
  for (auto _ : state) {
    kern::cast_to_fp8_host(src.data(), kern::DType::kBF16, n, q.data(), sc.data(), 128);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * n * 2));
}
BENCHMARK(BM_Fp8CastHost)->Arg(1 << 20)->Arg(16 << 20);

void BM_Fp8UncastHost(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  std::vector<std::uint8_t> q(n, 0x38);
  std::vector<float> sc(kern::fp8_num_blocks(n, 128), 0.5f);
  std::vector<std::uint16_t> out(n);
  for (auto _ : state) {
    kern::cast_from_fp8_host(q.data(), sc.data(), n, 128, kern::DType::kBF16, out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * n * 2));
}
BENCHMARK(BM_Fp8UncastHost)->Arg(1 << 20)->Arg(16 << 20);

// Tracker bookkeeping: register, two consumers, acquire/release each (no movement).
void BM_RegisterAcquireRelease(benchmark::State& state) {
  Rig rig;
  void* p = rig.pool->allocate(4096, &rig.compute);
  for (auto _ : state) {
    TensorDesc d{p, 4096, ElemType::kBytes, 0, 0, 0, &rig.compute, false};
    std::uint64_t h = 0;
    rig.enf->register_tensor(d, &h);
    rig.enf->add_consumer(h, 1);
    rig.enf->add_consumer(h, 2);
    void* q = nullptr;
    rig.enf->acquire(h, 1, &rig.compute, &q);
    rig.enf->acquire(h, 2, &rig.compute, &q);
    rig.enf->release(h, 1, &rig.compute);
    rig.enf->release(h, 2, &rig.compute);
  }
  rig.pool->deallocate(p, 0, &rig.compute);
}
BENCHMARK(BM_RegisterAcquireRelease);

// Scheduler: a 64-item issue order of empty O/R pieces (bookkeeping and events only).
void BM_ScheduleOrder(benchmark::State& state) {
  Rig rig;
  std::vector<plan::IssueItem> order;
  for (int r = 0; r < 16; ++r) {
    for (auto c : {plan::Chain::kForward, plan::Chain::kBackward, plan::Chain::kOffload,
                   plan::Chain::kRecover}) {
      plan::IssueItem it;
      it.chain = c;
      it.stage = r;
      it.round = r;
      it.resource = c == plan::Chain::kOffload   ? plan::Resource::kD2H
                    : c == plan::Chain::kRecover ? plan::Resource::kH2D
                                                 : plan::Resource::kCompute;
      order.push_back(it);
    }
  }
  for (auto _ : state) {
    rig.enf->schedule_begin(order, 0, 1);
    for (int r = 0; r < 16; ++r) rig.enf->schedule_reached(plan::Chain::kForward, r);
    rig.enf->schedule_finish();
  }
  state.SetItemsProcessed(state.iterations() * 32);
}
BENCHMARK(BM_ScheduleOrder);

}  // namespace
}  // namespace bgl::enf

BENCHMARK_MAIN();
