// Allocator micro-benchmarks on the host backend (no GPU needed).
#include <benchmark/benchmark.h>

#include <memory>

#include "allocator/host_backend.h"
#include "allocator/host_stream.h"
#include "allocator/pool.h"
#if BGL_HAVE_REPLAY
#include "tools/bgl-replay/replay.h"
#endif

namespace bgl::alloc {
namespace {

std::unique_ptr<Pool> make_pool() {
  HostBackendOptions b;
  b.capacity = std::size_t{16} << 30;
  PoolOptions o;
  o.log = false;
  return std::make_unique<Pool>(std::make_unique<HostBackend>(b), o);
}

// One thread: allocate and free the same size; every allocation after the first is a hit.
void BM_PairCacheHit(benchmark::State& state) {
  auto pool = make_pool();
  const auto size = static_cast<std::size_t>(state.range(0));
  HostStream stream;
  pool->deallocate(pool->allocate(size, &stream), size, &stream);  // warm
  for (auto _ : state) {
    void* p = pool->allocate(size, &stream);
    benchmark::DoNotOptimize(p);
    pool->deallocate(p, size, &stream);
  }
  state.SetItemsProcessed(state.iterations());
  state.SetLabel("ns/pair = time");
}
BENCHMARK(BM_PairCacheHit)->Arg(4096)->Arg(1 << 20)->Arg(64 << 20);

// Mixed live set: 64 blocks live, free and reallocate one per iteration (best fit with splits).
void BM_PairWithLiveSet(benchmark::State& state) {
  auto pool = make_pool();
  HostStream stream;
  constexpr int kLive = 64;
  void* live[kLive];
  std::size_t sizes[kLive];
  for (int i = 0; i < kLive; ++i) {
    sizes[i] = (std::size_t{1} << (12 + i % 12)) + 512 * i;
    live[i] = pool->allocate(sizes[i], &stream);
  }
  int i = 0;
  for (auto _ : state) {
    pool->deallocate(live[i], sizes[i], &stream);
    live[i] = pool->allocate(sizes[i], &stream);
    benchmark::DoNotOptimize(live[i]);
    i = (i + 1) % kLive;
  }
  for (int k = 0; k < kLive; ++k) pool->deallocate(live[k], sizes[k], &stream);
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_PairWithLiveSet);

// Two threads, each on its own stream, sharing one pool.
Pool* g_shared = nullptr;
HostStream* g_streams[2] = {nullptr, nullptr};
void BM_PairTwoStreams(benchmark::State& state) {
  if (state.thread_index() == 0) {
    g_shared = make_pool().release();
    g_streams[0] = new HostStream();
    g_streams[1] = new HostStream();
  }
  // google benchmark starts the timed loop of all threads together after setup.
  const std::size_t size = 1 << 20;
  for (auto _ : state) {
    HostStream* s = g_streams[state.thread_index() % 2];
    void* p = g_shared->allocate(size, s);
    benchmark::DoNotOptimize(p);
    g_shared->deallocate(p, size, s);
  }
  state.SetItemsProcessed(state.iterations());
  if (state.thread_index() == 0) {
    delete g_shared;
    delete g_streams[0];
    delete g_streams[1];
  }
}
BENCHMARK(BM_PairTwoStreams)->Threads(2)->UseRealTime();

#if BGL_HAVE_REPLAY
void BM_ReplayTrace(benchmark::State& state, const char* file) {
  replay::Trace t;
  std::string err;
  if (!replay::load_trace(std::string(BGL_TRACES_DIR) + "/" + file, 0, &t, &err)) {
    state.SkipWithError(err.c_str());
    return;
  }
  Config c;
  c.backend = "host";
  c.capacity = std::size_t{1} << 40;
  c.pool.log = false;
  replay::ReplayResult r;
  for (auto _ : state) {
    if (!replay::run_replay(t, c, 1, &r, &err)) state.SkipWithError(err.c_str());
  }
  state.counters["peak_reserved_over_live"] = r.ratio;
  state.counters["ns_per_op"] = r.ns_per_op;
  state.counters["ooms"] = static_cast<double>(r.ooms);
}
BENCHMARK_CAPTURE(BM_ReplayTrace, moe_fine_64e, "moe-fine-64e.csv")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_ReplayTrace, moe_spiky_128e, "moe-spiky-128e.csv")
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_ReplayTrace, moe_coarse_16e, "moe-coarse-16e.csv")
    ->Unit(benchmark::kMillisecond);
#endif

}  // namespace
}  // namespace bgl::alloc

BENCHMARK_MAIN();
