// The exact reference (exact_reference.h) checked against exhaustive search on small graphs.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "exact_reference.h"
#include "governor/planner/mitigation.h"
#include "test_graphs.h"

namespace bgl::plan {
namespace {

// The reference's cost agrees with the planner's evaluator, and its optimum with exhaustive
// search, on the small edge cases (all 4^n assignments).
TEST(ExactReference, MatchesExhaustiveSearchOnSmallGraphs) {
  std::mt19937 rng(2323);
  const HardwareProfile hw = *HardwareProfileByName("h200");
  for (int i = 0; i < 300; ++i) {
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
    // With the planner's answer as the incumbent the bounds cut (the real-size test's path).
    auto plan = SelectMitigation(eval, e.r, e.budget);
    ASSERT_TRUE(plan.ok()) << e.families;
    const reference::Optimum cut = reference::Solve(g, hw, e.r, e.budget, {}, plan->assignment);
    ASSERT_TRUE(cut.proven && cut.feasible) << e.families;
    EXPECT_NEAR(cut.exposed_s, best, 1e-12 + 1e-9 * best) << "edge " << i << " " << e.families;
  }
}

}  // namespace
}  // namespace bgl::plan
