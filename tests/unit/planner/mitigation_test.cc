#include "governor/planner/mitigation.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>

#include "test_graphs.h"

namespace bgl::plan {
namespace {

constexpr Strategy kAll[] = {Strategy::kKeep, Strategy::kRecompute, Strategy::kOffload,
                             Strategy::kFp8};

// Exhaustive search over every assignment: the cheapest conflict-free one within budget.
struct Optimum {
  bool feasible = false;
  double exposed_s = std::numeric_limits<double>::infinity();
};

Optimum Exhaustive(const CostEvaluator& eval, double r, double budget, double host_limit = -1) {
  const size_t n = eval.graph().ops.size();
  Optimum best;
  Assignment a(n, Strategy::kKeep);
  size_t combos = 1;
  for (size_t i = 0; i < n; ++i) combos *= 4;
  for (size_t code = 0; code < combos; ++code) {
    size_t rest = code;
    bool allowed = true;
    for (size_t o = 0; o < n; ++o) {
      a[o] = kAll[rest % 4];
      rest /= 4;
      allowed &= eval.Allowed(static_cast<int>(o), a[o]);
    }
    if (!allowed) continue;
    const AssignmentCost c = eval.Evaluate(a, r);
    if (c.conflict || c.device_bytes > budget) continue;
    if (host_limit >= 0 && c.host_bytes > host_limit) continue;
    best.feasible = true;
    best.exposed_s = std::min(best.exposed_s, c.exposed_s);
  }
  return best;
}

// How far a selection's overhead is from the exhaustive optimum, over a set of instances. The
// ratio of one instance is (selected + 10 us) / (optimum + 10 us): the 10 us floor (two kernel
// launches) keeps a zero-overhead optimum from turning a few microseconds into an infinite
// ratio, and a ratio of R means the selection costs R - 1 times (optimum + 10 us) more.
struct RatioStats {
  int instances = 0;
  int optimal = 0;
  int zero_optimum = 0;
  int fallbacks = 0;
  double median = 0, p90 = 0, worst = 0;
  std::string worst_case;
};

constexpr double kRatioFloor = 10e-6;

class RatioCollector {
 public:
  // Checks the selection's properties against the optimum and records the ratio.
  void Add(const StageGraph& g, const CostEvaluator& eval, double r, double budget,
           const std::string& label, const MitigationOptions& options = {}) {
    const Optimum opt = Exhaustive(eval, r, budget, options.host_limit_bytes);
    auto selected = SelectMitigation(eval, r, budget, options);
    ASSERT_TRUE(selected.ok()) << selected.status().message();
    // A feasible assignment always exists (full recompute meets any budget >= M0) ...
    ASSERT_TRUE(opt.feasible) << label;
    // ... so the selection never exceeds the budget and never returns a conflict.
    EXPECT_TRUE(selected->fits) << label;
    EXPECT_LE(selected->cost.device_bytes, budget) << label;
    EXPECT_FALSE(selected->cost.conflict) << label;
    EXPECT_TRUE(options.HostFits(selected->cost.host_bytes))
        << label << ": host " << selected->cost.host_bytes << " over " << options.host_limit_bytes;
    EXPECT_GE(selected->cost.exposed_s, opt.exposed_s - 1e-12) << label;
    if (options.layer_search) {
      // The greedy is the bound: the layer search never makes an answer worse.
      MitigationOptions greedy_only = options;
      greedy_only.layer_search = false;
      greedy_only.priced_bound = false;
      auto greedy = SelectMitigation(eval, r, budget, greedy_only);
      ASSERT_TRUE(greedy.ok());
      EXPECT_LE(selected->cost.exposed_s, greedy->cost.exposed_s + 1e-12) << label;
      greedy_ratios_.push_back((greedy->cost.exposed_s + kRatioFloor) /
                               (opt.exposed_s + kRatioFloor));
    }
    stats_.fallbacks += selected->fallback_full_recompute ? 1 : 0;
    stats_.zero_optimum += opt.exposed_s <= 1e-12 ? 1 : 0;
    const double ratio = (selected->cost.exposed_s + kRatioFloor) / (opt.exposed_s + kRatioFloor);
    ratios_.push_back(ratio);
    if (ratio > stats_.worst) {
      stats_.worst = ratio;
      stats_.worst_case = label;
    }
    if (getenv("BGL_DEBUG") && ratio > 1.5) {
      std::printf("ratio %.2f selected %.6f opt %.6f budget %.0f m0 %.0f keep %.0f  %s\n", ratio,
                  selected->cost.exposed_s, opt.exposed_s, budget, g.M0(r), g.KeepAllBytes(r),
                  label.c_str());
      for (size_t o = 0; o < g.ops.size(); ++o) {
        std::printf("  %s %s fwd %.6f saves %zu\n", g.ops[o].name.c_str(),
                    StrategyName(selected->assignment[o]), g.ops[o].ForwardTime(r),
                    g.ops[o].saves.size());
      }
      std::printf("  d2h %.6f h2d %.6f rec %.6f fp8 %.6f F %.6f\n", selected->cost.d2h_s,
                  selected->cost.h2d_s, selected->cost.recompute_s, selected->cost.fp8_s,
                  g.ForwardTime(r));
    }
  }

