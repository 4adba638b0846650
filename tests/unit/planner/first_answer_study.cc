// Development study (issue 43): the anytime path's first answer on unseen multi-layer chunks
// against the full search and the exact reference. Not a test; prints one line per instance.
// Usage: planner_first_answer_study SEED COUNT [MAX_LABELS]  (quality; DUMP=<index> prints one
//        instance's strategies) or planner_first_answer_study latency [ROUNDS] (the first
//        answer's time, the DP alone and the priced candidates, side by side) or
//        planner_first_answer_study full (the full search with and without the priced bound) or
//        planner_first_answer_study miss [ROUNDS] (a whole PlanPoint miss, before and now) or
//        planner_first_answer_study gate [ROUNDS] (the revision after the gate) or
//        planner_first_answer_study warm [BOUND] [MICRO_BATCHES] (the warm-up's keys, CPU time
//        and coverage on the Table II models and the large-chunk stage).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "exact_reference.h"
#include "governor/planner/iteration.h"
#include "governor/planner/mitigation.h"
#include "governor/planner/planner.h"
#include "governor/planner/priced_greedy.h"
#include "real_instances.h"
#include "tests/unit/planner/large_chunk.h"

using namespace bgl::plan;

namespace {

double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// A whole PlanPoint miss on the anytime path (the budget, the first answer, the dual-batch issue
// order) on large_chunk.h's stage and 40 points (those of bench/plan_bench.cc's
// BM_PlanLargeChunkMiss), the first answer before issue 43 and now, alternating.
int Miss(int rounds) {
  auto config = testing::LargeChunkConfig();
  if (!config.ok()) return 1;
  const HardwareProfile hw = testing::LargeChunkHardware();
  std::unique_ptr<StagePlanner> planners[2];
  for (int v = 0; v < 2; ++v) {
    PlannerOptions options = testing::LargeChunkOptions(/*anytime_min_ops=*/64);
    options.mitigation.fast_priced = v == 1;
    auto planner = StagePlanner::Create(*config, hw, options);
    if (!planner.ok()) return 1;
    planners[v] = std::move(*planner);
  }
  const std::vector<SchedulePoint> points = testing::LargeChunkPoints(*planners[0]);
  std::vector<double> wall[2], cpu[2];
  double overhead[2] = {0, 0};
  int first[2] = {0, 0};
  for (int round = 0; round < rounds; ++round) {
    for (const SchedulePoint& p : points) {
      for (int v = 0; v < 2; ++v) {
        planners[v]->ClearCaches();
        const double c0 = ThreadCpuSeconds();
        const auto t0 = std::chrono::steady_clock::now();
        auto plan = planners[v]->PlanPoint(p);
        wall[v].push_back(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        cpu[v].push_back(ThreadCpuSeconds() - c0);
        if (round == 0 && plan.ok()) {
          overhead[v] += plan->overhead_s;
          first[v] += plan->first_answer ? 1 : 0;
        }
      }
    }
  }
  // The full search on the call (anytime off): what the refinements reach.
  auto full = StagePlanner::Create(*config, hw, testing::LargeChunkOptions(0));
  if (!full.ok()) return 1;
  double full_overhead = 0;
  for (const SchedulePoint& p : points) {
    auto plan = (*full)->PlanPoint(p);
    if (plan.ok()) full_overhead += plan->overhead_s;
  }
  auto at = [](std::vector<double>& v, double q) {
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))] * 1e6;
  };
  std::printf("the full search on the call: summed overhead of the 40 plans %.1f ms\n",
              full_overhead * 1e3);
  std::printf("PlanPoint miss, %zu ops, anytime on, %zu keys x %d rounds\n",
              planners[0]->graph().ops.size(), points.size(), rounds);
  for (int v = 0; v < 2; ++v) {
    std::printf(
        "%s: wall p50 %.0f p99 %.0f us; cpu p50 %.0f p99 %.0f us; summed overhead of the "
        "40 plans %.1f ms; first answers %d (the rest exact)\n",
        v == 0 ? "before (DP alone)" : "now (priced + DP)", at(wall[v], 0.5), at(wall[v], 0.99),
        at(cpu[v], 0.5), at(cpu[v], 0.99), overhead[v] * 1e3, first[v]);
  }
  return 0;
}

