// Plan latency for the Table II GLM-423B-A30B stage (pipeline rank 0, 64 GB): a cold plan
// (cache miss), a cached plan (cache hit), and the amortised cost per iteration over 1,000
// iterations whose load factors follow the paper's distribution.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "governor/planner/iteration.h"
#include "governor/planner/load_distribution.h"
#include "governor/planner/planner.h"

namespace {

using namespace bgl::plan;

std::unique_ptr<StagePlanner> Glm423Planner() {
  auto config = LoadModelConfig(std::string(BGL_MODELS_DIR) + "/glm-423b-a30b.json");
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", config.status().message().c_str());
    std::exit(1);
  }
  PlannerOptions options;
  options.capacity_bytes = int64_t{64} * 1000 * 1000 * 1000;
  auto planner = StagePlanner::Create(*config, *HardwareProfileByName("paper"), options);
  if (!planner.ok()) {
    std::fprintf(stderr, "%s\n", planner.status().message().c_str());
    std::exit(1);
  }
  return std::move(*planner);
}

// A steady point F_x B_y after a balanced warmup, at load r.
SchedulePoint SteadyPoint(StagePlanner& planner, double r) {
  std::vector<double> loads(static_cast<size_t>(planner.config().MicroBatches()), 1.0);
  (void)ReplayIteration(planner, loads);
  planner.ResetIteration();
  const auto& steps = planner.steps();
  size_t i = 0;
  for (; steps[i].phase == Phase::kWarmup; ++i) {
    SchedulePoint p;
    p.forward_micro_batch = steps[i].micro_batch;
    p.forward_chunk = steps[i].chunk;
    (void)planner.PlanPoint(p);
  }
  SchedulePoint p;
  p.forward_micro_batch = steps[i].micro_batch;
  p.forward_chunk = steps[i].chunk;
  p.backward_micro_batch = steps[i + 1].micro_batch;
  p.backward_chunk = steps[i + 1].chunk;
  p.load_factor = r;
  p.bytes_in_use = static_cast<int64_t>(planner.used_bytes());
  return p;
}

void BM_PlanCacheMiss(benchmark::State& state) {
  auto planner = Glm423Planner();
  SchedulePoint point = SteadyPoint(*planner, 2.6);
  for (auto _ : state) {
    planner->ClearCaches();
    auto plan = planner->PlanPoint(point);
    benchmark::DoNotOptimize(plan);
  }
}
BENCHMARK(BM_PlanCacheMiss)->Unit(benchmark::kMicrosecond);

void BM_PlanCacheHit(benchmark::State& state) {
  auto planner = Glm423Planner();
  SchedulePoint point = SteadyPoint(*planner, 2.6);
  (void)planner->PlanPoint(point);
  for (auto _ : state) {
    auto plan = planner->PlanPoint(point);
    benchmark::DoNotOptimize(plan);
  }
  state.counters["hit_rate"] = static_cast<double>(planner->cache_stats().mitigation.hits) /
                               static_cast<double>(planner->cache_stats().mitigation.hits +
                                                   planner->cache_stats().mitigation.misses);
}
BENCHMARK(BM_PlanCacheHit)->Unit(benchmark::kMicrosecond);

// Every scheduling point of 1,000 iterations (64 micro-batch chunks each) planned and reported.
void BM_PlanPerIteration(benchmark::State& state) {
  constexpr int kIterations = 1000;
  double planning_s = 0;
  for (auto _ : state) {
    auto planner = Glm423Planner();
    LoadSampler sampler(7);
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kIterations; ++i) {
      auto loads = sampler.Iteration(static_cast<int>(planner->config().MicroBatches()));
      auto replay = ReplayIteration(*planner, loads);
      benchmark::DoNotOptimize(replay);
    }
    planning_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const auto stats = planner->cache_stats();
    state.counters["mitigation_hit_rate"] =
        static_cast<double>(stats.mitigation.hits) /
        static_cast<double>(stats.mitigation.hits + stats.mitigation.misses);
    state.counters["schedule_hit_rate"] =
        static_cast<double>(stats.schedule.hits) /
        static_cast<double>(stats.schedule.hits + stats.schedule.misses);
  }
  state.SetItemsProcessed(state.iterations() * kIterations);
  state.counters["per_iteration_us"] =
      planning_s * 1e6 / static_cast<double>(state.iterations() * kIterations);
}
BENCHMARK(BM_PlanPerIteration)->Unit(benchmark::kMillisecond)->Iterations(1);

}  // namespace

BENCHMARK_MAIN();
