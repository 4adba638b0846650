// Algorithm 2 at real sizes against the exact reference (issue 23): chunks of 1 to 4 layers of 12
// to 32 operators (real_instances.h), each solved to a proven optimum by exact_reference.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "exact_reference.h"
#include "governor/planner/mitigation.h"
#include "real_instances.h"
#include "test_graphs.h"

namespace bgl::plan {
namespace {

constexpr double kFloor = 10e-6;  // the ratio's floor, as in mitigation_test.cc

struct Figures {
  std::vector<double> ratios;
  int optimal = 0;
  void Add(double ratio) {
    ratios.push_back(ratio);
    optimal += ratio <= 1 + 1e-9 ? 1 : 0;
  }
  double At(double q) {
    std::sort(ratios.begin(), ratios.end());
    return ratios[std::min(ratios.size() - 1, static_cast<size_t>(q * ratios.size()))];
  }
};

// The reference's cost agrees with the planner's evaluator, and its optimum with exhaustive
// search, on the small edge cases (all 4^n assignments).
TEST(ExactReference, MatchesExhaustiveSearchOnSmallGraphs) {
  std::mt19937 rng(2323);
  const HardwareProfile hw = *HardwareProfileByName("h200");
  for (int i = 0; i < 150; ++i) {
    testing::EdgeCase e = testing::RandomEdgeCase(rng, 7);
    const StageGraph& g = e.graph;
    CostEvaluator eval(g, hw);
    const size_t n = g.ops.size();
    double best = 1e300;
    Assignment a(n);
    size_t combos = 1;
    for (size_t o = 0; o < n; ++o) combos *= 4;
    for (size_t code = 0; code < combos; ++code) {
      bool ok = true;
      for (size_t o = 0, rest = code; o < n; ++o, rest /= 4) {
        a[o] = kAllStrategies[rest % 4];
        ok &= eval.Allowed(static_cast<int>(o), a[o]);
      }
      if (!ok) continue;
      const AssignmentCost c = eval.Evaluate(a, e.r);
      const reference::Cost rc = reference::Evaluate(g, hw, e.r, a);
      ASSERT_EQ(c.conflict, rc.conflict) << e.families;
      ASSERT_NEAR(c.device_bytes, rc.device_bytes, 1e-9 * (1 + c.device_bytes)) << e.families;
      ASSERT_NEAR(c.exposed_s, rc.exposed_s, 1e-12 + 1e-12 * c.exposed_s) << e.families;
      if (!c.conflict && c.device_bytes <= e.budget) best = std::min(best, c.exposed_s);
    }
    const reference::Optimum opt = reference::Solve(g, hw, e.r, e.budget, {});
    ASSERT_TRUE(opt.proven && opt.feasible) << e.families;
    EXPECT_NEAR(opt.exposed_s, best, 1e-12 + 1e-9 * best) << "edge " << i << " " << e.families;
  }
}

// Issue 23's bar: at least 150 real-sized instances, ratio (plan + 10 us) / (optimum + 10 us)
// p90 <= 1.05 and max <= 1.5, never over budget, never a conflict.
TEST(SelectMitigation, DISABLED_RealSizesAgainstTheExactReference) {
  const auto instances = testing::RealInstances(BGL_PLANNER_TEST_DATA, 2323, 100, 18);
  ASSERT_GE(instances.size(), 150u);
  const HardwareProfile hw = *HardwareProfileByName("h200");
  Figures all, greedy;
  std::map<std::string, Figures> by_set;
  double worst = 0;
  std::string worst_label;
  int ops_min = 1 << 30, ops_max = 0;
  for (const auto& x : instances) {
    const StageGraph& g = x.graph;
    ASSERT_FALSE(g.ops.empty()) << x.label;
    ops_min = std::min<int>(ops_min, static_cast<int>(g.ops.size()) / g.layers);
    ops_max = std::max<int>(ops_max, static_cast<int>(g.ops.size()) / g.layers);
    CostEvaluator eval(g, hw);
    auto plan = SelectMitigation(eval, x.r, x.budget);
    ASSERT_TRUE(plan.ok()) << x.label << ": " << plan.status().message();
    EXPECT_TRUE(plan->fits) << x.label;
    EXPECT_LE(plan->cost.device_bytes, x.budget) << x.label;
    EXPECT_FALSE(plan->cost.conflict) << x.label;
    if (plan->fallback_full_recompute) {
      EXPECT_EQ(plan->assignment, FullRecompute(eval)) << x.label;
    }
    // The reference's own cost of the plan is the planner's.
    const reference::Cost own = reference::Evaluate(g, hw, x.r, plan->assignment);
    EXPECT_NEAR(own.exposed_s, plan->cost.exposed_s, 1e-12 + 1e-9 * own.exposed_s) << x.label;
    const reference::Optimum opt = reference::Solve(g, hw, x.r, x.budget, {}, plan->assignment);
    ASSERT_TRUE(opt.proven) << x.label << ": the reference gave up after " << opt.labels;
    ASSERT_TRUE(opt.feasible) << x.label;
    const double ratio = (plan->cost.exposed_s + kFloor) / (opt.exposed_s + kFloor);
    if (std::getenv("BGL_DEBUG")) {
      std::printf("%.3f labels %lld plan %.6f opt %.6f %s\n", ratio,
                  static_cast<long long>(opt.labels), plan->cost.exposed_s, opt.exposed_s,
                  x.label.c_str());
      std::fflush(stdout);
    }
    all.Add(ratio);
    by_set[x.set].Add(ratio);
    MitigationOptions paper;
    paper.layer_search = paper.operator_dp = false;
    auto g_only = SelectMitigation(eval, x.r, x.budget, paper);
    ASSERT_TRUE(g_only.ok());
    greedy.Add((g_only->cost.exposed_s + kFloor) / (opt.exposed_s + kFloor));
    if (ratio > worst) {
      worst = ratio;
      worst_label = x.label;
    }
  }
  std::printf("%zu instances, %d to %d operators per layer, 1 to 4 layers\n", instances.size(),
              ops_min, ops_max);
  std::printf("  planner: median %.3f p90 %.3f max %.3f optimal %d; worst: %s\n", all.At(0.5),
              all.At(0.9), all.At(1.0), all.optimal, worst_label.c_str());
  std::printf(
      "  the greedy with its local search alone: median %.3f p90 %.3f max %.3f optimal %d\n",
      greedy.At(0.5), greedy.At(0.9), greedy.At(1.0), greedy.optimal);
  for (auto& [set, f] : by_set) {
    std::printf("  %s (%zu): median %.3f p90 %.3f max %.3f optimal %d\n", set.c_str(),
                f.ratios.size(), f.At(0.5), f.At(0.9), f.At(1.0), f.optimal);
  }
  EXPECT_LE(all.At(0.9), 1.05);
  EXPECT_LE(all.At(1.0), 1.5) << worst_label;
}

}  // namespace
}  // namespace bgl::plan