// FNV-1a over an assignment's strategies, continuing from `h`: the studies print it so that a
// change meant to keep every plan (issue 43: the downgrade's DP made cheaper) is checked by a diff.
uint64_t PlanHash(const Assignment& a, uint64_t h = 1469598103934665603ull) {
  for (Strategy s : a) {
    h ^= static_cast<uint64_t>(s) + 1;
    h *= 1099511628211ull;
  }
  return h;
}

// The revision after the gate (ReplanAfterGate): each production chunk planned at load 1 within
// its budget (the first answer), then 2.6 seen at the gate of layer 1.
int Gate(int rounds) {
  const HardwareProfile hw = *HardwareProfileByName("h200");
  std::vector<double> cpu;
  int revised = 0, planned_chunks = 0;
  double exposed = 0;
  uint64_t plans = PlanHash({});
  for (int round = 0; round < rounds; ++round) {
    for (const auto& x : testing::ProductionInstances(3232, 40, 4)) {
      const CostEvaluator eval(x.graph, hw);
      const double budget = std::max(x.budget, x.graph.M0(2.6));
      MitigationOptions o;
      o.fast = true;
      auto planned = SelectMitigation(eval, 1.0, budget, o);
      if (!planned.ok()) continue;
      ++planned_chunks;
      const double c0 = ThreadCpuSeconds();
      const MitigationResult m = ReplanAfterGate(eval, planned->assignment, 1, 2.6, budget);
      cpu.push_back(ThreadCpuSeconds() - c0);
      revised += m.assignment != planned->assignment ? 1 : 0;
      exposed += m.cost.exposed_s;
      plans = PlanHash(m.assignment, plans);
    }
  }
  std::sort(cpu.begin(), cpu.end());
  auto at = [&](double q) {
    return cpu[std::min(cpu.size() - 1, static_cast<size_t>(q * cpu.size()))] * 1e6;
  };
  std::printf(
      "ReplanAfterGate, 32 ops x 4 layers, gate of layer 1 at 2.6: cpu p50 %.0f p99 %.0f "
      "max %.0f us (%d of %d revised; their exposed overhead summed %.1f ms; plans %016llx)\n",
      at(0.5), at(0.99), at(1.0), revised, planned_chunks, exposed * 1e3,
      static_cast<unsigned long long>(plans));
  return 0;
}

