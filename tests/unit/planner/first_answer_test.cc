// The anytime path's first answer on multi-layer chunks (issue 43): what a run is served on a
// mitigation-cache miss, against the exact reference (exact_reference.h, itself checked against
// all 4^n assignments in real_size_test.cc).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "exact_reference.h"
#include "governor/planner/mitigation.h"
#include "real_instances.h"
#include "small_chunks.h"

namespace bgl::plan {
namespace {

constexpr double kFloor = 10e-6;  // the ratio's floor, as in mitigation_test.cc

double At(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))];
}

// 400 chunks of 2 or 3 layers of 4 to 6 operators (small_chunks.h), every budget family: the
// first answer within budget, conflict-free, its cost the reference's, and its ratio
// (plan + 10 us) / (optimum + 10 us) against the proven optimum. The 4-label DP alone (the first
// answer before issue 43, MitigationOptions::fast_priced = false) is printed beside it.
// `BGL_DEBUG=1` prints every instance that is not optimal, `BGL_ONLY=<index>` runs one.
TEST(FirstAnswer, SmallMultiLayerChunksAgainstTheExactReference) {
  std::mt19937 rng(4343);
  std::vector<double> ratios[2];
  int optimal[2] = {0, 0};
  double worst = 0;
  std::string worst_label;
  for (int i = 0; i < 400; ++i) {
    const testing::SmallChunk x = testing::RandomSmallChunk(rng, i);
    if (std::getenv("BGL_ONLY") && std::atoi(std::getenv("BGL_ONLY")) != i) continue;
    const StageGraph& g = x.graph;
    CostEvaluator eval(g, x.hw);
    MitigationResult answers[2];
    for (int v = 0; v < 2; ++v) {
      MitigationOptions options;
      options.fast = true;
      options.fast_priced = v == 1;
      auto plan = SelectMitigation(eval, x.r, x.budget, options);
      ASSERT_TRUE(plan.ok()) << x.label;
      answers[v] = *plan;
    }
    const MitigationResult& plan = answers[1];
    EXPECT_TRUE(plan.fits) << x.label;
    EXPECT_FALSE(plan.cost.conflict) << x.label;
    const reference::Cost own = reference::Evaluate(g, x.hw, x.r, plan.assignment);
    EXPECT_NEAR(own.exposed_s, plan.cost.exposed_s, 1e-12 + 1e-9 * own.exposed_s) << x.label;
    const reference::Optimum opt = reference::Solve(g, x.hw, x.r, x.budget, {}, plan.assignment);
    ASSERT_TRUE(opt.proven && opt.feasible) << x.label;
    for (int v = 0; v < 2; ++v) {
      const double ratio = (answers[v].cost.exposed_s + kFloor) / (opt.exposed_s + kFloor);
      ratios[v].push_back(ratio);
      optimal[v] += ratio <= 1 + 1e-9 ? 1 : 0;
      if (v == 1 && std::getenv("BGL_DEBUG") && ratio > 1 + 1e-9) {
        std::printf("%.3f plan %.1f us opt %.1f us #%d %s\n", ratio, plan.cost.exposed_s * 1e6,
                    opt.exposed_s * 1e6, i, x.label.c_str());
        for (size_t o = 0; o < g.ops.size(); ++o) {
          double bytes = 0;
          for (int t : g.ops[o].saves) bytes += g.tensors[t].Bytes(x.r);
          std::printf("    %s f=%.1fus saves %.1f MiB: %s -> %s\n", g.ops[o].name.c_str(),
                      g.ops[o].ForwardTime(x.r) * 1e6, bytes / (1 << 20),
                      StrategyName(plan.assignment[o]), StrategyName(opt.assignment[o]));
        }
      }
      if (v == 1 && ratio > worst) {
        worst = ratio;
        worst_label = x.label;
      }
    }
  }
  for (int v = 0; v < 2; ++v) {
    std::printf("%s: median %.3f p90 %.3f max %.3f optimal %d of %zu\n",
                v == 0 ? "first answer before issue 43 (the 4-label DP alone)"
                       : "first answer (priced candidates, then the DP below them)",
                At(ratios[v], 0.5), At(ratios[v], 0.9), At(ratios[v], 1.0), optimal[v],
                ratios[v].size());
  }
  std::printf("worst: %s\n", worst_label.c_str());
  // Every optimum here is proven, so the bar is stricter than issue 43's at real sizes (p90 at
  // most 1.5): p90 1.1 (measured 1.000; the DP alone had 11.2) and, as the exhaustive-search
  // tests of Algorithm 2 assert, a worst of 10 (measured 5.8: three small moves where the answer
  // makes one larger; the DP alone had 504).
  EXPECT_LE(At(ratios[1], 0.9), 1.1);
  EXPECT_LE(At(ratios[1], 1.0), 10.0) << worst_label;
}