  RatioStats Finish(const char* what) {
    std::sort(ratios_.begin(), ratios_.end());
    stats_.instances = static_cast<int>(ratios_.size());
    stats_.median = ratios_[ratios_.size() / 2];
    stats_.p90 = ratios_[ratios_.size() * 9 / 10];
    stats_.optimal = static_cast<int>(
        std::count_if(ratios_.begin(), ratios_.end(), [](double x) { return x <= 1.0 + 1e-9; }));
    std::printf(
        "%s vs exhaustive over %d instances: median overhead ratio %.3f, p90 %.3f, worst %.3f, "
        "optimal in %d, zero-overhead optimum in %d, fallbacks %d; worst: %s\n",
        what, stats_.instances, stats_.median, stats_.p90, stats_.worst, stats_.optimal,
        stats_.zero_optimum, stats_.fallbacks, stats_.worst_case.c_str());
    if (!greedy_ratios_.empty()) {
      // The same instances under the greedy alone: the figures before the layer search.
      std::sort(greedy_ratios_.begin(), greedy_ratios_.end());
      std::printf("  the greedy alone on them: median %.3f, p90 %.3f, worst %.3f, optimal in %ld\n",
                  greedy_ratios_[greedy_ratios_.size() / 2],
                  greedy_ratios_[greedy_ratios_.size() * 9 / 10], greedy_ratios_.back(),
                  static_cast<long>(std::count_if(greedy_ratios_.begin(), greedy_ratios_.end(),
                                                  [](double x) { return x <= 1.0 + 1e-9; })));
    }
    return stats_;
  }