// A miss with the warm-up on (the nearest plan's search: the cached full-search plans near the
// key costed at its load) against one without, on the large chunk (126 operators): micro-batch
// 0's forward at loads 1.0, 1.1, ..., 4.9 planned and refined first, then at 1.05, 1.15, ...
// (each a cold key between two cached ones); the caches cleared before each round.
int MissWarm(int rounds) {
  auto config = testing::LargeChunkConfig();
  if (!config.ok()) return 1;
  const HardwareProfile hw = testing::LargeChunkHardware();
  std::unique_ptr<StagePlanner> planners[2];
  for (int v = 0; v < 2; ++v) {
    PlannerOptions options = testing::LargeChunkOptions(/*anytime_min_ops=*/64);
    options.warm_up = v == 1;
    options.warm_spike_bound = 1.0;
    options.warm_max_keys = 1;  // the warm-up's own searches left out of the measure
    auto planner = StagePlanner::Create(*config, hw, options);
    if (!planner.ok()) return 1;
    planners[v] = std::move(*planner);
  }
  const std::vector<SchedulePoint> points = testing::LargeChunkPoints(*planners[0]);
  std::vector<double> cpu[2];
  int nearest = 0;
  for (int round = 0; round < rounds; ++round) {
    for (int v = 0; v < 2; ++v) {
      StagePlanner& p = *planners[v];
      p.ClearCaches();
      for (size_t i = 0; i < points.size(); ++i) {  // loads 1.0, 1.1, ..., 4.9: 40 keys
        SchedulePoint point = points[i];
        point.load_factor = 1.0 + 0.1 * static_cast<double>(i);
        (void)p.PlanPoint(point);
        p.ResetIteration();
      }
      p.WaitForRefinements();
      p.WaitForWarmup();
      for (size_t i = 0; i < points.size(); ++i) {  // 1.05, 1.15, ...: cold, beside two cached
        SchedulePoint point = points[i];
        point.load_factor = 1.05 + 0.1 * static_cast<double>(i);
        const double c0 = ThreadCpuSeconds();
        auto plan = p.PlanPoint(point);
        cpu[v].push_back(ThreadCpuSeconds() - c0);
        if (plan.ok() && plan->nearest) ++nearest;
        if (std::getenv("DEBUG_MISS") && plan.ok()) {
          std::printf("v%d r=%.2f budget %lld hit %d first %d nearest %d keep %d cpu %.0fus\n", v,
                      point.load_factor, static_cast<long long>(plan->budget_bytes),
                      plan->cache_hit ? 1 : 0, plan->first_answer ? 1 : 0, plan->nearest ? 1 : 0,
                      plan->predicted_bytes >= plan->keep_all_bytes ? 1 : 0, cpu[v].back() * 1e6);
        }
        p.ResetIteration();
      }
      p.WaitForRefinements();
    }
  }
  auto at = [](std::vector<double>& v, double q) {
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))] * 1e6;
  };
  for (int v = 0; v < 2; ++v) {
    std::printf(
        "PlanPoint miss beside a cached key, 126 ops, warm-up %s: cpu p50 %.0f p99 %.0f max "
        "%.0f us\n",
        v == 1 ? "on (the nearest plan)" : "off", at(cpu[v], 0.5), at(cpu[v], 0.99),
        at(cpu[v], 1.0));
  }
  std::printf("served the nearest plan: %d of %zu\n", nearest, cpu[1].size());
  return 0;
}

