// Plan latency for the Table II GLM-423B-A30B stage (pipeline rank 0, 64 GB): a cold plan
// (cache miss), a cached plan (cache hit), and the amortised cost per iteration over 1,000
// iterations whose load factors follow the paper's distribution.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <vector>

#include "bench/load_distribution.h"
#include "governor/planner/iteration.h"
#include "governor/planner/mitigation.h"
#include "governor/planner/planner.h"
#include "tests/unit/planner/large_chunk.h"
#include "tests/unit/planner/real_instances.h"

namespace {

using namespace bgl::plan;

double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

std::unique_ptr<StagePlanner> Glm423Planner(bool layer_search = true) {
  auto config = LoadModelConfig(std::string(BGL_MODELS_DIR) + "/glm-423b-a30b.json");
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", config.status().message().c_str());
    std::exit(1);
  }
  PlannerOptions options;
  options.capacity_bytes = int64_t{64} * 1000 * 1000 * 1000;
  options.mitigation.layer_search = layer_search;
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

// Arg 0: Algorithm 2's greedy alone; arg 1: with the layer search behind it (the default).
void BM_PlanCacheMiss(benchmark::State& state) {
  auto planner = Glm423Planner(state.range(0) != 0);
  SchedulePoint point = SteadyPoint(*planner, 2.6);
  double overhead = 0;
  for (auto _ : state) {
    planner->ClearCaches();
    auto plan = planner->PlanPoint(point);
    benchmark::DoNotOptimize(plan);
    overhead = plan.ok() ? plan->overhead_s : -1;
  }
  state.counters["overhead_us"] = overhead * 1e6;
}
BENCHMARK(BM_PlanCacheMiss)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);

void BM_PlanCacheHit(benchmark::State& state) {
  auto planner = Glm423Planner(state.range(0) != 0);
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
BENCHMARK(BM_PlanCacheHit)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);

// Algorithm 2 alone on the GLM-423B-A30B chunk (two generated layers of 14 operators, too many
// to enumerate: the layer search combines greedy runs per layer) at load 2.6, the budget at
// range(1) percent of the way from M0 to keep-all. With the paper's copy engines every budget
// has a zero-overhead plan (so the layer search never runs); these copies run at a twentieth of
// that bandwidth, so plans have an overhead and the layer search runs. Arg 0 as above.
void BM_SelectMitigationGlm423SlowCopies(benchmark::State& state) {
  auto planner = Glm423Planner();
  const StageGraph& g = planner->graph();
  HardwareProfile hw = planner->hardware();
  hw.offload.peak_bytes_per_s /= 20;
  hw.reload.peak_bytes_per_s /= 20;
  const CostEvaluator eval(g, hw);
  MitigationOptions options;
  options.layer_search = state.range(0) != 0;
  const double r = 2.6;
  const double budget =
      g.M0(r) + static_cast<double>(state.range(1)) / 100.0 * (g.KeepAllBytes(r) - g.M0(r));
  double overhead = 0;
  for (auto _ : state) {
    auto selected = SelectMitigation(eval, r, budget, options);
    benchmark::DoNotOptimize(selected);
    overhead = selected.ok() ? selected->cost.exposed_s : -1;
  }
  state.counters["overhead_us"] = overhead * 1e6;
}
BENCHMARK(BM_SelectMitigationGlm423SlowCopies)
    ->ArgsProduct({{0, 1}, {5, 30, 60}})
    ->Unit(benchmark::kMicrosecond);

// Algorithm 2 alone (a plan-cache miss's mitigation search) on the 4-layer chunks of issue 23's
// real-sized instances (tests/unit/planner/real_instances.h: MoE blocks of 19 to 27 operators per
// layer, the captured HF graphs of 12 to 20, every budget family). Each iteration plans one
// instance in turn; p50/p99/max are over the instances' times. Args: 0 for the full search, 1
// for the anytime path's first answer (MitigationOptions::fast); the operator DP's labels per cut
// (dp_states; 512 is the default).
void BM_SelectMitigationRealSize4Layers(benchmark::State& state) {
  std::vector<testing::RealInstance> chunks;
  for (auto& x : testing::RealInstances(BGL_PLANNER_TEST_DATA, 2323, 120, 20)) {
    if (x.graph.layers == 4) chunks.push_back(std::move(x));
  }
  const HardwareProfile hw = *HardwareProfileByName("h200");
  MitigationOptions options;
  options.fast = state.range(0) != 0;
  options.dp_states = static_cast<int>(state.range(1));
  std::vector<double> times;
  size_t i = 0;
  for (auto _ : state) {
    const testing::RealInstance& x = chunks[i++ % chunks.size()];
    const CostEvaluator eval(x.graph, hw);
    const auto t0 = std::chrono::steady_clock::now();
    auto selected = SelectMitigation(eval, x.r, x.budget, options);
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    benchmark::DoNotOptimize(selected);
  }
  std::sort(times.begin(), times.end());
  auto at = [&](double q) {
    return times[std::min(times.size() - 1, static_cast<size_t>(q * times.size()))] * 1e6;
  };
  state.counters["chunks"] = static_cast<double>(chunks.size());
  state.counters["p50_us"] = at(0.5);
  state.counters["p99_us"] = at(0.99);
  state.counters["max_us"] = at(1.0);
}
BENCHMARK(BM_SelectMitigationRealSize4Layers)
    ->Args({0, 512})
    ->Args({0, 2048})
    ->Args({1, 512})
    ->Unit(benchmark::kMicrosecond);