 private:
  std::vector<double> ratios_;
  std::vector<double> greedy_ratios_;
  RatioStats stats_;
};

// The bounds of issue 12 item 11 on the ratio defined above.
constexpr double kWorstBound = 10.0;
constexpr double kP90Bound = 1.5;

// 240 random single-layer stages of 3 to 7 operators (test_graphs.h).
// A host limit for one instance (issue 14): negative keeps `options`' own.
using HostLimitFn = double (*)(const StageGraph& g, double r, std::mt19937& rng);

RatioStats RandomStages(const MitigationOptions& options, const char* what,
                        HostLimitFn host_limit = nullptr) {
  std::mt19937 rng(20261129);
  HardwareProfile hw = *HardwareProfileByName("h200");
  RatioCollector collector;
  for (int instance = 0; instance < 240; ++instance) {
    std::uniform_int_distribution<int> size(3, 7);
    StageGraph g = testing::RandomGraph(rng, size(rng));
    CostEvaluator eval(g, hw);
    std::uniform_real_distribution<double> load(0.8, 2.6);
    const double r = load(rng);
    std::uniform_real_distribution<double> where(0.0, 1.0);
    const double budget = g.M0(r) + where(rng) * (g.KeepAllBytes(r) - g.M0(r));
    MitigationOptions o = options;
    if (host_limit) o.host_limit_bytes = host_limit(g, r, rng);
    collector.Add(g, eval, r, budget, "random #" + std::to_string(instance), o);
  }
  return collector.Finish(what);
}

// Seeded edge cases (testing::RandomEdgeCase): budgets near M0 or exact fits, zero-cost
// operators, tiny stages, ties, one to four layers of at most 8 operators in all.
RatioStats EdgeCases(const MitigationOptions& options, const char* what,
                     HostLimitFn host_limit = nullptr) {
  std::mt19937 rng(20261130);
  HardwareProfile hw = *HardwareProfileByName("h200");
  RatioCollector collector;
  for (int instance = 0; instance < 1000; ++instance) {
    testing::EdgeCase e = testing::RandomEdgeCase(rng);
    CostEvaluator eval(e.graph, hw);
    MitigationOptions o = options;
    if (host_limit) o.host_limit_bytes = host_limit(e.graph, e.r, rng);
    collector.Add(e.graph, eval, e.r, e.budget,
                  "edge #" + std::to_string(instance) + " (" + e.families + ")", o);
  }
  return collector.Finish(what);
}

void Record(const RatioStats& stats) {
  ::testing::Test::RecordProperty("median_ratio", std::to_string(stats.median));
  ::testing::Test::RecordProperty("p90_ratio", std::to_string(stats.p90));
  ::testing::Test::RecordProperty("worst_ratio", std::to_string(stats.worst));
}

TEST(SelectMitigation, AgainstExhaustiveSearch) {
  const RatioStats stats = RandomStages({}, "random stages");
  Record(stats);
  EXPECT_LE(stats.p90, kP90Bound);
  EXPECT_LE(stats.worst, kWorstBound) << stats.worst_case;
}

// Issue 12 item 11. The greedy alone reaches 56.5x here (182x to 475x on 3,000 instances of
// other seeds).
TEST(SelectMitigation, EdgeCasesAgainstExhaustiveSearch) {
  const RatioStats stats = EdgeCases({}, "edge cases");
  Record(stats);
  EXPECT_LE(stats.p90, kP90Bound);
  EXPECT_LE(stats.worst, kWorstBound) << stats.worst_case;
}

// The test graphs are small enough for the layer search to enumerate every layer, which makes it
// exact there. Production layers (12 movable operators) are not: they get the assignments of
// greedy runs on the layer alone. This forces that path on the same instances. Across layers the
// DP still spreads mitigations, so the edge cases meet the bounds; within one layer it is only
// as good as those greedy runs, so single-layer random stages are held to the greedy's answer
// (checked per instance in RatioCollector::Add) and their figures printed.
TEST(SelectMitigation, AgainstExhaustiveSearchWithoutEnumeration) {
  MitigationOptions options;
  options.exact_layer_assignments = 0;
  (void)RandomStages(options, "random stages, no enumeration");
  const RatioStats edge = EdgeCases(options, "edge cases, no enumeration");
  EXPECT_LE(edge.p90, kP90Bound);
  EXPECT_LE(edge.worst, kWorstBound) << edge.worst_case;
}

// Host limits (issue 14): a limit of 0 (no offload at all), one near a small grant's floor (the
// smallest saved tensor: at most one small offload), and a random share of what keep-all holds.
// The exhaustive optimum is taken among assignments within the limit; the selection must stay
// within it and meet the same bounds.
double NoHost(const StageGraph&, double, std::mt19937&) { return 0; }
double NearFloor(const StageGraph& g, double r, std::mt19937&) {
  double least = g.KeepAllBytes(r);
  for (const SavedTensor& t : g.tensors) {
    if (!t.block_input && !t.savers.empty() && t.Bytes(r) > 0) least = std::min(least, t.Bytes(r));
  }
  return least * 1.01;
}
double RandomHost(const StageGraph& g, double r, std::mt19937& rng) {
  return std::uniform_real_distribution<double>(0.0, 0.6)(rng) * g.KeepAllBytes(r);
}

TEST(SelectMitigation, HostLimitsAgainstExhaustiveSearch) {
  for (HostLimitFn fn : {&NoHost, &NearFloor, &RandomHost}) {
    const char* what = fn == &NoHost      ? "host limit 0"
                       : fn == &NearFloor ? "host limit near floor"
                                          : "random host limit";
    const RatioStats random = RandomStages({}, what, fn);
    EXPECT_LE(random.p90, kP90Bound) << what;
    EXPECT_LE(random.worst, kWorstBound) << what << ": " << random.worst_case;
    const RatioStats edge = EdgeCases({}, what, fn);
    EXPECT_LE(edge.p90, kP90Bound) << what;
    EXPECT_LE(edge.worst, kWorstBound) << what << ": " << edge.worst_case;
  }
}

// Issue 22: where copies hide under compute an offload costs nothing, so an answer offloading
// everything hideable ties with one offloading only what the budget needs; it moved several times
// the bytes (the anytime path's first answer planned M0 at budgets of 13-41 MB on Qwen3-MoE). Of
// the tied answers the selection returns one from which no mitigated operator, alone or with the
// operators sharing its tensors, can go back to keep within the budget at the same overhead; the
// full path stays optimal against the exhaustive search.
TEST(SelectMitigation, HiddenCopiesMoveNoMoreThanTheBudgetNeeds) {
  std::mt19937 rng(22);
  HardwareProfile hw = *HardwareProfileByName("h200");
  hw.offload.peak_bytes_per_s *= 1000;
  hw.reload.peak_bytes_per_s *= 1000;
  int instances = 0, offloading = 0;
  for (int i = 0; i < 300; ++i) {
    const StageGraph g = testing::RandomGraph(rng, 3 + i % 5);
    const CostEvaluator eval(g, hw);
    const double m0 = g.M0(1), keep_all = g.KeepAllBytes(1);
    if (keep_all <= m0) continue;
    const double budget = std::uniform_real_distribution<double>(m0, keep_all)(rng);
    for (bool fast : {false, true}) {
      MitigationOptions options;
      options.fast = fast;
      auto selected = SelectMitigation(eval, 1, budget, options);
      ASSERT_TRUE(selected.ok()) << selected.status().message();
      const std::string label = "instance " + std::to_string(i) + (fast ? " (first answer)" : "");
      ASSERT_TRUE(selected->fits) << label;
      if (!fast) {
        EXPECT_LE(selected->cost.exposed_s, Exhaustive(eval, 1, budget).exposed_s + 1e-9) << label;
      }
      const Assignment& a = selected->assignment;
      ++instances;
      offloading += std::count(a.begin(), a.end(), Strategy::kOffload) > 0;
      for (size_t o = 0; o < a.size(); ++o) {
        if (a[o] == Strategy::kKeep) continue;
        for (bool group : {false, true}) {
          Assignment trial = a;
          trial[o] = Strategy::kKeep;
          if (group) {
            for (int t : g.ops[o].saves) {
              for (int other : g.tensors[t].savers) trial[other] = Strategy::kKeep;
            }
          }
          const AssignmentCost c = eval.Evaluate(trial, 1);
          EXPECT_FALSE(!c.conflict && c.device_bytes <= budget &&
                       c.exposed_s <= selected->cost.exposed_s + 1e-12)
              << label << ": operator " << o << (group ? " and its partners" : "")
              << " could keep its tensors within the budget (" << c.device_bytes << " of " << budget
              << " bytes) at the same overhead";
        }
      }
    }
  }
  EXPECT_GT(instances, 400);
  EXPECT_GT(offloading, 100);  // the hidden copies are what the answers use
}

TEST(SelectMitigation, HostLimitZeroNeverOffloads) {
  std::mt19937 rng(14);
  HardwareProfile hw = *HardwareProfileByName("h200");
  for (int i = 0; i < 50; ++i) {
    StageGraph g = testing::RandomGraph(rng, 6);
    CostEvaluator eval(g, hw);
    MitigationOptions options;
    options.host_limit_bytes = 0;
    auto selected = SelectMitigation(eval, 1.5, g.M0(1.5), options);
    ASSERT_TRUE(selected.ok());
    EXPECT_EQ(selected->cost.host_bytes, 0);
  }
}

TEST(SelectMitigation, BudgetBelowM0IsAnError) {
  std::mt19937 rng(7);
  StageGraph g = testing::RandomGraph(rng, 5);
  HardwareProfile hw = *HardwareProfileByName("h100");
  CostEvaluator eval(g, hw);
  auto r = SelectMitigation(eval, 1.0, g.M0(1.0) - 1);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("below M0"), std::string::npos);
}

TEST(SelectMitigation, KeepsEverythingWhenItFits) {
  std::mt19937 rng(11);
  StageGraph g = testing::RandomGraph(rng, 6);
  HardwareProfile hw = *HardwareProfileByName("h200");
  CostEvaluator eval(g, hw);
  auto r = SelectMitigation(eval, 1.0, g.KeepAllBytes(1.0));
  ASSERT_TRUE(r.ok());
  for (Strategy s : r->assignment) EXPECT_EQ(s, Strategy::kKeep);
  EXPECT_EQ(r->rounds, 0);
}

TEST(SelectMitigation, RestrictedStrategiesAreRespected) {
  auto c = LoadModelConfig(std::string(BGL_MODELS_DIR) + "/glm-423b-a30b.json");
  HardwareProfile hw = *HardwareProfileByName("paper");
  StageGraph g = *BuildStageGraph(*c, hw);
  CostEvaluator eval(g, hw);
  MitigationOptions recompute_only;
  recompute_only.allow_offload = recompute_only.allow_fp8 = false;
  const double budget = 0.5 * g.KeepAllBytes(1.0);
  auto r = SelectMitigation(eval, 1.0, budget, recompute_only);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->fits);
  for (Strategy s : r->assignment) {
    EXPECT_TRUE(s == Strategy::kKeep || s == Strategy::kRecompute);
  }
}