// The downgrade after the gate (issue 43 bar: within 1.5x of the optimum for the rest of the
// chunk at the observed load) on unseen generated MoE chunks of 1-4 layers: the full search's
// plan at load 1 (what a warm run serves), the gate of a random layer seeing a load of 1.3-2.6,
// the revision (ReplanAfterGate) against the exact reference's optimum at that load with the
// operators that ran (those before the gate's MoE block) pinned to their plan, and against the
// unpinned optimum (what planning the whole chunk at that load would have cost). Where the
// reference gives up (more than `max_labels` labels) the revision itself stands in for the
// pinned optimum and the instance is counted apart.
int GateReference(uint32_t seed, int count, int64_t max_labels) {
  const HardwareProfile hw = *HardwareProfileByName("h200");
  std::vector<double> ratios, warm_ratios, unpinned_ratios, cpu, warm_cpu;
  int fired = 0, proven = 0, unproven = 0, infeasible = 0, i = -1;
  for (const testing::GateInstance& x : testing::GateInstances(seed, count)) {
    ++i;
    const StageGraph& g = x.graph;
    const double observed = x.observed, budget = x.budget;
    const int gate = x.gate;
    const std::string& label = x.label;
    CostEvaluator eval(g, hw);
    auto planned = SelectMitigation(eval, 1.0, budget, MitigationOptions{});
    if (!planned.ok()) continue;
    const AssignmentCost at_observed = eval.Evaluate(planned->assignment, observed);
    if (!at_observed.conflict && at_observed.device_bytes <= budget) continue;  // still fits
    ++fired;
    double c0 = ThreadCpuSeconds();
    const MitigationResult revised =
        ReplanAfterGate(eval, planned->assignment, gate, observed, budget);
    cpu.push_back(ThreadCpuSeconds() - c0);
    reference::Options ro;
    ro.max_labels = max_labels;
    // ReplanAfterGate's operators that ran: before the gate's layer, and in it up to its first
    // MoE-block operator.
    ro.pinned.assign(g.ops.size(), -1);
    bool moe_seen = false;
    for (size_t o = 0; o < g.ops.size(); ++o) {
      const Operator& op = g.ops[o];
      moe_seen |= op.layer == gate && IsMoeBlock(op.kind);
      if (op.layer < gate || (op.layer == gate && !moe_seen)) {
        ro.pinned[o] = static_cast<int>(planned->assignment[o]);
      }
    }
    const reference::Optimum opt = reference::Solve(
        g, hw, observed, budget, ro, revised.fits ? revised.assignment : Assignment{});
    reference::Options free = ro;
    free.pinned.clear();
    auto full = SelectMitigation(eval, observed, budget, MitigationOptions{});
    // With the warm-up (PlanAfterGate): the warm plan of the observed load is an alternative.
    std::vector<Assignment> warm;
    if (full.ok()) warm.push_back(full->assignment);
    c0 = ThreadCpuSeconds();
    const MitigationResult with_warm = ReplanAfterGate(eval, planned->assignment, gate, observed,
                                                       budget, -1, MitigationOptions{}, &warm);
    warm_cpu.push_back(ThreadCpuSeconds() - c0);
    const reference::Optimum unpinned = reference::Solve(
        g, hw, observed, budget, free, full.ok() ? full->assignment : Assignment{});
    if (!opt.proven) {
      ++unproven;
    } else if (!opt.feasible) {
      ++infeasible;  // what ran already holds too much: no completion fits
    } else {
      ++proven;
    }
    const double ratio = (revised.cost.exposed_s + 1e-5) / (opt.exposed_s + 1e-5);
    const double warm_ratio = (with_warm.cost.exposed_s + 1e-5) / (opt.exposed_s + 1e-5);
    if (opt.proven && opt.feasible) {
      ratios.push_back(ratio);
      warm_ratios.push_back(warm_ratio);
    }
    if (unpinned.proven) {
      unpinned_ratios.push_back((revised.cost.exposed_s + 1e-5) / (unpinned.exposed_s + 1e-5));
    }
    std::printf(
        "%8.3f (warm %8.3f) %s revised %.1fus pinned optimum %.1fus unpinned %s%.1fus fits=%d "
        "cpu %.0f/%.0fus plan %016llx/%016llx %s\n",
        ratio, warm_ratio, opt.proven ? (opt.feasible ? "proven" : "infeasible") : "unprov",
        revised.cost.exposed_s * 1e6, opt.exposed_s * 1e6, unpinned.proven ? "" : "(unproven) ",
        unpinned.exposed_s * 1e6, revised.fits ? 1 : 0, cpu.back() * 1e6, warm_cpu.back() * 1e6,
        static_cast<unsigned long long>(PlanHash(revised.assignment)),
        static_cast<unsigned long long>(PlanHash(with_warm.assignment)), label.c_str());
    if (std::getenv("DUMP") && std::atoi(std::getenv("DUMP")) == i) {
      for (size_t o = 0; o < g.ops.size(); ++o) {
        double bytes = 0;
        for (int t : g.ops[o].saves) bytes += g.tensors[t].Bytes(observed);
        std::printf(
            "  %-28s L%d f=%7.1fus saves=%8.3fMiB pin=%d planned=%-9s revised=%-9s opt=%s\n",
            g.ops[o].name.c_str(), g.ops[o].layer, g.ops[o].ForwardTime(observed) * 1e6,
            bytes / (1 << 20), ro.pinned[o] >= 0 ? 1 : 0, StrategyName(planned->assignment[o]),
            StrategyName(revised.assignment[o]),
            opt.proven && opt.feasible ? StrategyName(opt.assignment[o]) : "-");
      }
      const AssignmentCost c = revised.cost;
      std::printf("  F=%.1fus B=%.1fus budget-M0=%.3fMiB rec %.1f fp8 %.1f d2h %.1f h2d %.1f\n",
                  g.ForwardTime(observed) * 1e6, g.BackwardTime(observed) * 1e6,
                  (budget - g.M0(observed)) / (1 << 20), c.recompute_s * 1e6, c.fp8_s * 1e6,
                  c.d2h_s * 1e6, c.h2d_s * 1e6);
    }
    std::fflush(stdout);
  }
  auto at = [](std::vector<double> v, double q) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))];
  };
  std::printf("downgrades: %d unproven, %d with no completion that fits\n", unproven, infeasible);
  std::printf(
      "the downgrade's CPU time (ReplanAfterGate): alone p50 %.0f p99 %.0f max %.0f us; with the "
      "warm plan p50 %.0f p99 %.0f max %.0f us\n",
      at(cpu, 0.5) * 1e6, at(cpu, 0.99) * 1e6, at(cpu, 1.0) * 1e6, at(warm_cpu, 0.5) * 1e6,
      at(warm_cpu, 0.99) * 1e6, at(warm_cpu, 1.0) * 1e6);
  std::printf("with the warm plan of the observed load: median %.3f p90 %.3f max %.3f\n",
              at(warm_ratios, 0.5), at(warm_ratios, 0.9), at(warm_ratios, 1.0));
  std::printf(
      "downgrades: %d fired of %d chunks, %d pinned optima proven; against the pinned optimum "
      "median %.3f p90 %.3f max %.3f; against the unpinned one (%zu proven) median %.3f p90 "
      "%.3f max %.3f\n",
      fired, count, proven, at(ratios, 0.5), at(ratios, 0.9), at(ratios, 1.0),
      unpinned_ratios.size(), at(unpinned_ratios, 0.5), at(unpinned_ratios, 0.9),
      at(unpinned_ratios, 1.0));
  return 0;
}

