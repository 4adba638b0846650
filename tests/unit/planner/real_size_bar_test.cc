// Algorithm 2 at real sizes against the exact reference (issue 23): chunks of 1 to 4 layers of 12
// to 27 operators (real_instances.h), each solved to a proven optimum by exact_reference.h.
// `BGL_DEBUG=1` prints every instance; `BGL_ONLY=<label part>` runs the instances whose label
// contains it. A separate binary labelled no_asan (its minutes under ASan are not spent).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "exact_reference.h"
#include "governor/planner/mitigation.h"
#include "real_instances.h"

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
    if (ratios.empty()) return 0;
    std::sort(ratios.begin(), ratios.end());
    return ratios[std::min(ratios.size() - 1, static_cast<size_t>(q * ratios.size()))];
  }
};

// Issue 23's bar: on at least 150 real-sized instances with a proven optimum, ratio
// (plan + 10 us) / (optimum + 10 us) p90 <= 1.05 and max <= 1.5, never over budget, never a
// conflict. Every plan is checked (budget, conflicts, the reference's cost of it); the ratio is
// taken where the reference proves the optimum within kMaxLabels labels (a deterministic count;
// the others are counted and printed, BGL_MAX_LABELS raises the limit). docs/planner.md has the
// figures.
constexpr int64_t kMaxLabels = 600'000;
TEST(SelectMitigation, RealSizesAgainstTheExactReference) {
  const auto instances = testing::RealInstances(BGL_PLANNER_TEST_DATA, 2323, 120, 20);
  ASSERT_GE(instances.size(), 150u);
  const HardwareProfile hw = *HardwareProfileByName("h200");
  Figures all, greedy, first_answers, first_before;
  double first_worst = 0;
  std::string first_worst_label;
  std::map<std::string, Figures> by_set;
  double worst = 0;
  std::string worst_label;
  int ops_min = 1 << 30, ops_max = 0;
  const char* only = std::getenv("BGL_ONLY");
  int unproven = 0;
  for (const auto& x : instances) {
    if (only != nullptr && x.label.find(only) == std::string::npos) continue;
    const StageGraph& g = x.graph;
    ASSERT_FALSE(g.ops.empty()) << x.label;
    ops_min = std::min<int>(ops_min, static_cast<int>(g.ops.size()) / g.layers);
    ops_max = std::max<int>(ops_max, static_cast<int>(g.ops.size()) / g.layers);
    CostEvaluator eval(g, hw);
    MitigationOptions options;
    // BGL_DP_STATES: the operator DP's labels per cut (an experiment; the default otherwise).
    if (const char* d = std::getenv("BGL_DP_STATES")) options.dp_states = std::atoi(d);
    auto plan = SelectMitigation(eval, x.r, x.budget, options);
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
    // The anytime path's first answer (issue 43) on the multi-layer chunks.
    std::optional<MitigationResult> first, before;
    if (g.layers > 1) {
      MitigationOptions fast = options;
      fast.fast = true;
      auto quick = SelectMitigation(eval, x.r, x.budget, fast);
      ASSERT_TRUE(quick.ok()) << x.label << ": " << quick.status().message();
      EXPECT_TRUE(quick->fits) << x.label;
      EXPECT_FALSE(quick->cost.conflict) << x.label;
      first = *quick;
      fast.fast_priced = false;  // the first answer before issue 43: the 4-label DP alone
      auto dp_only = SelectMitigation(eval, x.r, x.budget, fast);
      ASSERT_TRUE(dp_only.ok()) << x.label;
      before = *dp_only;
    }
    const auto t0 = std::chrono::steady_clock::now();
    reference::Options ro;
    ro.max_labels = kMaxLabels;
    if (const char* m = std::getenv("BGL_MAX_LABELS")) ro.max_labels = std::atoll(m);
    // The cheaper of the two answers bounds the search.
    const Assignment& incumbent = first && first->cost.exposed_s < plan->cost.exposed_s
                                      ? first->assignment
                                      : plan->assignment;
    const reference::Optimum opt = reference::Solve(g, hw, x.r, x.budget, ro, incumbent);
    const double solve_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!opt.proven) {
      std::printf("not proven in %.3fs: plan %.6f %s\n", solve_s, plan->cost.exposed_s,
                  x.label.c_str());
      std::fflush(stdout);
      ++unproven;
      continue;
    }
    ASSERT_TRUE(opt.feasible) << x.label;
    EXPECT_LE(opt.exposed_s, plan->cost.exposed_s * (1 + 1e-12)) << x.label;
    const double ratio = (plan->cost.exposed_s + kFloor) / (opt.exposed_s + kFloor);
    if (first) {
      const double r1 = (first->cost.exposed_s + kFloor) / (opt.exposed_s + kFloor);
      first_answers.Add(r1);
      first_before.Add((before->cost.exposed_s + kFloor) / (opt.exposed_s + kFloor));
      if (r1 > first_worst) {
        first_worst = r1;
        first_worst_label = x.label;
      }
      if (std::getenv("BGL_DEBUG")) std::printf("first answer %.3f %s\n", r1, x.label.c_str());
    }
    if (std::getenv("BGL_DEBUG")) {
      std::printf("%.3f %.3fs labels %lld plan %.6f opt %.6f %s\n", ratio, solve_s,
                  static_cast<long long>(opt.labels), plan->cost.exposed_s, opt.exposed_s,
                  x.label.c_str());
      // Where the optimum differs from the plan (the operators whose strategy it changes).
      for (size_t o = 0; ratio > 1 + 1e-9 && o < g.ops.size(); ++o) {
        if (opt.assignment[o] != plan->assignment[o]) {
          std::printf("    %s: %s -> %s\n", g.ops[o].name.c_str(),
                      StrategyName(plan->assignment[o]), StrategyName(opt.assignment[o]));
        }
      }
      std::fflush(stdout);
    }
    all.Add(ratio);
    by_set[x.set].Add(ratio);
    MitigationOptions paper;
    paper.layer_search = paper.operator_dp = paper.priced_bound = false;
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
  std::printf("  optimum proven on %zu (not within the label limit: %d)\n", all.ratios.size(),
              unproven);
  std::printf("  planner: median %.3f p90 %.3f max %.3f optimal %d; worst: %s\n", all.At(0.5),
              all.At(0.9), all.At(1.0), all.optimal, worst_label.c_str());
  std::printf(
      "  the greedy with its local search alone: median %.3f p90 %.3f max %.3f optimal %d\n",
      greedy.At(0.5), greedy.At(0.9), greedy.At(1.0), greedy.optimal);
  std::printf(
      "  first answers, 2-4 layers (%zu): median %.3f p90 %.3f max %.3f optimal %d; "
      "worst: %s\n",
      first_answers.ratios.size(), first_answers.At(0.5), first_answers.At(0.9),
      first_answers.At(1.0), first_answers.optimal, first_worst_label.c_str());
  std::printf(
      "  first answers before issue 43 (the 4-label DP alone): median %.3f p90 %.3f "
      "max %.3f optimal %d\n",
      first_before.At(0.5), first_before.At(0.9), first_before.At(1.0), first_before.optimal);
  for (auto& [set, f] : by_set) {
    std::printf("  %s (%zu): median %.3f p90 %.3f max %.3f optimal %d\n", set.c_str(),
                f.ratios.size(), f.At(0.5), f.At(0.9), f.At(1.0), f.optimal);
  }
  if (only != nullptr) return;
  EXPECT_GE(all.ratios.size(), 150u);
  EXPECT_LE(all.At(0.9), 1.05);
  EXPECT_LE(all.At(1.0), 1.5) << worst_label;
  // Issue 43: the first answer a cache miss serves on a multi-layer chunk meets the same bar
  // (measured p90 1.007, max 1.137; the 4-label DP alone had p90 55.9, max 1393).
  EXPECT_GE(first_answers.ratios.size(), 100u);
  EXPECT_LE(first_answers.At(0.9), 1.05);
  EXPECT_LE(first_answers.At(1.0), 1.5) << first_worst_label;
}

}  // namespace
}  // namespace bgl::plan