TEST(SelectMitigation, ConflictingCandidatesAreRejectedNotApplied) {
  // A linear op saves a large tensor of its own and one shared with a router, which may not store
  // FP8. Offload is slow and recompute expensive, so FP8 is the linear op's roofline-best
  // strategy; applying it would leave the shared tensor in two precisions: a conflict.
  StageGraph g;
  g.layers = 1;
  g.tensors = {{"input", 1 << 20, DType::kBF16, -1, {}, false, true},
               {"shared", 64 << 20, DType::kBF16, 0, {}, false, false},
               {"own", 256 << 20, DType::kBF16, 0, {}, false, false}};
  Operator producer{"producer", OpKind::kLinear, 0, 1e-3, 2e-3, 0, false, true, true, {0}, {0}};
  Operator router{"router", OpKind::kRouter, 0, 5e-2, 1e-1, 0, false, false, true, {1}, {1}};
  Operator linear{"linear", OpKind::kLinear, 0, 5e-2, 1e-1, 0, false, true, true, {1, 2}, {1, 2}};
  g.ops = {producer, router, linear};
  g.tensors[2].producer = 0;
  ASSERT_TRUE(g.Finalize().ok());
  HardwareProfile hw = *HardwareProfileByName("h100");
  hw.offload = hw.reload = {1e-3, 1e8};
  CostEvaluator eval(g, hw);
  const double budget = g.KeepAllBytes(1.0) - (100 << 20);
  MitigationOptions fp8_or_offload;
  fp8_or_offload.allow_recompute = false;
  auto r = SelectMitigation(eval, 1.0, budget, fp8_or_offload);
  ASSERT_TRUE(r.ok());
  EXPECT_GE(r->rejected_conflicts, 1);
  EXPECT_TRUE(r->fits);
  EXPECT_FALSE(r->cost.conflict);
  EXPECT_NE(r->assignment[2], Strategy::kFp8);
}