// The same on issue 23's latency bar: production blocks of 32 operators per layer (MLA, RoPE,
// shared experts, TP, dropout, the router's auxiliary loss; real_instances.h), 4 layers per
// chunk, 40 chunks over every budget family. Args: 0 the full search (dp_states labels), 1 the
// anytime path's first answer (fast_dp_states labels).
void BM_SelectMitigationProduction4Layers(benchmark::State& state) {
  const std::vector<testing::RealInstance> chunks = testing::ProductionInstances(3232, 40, 4);
  const HardwareProfile hw = *HardwareProfileByName("h200");
  MitigationOptions options;
  options.fast = state.range(0) != 0;
  if (options.fast) {
    options.fast_dp_states = static_cast<int>(state.range(1));
  } else {
    options.dp_states = static_cast<int>(state.range(1));
  }
  // Wall time and the thread's CPU time per call: on a shared machine the wall time also counts
  // the other processes' time slices.
  std::vector<double> times, cpu_times;
  size_t i = 0;
  double unfit = 0, overhead = 0;
  for (auto _ : state) {
    const testing::RealInstance& x = chunks[i++ % chunks.size()];
    const CostEvaluator eval(x.graph, hw);
    const double c0 = ThreadCpuSeconds();
    const auto t0 = std::chrono::steady_clock::now();
    auto selected = SelectMitigation(eval, x.r, x.budget, options);
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    cpu_times.push_back(ThreadCpuSeconds() - c0);
    benchmark::DoNotOptimize(selected);
    if (!selected.ok() || !selected->fits || selected->cost.conflict) unfit += 1;
    if (selected.ok() && i <= chunks.size()) overhead += selected->cost.exposed_s;
  }
  auto at = [](std::vector<double>& v, double q) {
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))] * 1e6;
  };
  state.counters["chunks"] = static_cast<double>(chunks.size());
  state.counters["ops_per_layer"] = static_cast<double>(chunks[0].graph.ops.size()) / 4;
  state.counters["p50_us"] = at(times, 0.5);
  state.counters["p99_us"] = at(times, 0.99);
  state.counters["max_us"] = at(times, 1.0);
  state.counters["cpu_p50_us"] = at(cpu_times, 0.5);
  state.counters["cpu_p99_us"] = at(cpu_times, 0.99);
  state.counters["cpu_max_us"] = at(cpu_times, 1.0);
  state.counters["unfit"] = unfit;
  // The sum of the plans' exposed overhead over the chunks (once each): the answer's quality.
  state.counters["sum_overhead_us"] = overhead * 1e6;
}
// The full search once per chunk (40 iterations), the first answers over many rounds.
BENCHMARK(BM_SelectMitigationProduction4Layers)
    ->Args({0, 2048})
    ->Iterations(40)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_SelectMitigationProduction4Layers)
    ->Args({1, 24})
    ->Args({1, 12})
    ->Args({1, 8})
    ->Args({1, 4})
    ->Unit(benchmark::kMicrosecond);

// A whole plan-cache miss and hit (PlanPoint: the budget, the mitigation search, the dual-batch
// issue order) on a large chunk (tests/unit/planner/large_chunk.h: 126 operators, slow copies).
// Arg: anytime_min_ops (0: the full search on the call; 64: the first answer on the call, the
// full search on the refiner's thread).
std::unique_ptr<StagePlanner> LargeChunkPlanner(int anytime_min_ops) {
  auto config = testing::LargeChunkConfig();
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", config.status().message().c_str());
    std::exit(1);
  }
  auto planner = StagePlanner::Create(*config, testing::LargeChunkHardware(),
                                      testing::LargeChunkOptions(anytime_min_ops));
  if (!planner.ok()) {
    std::fprintf(stderr, "%s\n", planner.status().message().c_str());
    std::exit(1);
  }
  return std::move(*planner);
}