// Issue 43's worst case: a 4-layer chunk of 23 operators per layer at load 2.0 whose budget
// keeping what fits and offloading the rest under compute meets with no exposed overhead (the
// 4-label DP's first answer had 29.5 ms there). 25 such chunks (the first 25 seeds whose MoE
// block has 23 operators); for each, the witness offloads whole tensors (with all their savers),
// largest first, while the copies stay within 90% of the forward window, and the budget is what it
// keeps. The first answer must have no exposed overhead either.
TEST(FirstAnswer, KeepWhatFitsAndOffloadTheRestUnderCompute) {
  const HardwareProfile hw = *HardwareProfileByName("h200");
  const double r = 2.0;
  double worst_before = 0;
  std::string worst_shape;
  int chunks = 0;
  for (uint32_t seed = 1; chunks < 25; ++seed) {
    std::mt19937 rng(seed);
    testing::MoeBlockBuilder builder(rng, hw);
    std::string shape;
    const StageGraph g = builder.Build(4, shape);
    if (builder.ops_per_layer() != 23) continue;
    ++chunks;
    shape += " (seed " + std::to_string(seed) + ")";
    ASSERT_EQ(g.ops.size(), 4u * 23);
    CostEvaluator eval(g, hw);
    std::vector<int> order;
    for (size_t t = 0; t < g.tensors.size(); ++t) {
      if (!g.tensors[t].block_input && !g.tensors[t].savers.empty()) {
        order.push_back(static_cast<int>(t));
      }
    }
    std::sort(order.begin(), order.end(),
              [&](int a, int b) { return g.tensors[a].bytes > g.tensors[b].bytes; });
    Assignment witness(g.ops.size(), Strategy::kKeep);
    for (int t : order) {
      Assignment trial = witness;
      for (int s : g.tensors[t].savers) trial[s] = Strategy::kOffload;
      const AssignmentCost c = eval.Evaluate(trial, r);
      if (c.conflict || c.exposed_s > 0 || c.d2h_s > 0.9 * g.ForwardTime(r)) continue;
      witness = std::move(trial);
    }
    const AssignmentCost w = eval.Evaluate(witness, r);
    ASSERT_FALSE(w.conflict) << shape;
    ASSERT_EQ(w.exposed_s, 0) << shape;
    ASSERT_GT(w.host_bytes, 0) << shape;
    const double budget = w.device_bytes;
    MitigationOptions options;
    options.fast = true;
    auto first = SelectMitigation(eval, r, budget, options);
    ASSERT_TRUE(first.ok()) << shape;
    EXPECT_TRUE(first->fits) << shape;
    EXPECT_FALSE(first->cost.conflict) << shape;
    EXPECT_LE(first->cost.device_bytes, budget) << shape;
    EXPECT_EQ(first->cost.exposed_s, 0) << shape;
    options.fast_priced = false;
    auto before = SelectMitigation(eval, r, budget, options);
    ASSERT_TRUE(before.ok()) << shape;
    if (before->cost.exposed_s > worst_before) {
      worst_before = before->cost.exposed_s;
      worst_shape = shape + ", witness offloads " +
                    std::to_string(static_cast<int>(w.host_bytes / (1 << 20))) + " MiB";
    }
  }
  std::printf(
      "25 chunks of 4 x 23 operators at r=2: every first answer without exposed overhead; "
      "before issue 43 up to %.1f ms (%s)\n",
      worst_before * 1e3, worst_shape.c_str());
}

}  // namespace
}  // namespace bgl::plan