TEST(ReplanAfterGate, DowngradesTheMoeBlockOnASpike) {
  auto c = LoadModelConfig(std::string(BGL_MODELS_DIR) + "/glm-423b-a30b.json");
  HardwareProfile hw = *HardwareProfileByName("paper");
  StageGraph g = *BuildStageGraph(*c, hw);
  CostEvaluator eval(g, hw);
  const double budget = g.KeepAllBytes(1.0);
  auto planned = SelectMitigation(eval, 1.0, budget);
  ASSERT_TRUE(planned.ok());
  // Balanced: nothing changes.
  auto same = ReplanAfterGate(eval, planned->assignment, 0, 1.0, budget);
  EXPECT_EQ(same.assignment, planned->assignment);
  EXPECT_FALSE(same.fallback_full_recompute);
  // A 2.6x spike observed at the gate of layer 1: layer 0 is done, layer 1's MoE block recomputes.
  auto spiked = ReplanAfterGate(eval, planned->assignment, 1, 2.6, budget);
  EXPECT_TRUE(spiked.fallback_full_recompute);
  for (size_t o = 0; o < g.ops.size(); ++o) {
    if (g.ops[o].layer == 0) {
      EXPECT_EQ(spiked.assignment[o], planned->assignment[o]) << g.ops[o].name;
    } else if (IsMoeBlock(g.ops[o].kind) &&
               eval.Allowed(static_cast<int>(o), Strategy::kRecompute)) {
      EXPECT_EQ(spiked.assignment[o], Strategy::kRecompute) << g.ops[o].name;
    }
  }
  EXPECT_LT(spiked.cost.device_bytes, eval.Evaluate(planned->assignment, 2.6).device_bytes);
}