// The full search (a refinement) with and without the priced candidates as a bound.
void FullSearch(const std::vector<testing::RealInstance>& chunks) {
  const HardwareProfile hw = *HardwareProfileByName("h200");
  std::vector<double> cpu[2];
  double overhead[2] = {0, 0};
  for (const auto& x : chunks) {
    const CostEvaluator eval(x.graph, hw);
    for (int v = 0; v < 2; ++v) {
      MitigationOptions o;
      o.priced_bound = v == 1;
      const double c0 = ThreadCpuSeconds();
      auto selected = SelectMitigation(eval, x.r, x.budget, o);
      cpu[v].push_back(ThreadCpuSeconds() - c0);
      if (selected.ok()) overhead[v] += selected->cost.exposed_s;
    }
  }
  auto at = [](std::vector<double>& v, double q) {
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))] * 1e3;
  };
  for (int v = 0; v < 2; ++v) {
    std::printf("full search %s: cpu p50 %.1f p99 %.1f max %.1f ms; summed overhead %.1f ms\n",
                v == 0 ? "without the priced bound" : "with the priced bound   ", at(cpu[v], 0.5),
                at(cpu[v], 0.99), at(cpu[v], 1.0), overhead[v] * 1e3);
  }
}

// The first answer's latency, old (the DP alone) and new, interleaved on the same chunks.
int Latency(const std::vector<testing::RealInstance>& chunks, int rounds) {
  const HardwareProfile hw = *HardwareProfileByName("h200");
  std::vector<double> wall[2], cpu[2], priced_cpu;
  double overhead[2] = {0, 0};
  for (int round = 0; round < rounds; ++round) {
    for (const auto& x : chunks) {
      const CostEvaluator eval(x.graph, hw);
      for (int v = 0; v < 2; ++v) {
        MitigationOptions o;
        o.fast = true;
        o.fast_priced = v == 1;
        const double c0 = ThreadCpuSeconds();
        const auto t0 = std::chrono::steady_clock::now();
        auto selected = SelectMitigation(eval, x.r, x.budget, o);
        wall[v].push_back(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        cpu[v].push_back(ThreadCpuSeconds() - c0);
        if (round == 0 && selected.ok()) overhead[v] += selected->cost.exposed_s;
      }
      MitigationOptions o;
      const double c0 = ThreadCpuSeconds();
      auto priced = PricedGreedy(eval, x.r, x.budget, o);
      priced_cpu.push_back(ThreadCpuSeconds() - c0);
    }
  }
  auto at = [](std::vector<double>& v, double q) {
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))] * 1e6;
  };
  for (int v = 0; v < 2; ++v) {
    std::printf(
        "%s: wall p50 %.0f p99 %.0f max %.0f us; cpu p50 %.0f p99 %.0f max %.0f us; "
        "summed overhead %.1f ms over %zu chunks\n",
        v == 0 ? "old (DP alone)   " : "new (priced + DP)", at(wall[v], 0.5), at(wall[v], 0.99),
        at(wall[v], 1.0), at(cpu[v], 0.5), at(cpu[v], 0.99), at(cpu[v], 1.0), overhead[v] * 1e3,
        chunks.size());
  }
  std::printf("the priced candidates alone: cpu p50 %.0f p99 %.0f us\n", at(priced_cpu, 0.5),
              at(priced_cpu, 0.99));
  return 0;
}

}  // namespace