void PlanLargeChunk(benchmark::State& state, bool hit) {
  auto planner = LargeChunkPlanner(static_cast<int>(state.range(0)));
  const std::vector<SchedulePoint> points = testing::LargeChunkPoints(*planner);
  std::vector<double> times, cpu_times;
  size_t i = 0;
  int first_answers = 0, refined = 0;
  double point_s = 0;  // the longest point planned (its dual-batch makespan)
  if (hit) {
    for (const SchedulePoint& p : points) (void)planner->PlanPoint(p);
    planner->WaitForRefinements();
  }
  for (auto _ : state) {
    const SchedulePoint& p = points[i++ % points.size()];
    if (!hit) {
      state.PauseTiming();
      planner->ClearCaches();
      state.ResumeTiming();
    }
    const double c0 = ThreadCpuSeconds();
    const auto t0 = std::chrono::steady_clock::now();
    auto plan = planner->PlanPoint(p);
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    cpu_times.push_back(ThreadCpuSeconds() - c0);
    benchmark::DoNotOptimize(plan);
    if (plan.ok()) {
      first_answers += plan->first_answer ? 1 : 0;
      refined += plan->refined ? 1 : 0;
      point_s = std::max(point_s, plan->overlapped_s);
    }
  }
  auto at = [](std::vector<double>& v, double q) {
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))] * 1e6;
  };
  state.counters["ops"] = static_cast<double>(planner->graph().ops.size());
  state.counters["p50_us"] = at(times, 0.5);
  state.counters["p99_us"] = at(times, 0.99);
  state.counters["cpu_p50_us"] = at(cpu_times, 0.5);
  state.counters["cpu_p99_us"] = at(cpu_times, 0.99);
  state.counters["first_answers"] = first_answers;
  state.counters["refined"] = refined;
  state.counters["point_ms"] = point_s * 1e3;
}
void BM_PlanLargeChunkMiss(benchmark::State& state) { PlanLargeChunk(state, false); }
void BM_PlanLargeChunkHit(benchmark::State& state) { PlanLargeChunk(state, true); }
BENCHMARK(BM_PlanLargeChunkMiss)->Arg(0)->Iterations(40)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_PlanLargeChunkMiss)->Arg(64)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_PlanLargeChunkHit)->Arg(0)->Arg(64)->Unit(benchmark::kMicrosecond);

// Algorithm 2 alone on a small custom layer graph, where the layer search enumerates every
// assignment of a layer: two layers of a 7-operator chain (each saves its input; one tensor has
// two savers), budget halfway between M0 and keep-all. Arg as above.
void BM_SelectMitigationSmallLayers(benchmark::State& state) {
  StageGraph g;
  g.layers = 2;
  SavedTensor input;
  input.name = "input";
  input.bytes = 32 << 20;
  input.block_input = true;
  g.tensors.push_back(input);
  int block_input = 0;
  for (int l = 0; l < 2; ++l) {
    int last = block_input;
    for (int i = 0; i < 7; ++i) {
      Operator o;
      o.name = "L" + std::to_string(l) + ".op" + std::to_string(i);
      o.kind = OpKind::kLinear;
      o.layer = l;
      o.forward_s = 1e-4 * (1 + (i * 7) % 5);
      o.backward_s = 2 * o.forward_s;
      o.inputs = {last};
      o.saves = {last};
      if (i == 4) o.saves.push_back(last - 2);
      g.ops.push_back(o);
      SavedTensor t;
      t.name = o.name + ".out";
      t.bytes = i == 6 ? 32 << 20 : int64_t{1 << 20} * (16 + (i * 37) % 96);
      t.producer = static_cast<int>(g.ops.size()) - 1;
      t.block_input = i == 6 && l == 0;
      g.tensors.push_back(t);
      last = static_cast<int>(g.tensors.size()) - 1;
    }
    block_input = last;
  }
  if (!g.Finalize().ok()) std::exit(1);
  const HardwareProfile hw = *HardwareProfileByName("h200");
  CostEvaluator eval(g, hw);
  MitigationOptions options;
  options.layer_search = state.range(0) != 0;
  const double budget = 0.5 * (g.M0(1.0) + g.KeepAllBytes(1.0));
  double overhead = 0;
  for (auto _ : state) {
    auto selected = SelectMitigation(eval, 1.0, budget, options);
    benchmark::DoNotOptimize(selected);
    overhead = selected.ok() ? selected->cost.exposed_s : -1;
  }
  state.counters["overhead_us"] = overhead * 1e6;
}
BENCHMARK(BM_SelectMitigationSmallLayers)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);

// Every scheduling point of 1,000 iterations (64 micro-batch chunks each) planned and reported.
void BM_PlanPerIteration(benchmark::State& state) {
  constexpr int kIterations = 1000;
  double planning_s = 0;
  for (auto _ : state) {
    auto planner = Glm423Planner(state.range(0) != 0);
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
BENCHMARK(BM_PlanPerIteration)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->Iterations(1);

}  // namespace

BENCHMARK_MAIN();