TEST(ReplanAfterGate, OverTheHostGrantOnlyTheLayersOffloadsRecompute) {
  auto c = LoadModelConfig(std::string(BGL_MODELS_DIR) + "/glm-423b-a30b.json");
  HardwareProfile hw = *HardwareProfileByName("paper");
  StageGraph g = *BuildStageGraph(*c, hw);
  CostEvaluator eval(g, hw);
  // A plan that offloads in every layer, within a budget that the spike does not break.
  Assignment planned(g.ops.size(), Strategy::kKeep);
  for (size_t o = 0; o < g.ops.size(); ++o) {
    if (eval.Allowed(static_cast<int>(o), Strategy::kOffload)) planned[o] = Strategy::kOffload;
  }
  const double budget = eval.Evaluate(planned, 1.0).device_bytes * 4;
  const double host = eval.Evaluate(planned, 1.0).host_bytes;
  ASSERT_GT(host, 0);
  auto r = ReplanAfterGate(eval, planned, 1, 1.0, budget, host / 2);
  EXPECT_FALSE(r.fallback_full_recompute);  // not a full-recompute fallback
  bool changed = false;
  for (size_t o = 0; o < g.ops.size(); ++o) {
    if (g.ops[o].layer < 1 || planned[o] != Strategy::kOffload ||
        !eval.Allowed(static_cast<int>(o), Strategy::kRecompute)) {
      EXPECT_EQ(r.assignment[o], planned[o]) << g.ops[o].name;
    } else {
      EXPECT_EQ(r.assignment[o], Strategy::kRecompute) << g.ops[o].name;
      changed = true;
    }
  }
  EXPECT_TRUE(changed);
  EXPECT_LT(r.cost.host_bytes, host);
}

}  // namespace
}  // namespace bgl::plan