// The warm-up (issue 43 item 1) on one stage: its keys, the worker's CPU time (total, per chunk,
// per key), the wall time to complete on this machine, and its coverage: iterations at load 1 and
// with micro-batch 0, the middle one and the last spiked to 1.3, 2.0 and 2.6, counting the
// forwards that mitigate and those a warm-up plan served (the rest miss: the full search or the
// first answer on the call).
void WarmStage(const std::string& name, const ModelConfig& config, const HardwareProfile& hw,
               PlannerOptions options, double bound) {
  options.warm_up = true;
  options.warm_spike_bound = bound;
  auto made = StagePlanner::Create(config, hw, options);
  if (!made.ok()) {
    std::printf("%-26s %s\n", name.c_str(), made.status().message().c_str());
    return;
  }
  StagePlanner& p = **made;
  const auto t0 = std::chrono::steady_clock::now();
  if (!p.StartWarmup().ok()) return;
  p.WaitForWarmup();
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const PlannerCacheStats s = p.cache_stats();
  const int mbs = static_cast<int>(config.MicroBatches());
  int mitigated = 0, warm = 0;
  for (int spiked : {-1, 0, mbs / 2, mbs - 1}) {
    for (double spike : {1.3, 2.0, 2.6}) {
      if (spiked < 0 && spike != 1.3) continue;
      std::vector<double> loads(static_cast<size_t>(mbs), 1.0);
      if (spiked >= 0) loads[static_cast<size_t>(spiked)] = spike;
      auto replay = ReplayIteration(p, loads);
      if (!replay.ok()) continue;
      for (const Plan& plan : replay->plans) {
        if (plan.micro_batch < 0 || plan.predicted_bytes >= plan.keep_all_bytes) continue;
        ++mitigated;
        warm += plan.warm ? 1 : 0;
      }
    }
  }
  const double chunks = static_cast<double>(config.Chunks());
  std::printf(
      "%-26s %4zu ops/chunk %3.0f chunk(s) %3d mb: keys %5llu found %5llu warmed (%llu rounds), "
      "CPU %.2f s (%.2f s/chunk, %.1f ms/key), wall %.2f s; forwards that mitigate %d, warm %d "
      "(%.0f%%)\n",
      name.c_str(), p.graph().ops.size(), chunks, mbs,
      static_cast<unsigned long long>(s.warm_enumerated),
      static_cast<unsigned long long>(s.warm_submitted),
      static_cast<unsigned long long>(s.warm_rounds), s.warm_cpu_s, s.warm_cpu_s / chunks,
      s.warm_submitted ? 1e3 * s.warm_cpu_s / static_cast<double>(s.warm_submitted) : 0.0, wall,
      mitigated, warm, mitigated ? 100.0 * warm / mitigated : 0.0);
  std::fflush(stdout);
}

int Warm(double bound, int micro_batches) {
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(BGL_MODELS_DIR)) {
    const std::string f = e.path().filename().string();
    if (f.rfind("glm-", 0) == 0 && e.path().extension() == ".json") files.push_back(f);
  }
  std::sort(files.begin(), files.end());
  std::printf(
      "warm-up to load %.2f; Table II models at %d micro-batches on their profile's "
      "memory, then the large-chunk stage (large_chunk.h)\n",
      bound, micro_batches);
  for (const std::string& f : files) {
    auto doc = LoadJsonOrYaml(std::string(BGL_MODELS_DIR) + "/" + f, "model");
    if (!doc.ok()) return 1;
    if (micro_batches > 0) (*doc)["micro_batches"] = micro_batches;
    auto config = ModelConfigFromJson(*doc, f);
    if (!config.ok()) return 1;
    auto hw = HardwareProfileByName(config->gpu);
    if (!hw.ok()) return 1;
    WarmStage(f, *config, *hw, PlannerOptions{}, bound);
  }
  auto config = testing::LargeChunkConfig();
  if (!config.ok()) return 1;
  WarmStage("large chunk (126 ops)", *config, testing::LargeChunkHardware(),
            testing::LargeChunkOptions(64), bound);
  return 0;
}

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "warm") {
    return Warm(argc > 2 ? std::atof(argv[2]) : 3.0, argc > 3 ? std::atoi(argv[3]) : 0);
  }
  if (argc > 1 && std::string(argv[1]) == "miss") return Miss(argc > 2 ? std::atoi(argv[2]) : 5);
  if (argc > 1 && std::string(argv[1]) == "gate") return Gate(argc > 2 ? std::atoi(argv[2]) : 5);
  if (argc > 1 && std::string(argv[1]) == "miss-warm") {
    return MissWarm(argc > 2 ? std::atoi(argv[2]) : 3);
  }
  if (argc > 1 && std::string(argv[1]) == "gate-reference") {
    return GateReference(argc > 2 ? static_cast<uint32_t>(std::atoi(argv[2])) : 4343,
                         argc > 3 ? std::atoi(argv[3]) : 100,
                         argc > 4 ? std::atoll(argv[4]) : 300000);
  }
  if (argc > 1 && std::string(argv[1]) == "full") {
    std::printf("production blocks, 32 ops x 4 layers (ProductionInstances 3232, 40 chunks)\n");
    FullSearch(testing::ProductionInstances(3232, 40, 4));
    std::vector<testing::RealInstance> four;
    for (auto& x : testing::RealInstances(BGL_PLANNER_TEST_DATA, 2323, 120, 20)) {
      if (x.graph.layers == 4) four.push_back(std::move(x));
    }
    std::printf("real-sized 4-layer chunks (RealInstances 2323)\n");
    FullSearch(four);
    return 0;
  }
  if (argc > 1 && std::string(argv[1]) == "latency") {
    const int rounds = argc > 2 ? std::atoi(argv[2]) : 20;
    std::printf("production blocks, 32 ops x 4 layers (ProductionInstances 3232, 40 chunks)\n");
    Latency(testing::ProductionInstances(3232, 40, 4), rounds);
    std::vector<testing::RealInstance> four;
    for (auto& x : testing::RealInstances(BGL_PLANNER_TEST_DATA, 2323, 120, 20)) {
      if (x.graph.layers == 4) four.push_back(std::move(x));
    }
    std::printf("real-sized 4-layer chunks (RealInstances 2323)\n");
    return Latency(four, rounds);
  }
  const uint32_t seed = argc > 1 ? static_cast<uint32_t>(std::atoi(argv[1])) : 4343;
  const int count = argc > 2 ? std::atoi(argv[2]) : 40;
  const int64_t max_labels = argc > 3 ? std::atoll(argv[3]) : 300000;
  std::mt19937 rng(seed);
  const HardwareProfile hw = *HardwareProfileByName("h200");
  constexpr double kLoads[] = {1.0, 1.3, 1.6, 2.0, 2.3, 2.6};
  std::vector<double> ratios_fast, ratios_full, ratios_old;
  for (int i = 0; i < count; ++i) {
    const int layers = std::uniform_int_distribution<int>(2, 4)(rng);
    testing::MoeBlockBuilder builder(rng, hw);
    std::string shape;
    StageGraph g = builder.Build(layers, shape);
    const double r = kLoads[std::uniform_int_distribution<int>(0, 5)(rng)];
    std::string label = "#" + std::to_string(i) + " " + shape + " (" +
                        std::to_string(builder.ops_per_layer()) +
                        " ops/layer) r=" + std::to_string(r);
    const double budget = testing::DrawBudget(rng, g, r, i % 5, label);
    CostEvaluator eval(g, hw);
    MitigationOptions fast;
    fast.fast = true;
    const auto t0 = std::chrono::steady_clock::now();
    auto quick = SelectMitigation(eval, r, budget, fast);
    const double quick_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    MitigationOptions old_fast = fast;
    old_fast.fast_priced = false;
    const auto t1 = std::chrono::steady_clock::now();
    auto old = SelectMitigation(eval, r, budget, old_fast);
    const double old_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
    auto full = SelectMitigation(eval, r, budget, MitigationOptions{});
    if (!quick.ok() || !full.ok() || !old.ok()) {
      std::printf("error %s\n", label.c_str());
      continue;
    }
    reference::Options ro;
    ro.max_labels = max_labels;
    const reference::Optimum opt = reference::Solve(g, hw, r, budget, ro, full->assignment);
    const double best =
        opt.proven ? opt.exposed_s : std::min(full->cost.exposed_s, quick->cost.exposed_s);
    const double rf = (quick->cost.exposed_s + 1e-5) / (best + 1e-5);
    const double rs = (full->cost.exposed_s + 1e-5) / (best + 1e-5);
    const double ro_ = (old->cost.exposed_s + 1e-5) / (best + 1e-5);
    ratios_old.push_back(ro_);
    ratios_fast.push_back(rf);
    ratios_full.push_back(rs);
    std::printf("old %8.3f %.0fus new ", ro_, old_s * 1e6);
    std::printf("%8.3f %6.3f %s %.0fus first %.1fus full %.1fus best %.1fus fits=%d %s\n", rf, rs,
                opt.proven ? "proven" : "unprov", quick_s * 1e6, quick->cost.exposed_s * 1e6,
                full->cost.exposed_s * 1e6, best * 1e6, quick->fits ? 1 : 0, label.c_str());
    if (std::getenv("DUMP") && std::atoi(std::getenv("DUMP")) == i) {
      for (size_t o = 0; o < g.ops.size(); ++o) {
        double bytes = 0;
        for (int t : g.ops[o].saves) bytes += g.tensors[t].Bytes(r);
        std::printf("  %-28s f=%7.1fus saves=%8.1fMiB first=%-9s full=%-9s opt=%s\n",
                    g.ops[o].name.c_str(), g.ops[o].ForwardTime(r) * 1e6, bytes / (1 << 20),
                    StrategyName(quick->assignment[o]), StrategyName(full->assignment[o]),
                    opt.proven ? StrategyName(opt.assignment[o]) : "-");
      }
      const AssignmentCost a = quick->cost, b = full->cost;
      std::printf("  F=%.1fus B=%.1fus budget-M0=%.1fMiB keep-M0=%.1fMiB\n", g.ForwardTime(r) * 1e6,
                  g.BackwardTime(r) * 1e6, (budget - g.M0(r)) / (1 << 20),
                  (g.KeepAllBytes(r) - g.M0(r)) / (1 << 20));
      std::printf("  first: dev %.1fMiB rec %.1f fp8 %.1f d2h %.1f h2d %.1f\n",
                  (a.device_bytes - g.M0(r)) / (1 << 20), a.recompute_s * 1e6, a.fp8_s * 1e6,
                  a.d2h_s * 1e6, a.h2d_s * 1e6);
      std::printf("  full:  dev %.1fMiB rec %.1f fp8 %.1f d2h %.1f h2d %.1f\n",
                  (b.device_bytes - g.M0(r)) / (1 << 20), b.recompute_s * 1e6, b.fp8_s * 1e6,
                  b.d2h_s * 1e6, b.h2d_s * 1e6);
    }
    std::fflush(stdout);
  }
  auto at = [](std::vector<double> v, double q) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))];
  };
  std::printf("old first: median %.3f p90 %.3f max %.3f\n", at(ratios_old, 0.5),
              at(ratios_old, 0.9), at(ratios_old, 1.0));
  std::printf("first: median %.3f p90 %.3f max %.3f; full: median %.3f p90 %.3f max %.3f\n",
              at(ratios_fast, 0.5), at(ratios_fast, 0.9), at(ratios_fast, 1.0),
              at(ratios_full, 0.5), at(ratios_full, 0.9), at(ratios_full, 1.0));
  return 0;
}
