// The downgrade after the gate is a plan (issue 43 item 3): when a forward's load, seen at the
// gate, makes its plan no longer fit, the operators not run yet are planned again at that load,
// weighing offload, FP8 and recompute at the calibrated costs, rather than sending the MoE blocks
// to recompute by a fixed rule. On the host backend (synchronous copies) where copies are cheap
// it offloads; where they are dear it recomputes; within 1.5x of the optimum of the rest of the
// chunk (all assignments of the operators not run yet, the others as planned) either way.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "exact_reference.h"
#include "governor/planner/mitigation.h"
#include "real_instances.h"

namespace bgl::plan {
namespace {

constexpr double kFloor = 10e-6;  // the ratio's floor, as in mitigation_test.cc

// The rule before issue 43: the MoE blocks of the gate's layer and later layers recompute.
Assignment FixedRule(const CostEvaluator& eval, const Assignment& planned, int gate_layer) {
  Assignment a = planned;
  for (size_t o = 0; o < a.size(); ++o) {
    if (eval.graph().ops[o].layer >= gate_layer && IsMoeBlock(eval.graph().ops[o].kind) &&
        eval.Allowed(static_cast<int>(o), Strategy::kRecompute)) {
      a[o] = Strategy::kRecompute;
    }
  }
  return a;
}

// The least exposed overhead over every assignment of the operators the forward has not run
// (the gate layer's MoE block on), the others as planned, within the budget.
double RestOptimum(const CostEvaluator& eval, const Assignment& planned, int gate_layer, double r,
                   double budget) {
  const StageGraph& g = eval.graph();
  std::vector<int> free;
  bool moe_seen = false;
  for (size_t o = 0; o < g.ops.size(); ++o) {
    moe_seen |= g.ops[o].layer == gate_layer && IsMoeBlock(g.ops[o].kind);
    const bool not_run = g.ops[o].layer > gate_layer || (g.ops[o].layer == gate_layer && moe_seen);
    if (not_run && eval.Allowed(static_cast<int>(o), Strategy::kRecompute)) {
      free.push_back(static_cast<int>(o));
    }
  }
  double best = 1e300;
  Assignment a = planned;
  std::vector<int> digit(free.size(), 0);
  for (;;) {
    bool ok = true;
    for (size_t i = 0; i < free.size(); ++i) {
      a[free[i]] = kAllStrategies[digit[i]];
      ok &= eval.Allowed(free[i], a[free[i]]);
    }
    if (ok) {
      const AssignmentCost c = eval.Evaluate(a, r);
      if (!c.conflict && c.device_bytes <= budget) best = std::min(best, c.exposed_s);
    }
    size_t i = 0;
    for (; i < free.size() && ++digit[i] == kStrategyCount; ++i) digit[i] = 0;
    if (i == free.size()) break;
  }
  return best;
}

struct Case {
  StageGraph graph;
  std::string shape;
};

// The first `count` 2-layer MoE chunks timed on the host profile (a CPU as the device) without
// shared experts, so the operators after the last gate stay few enough to enumerate.
std::vector<Case> HostChunks(int count, const HardwareProfile& hw) {
  std::vector<Case> out;
  for (uint32_t seed = 1; static_cast<int>(out.size()) < count; ++seed) {
    std::mt19937 rng(seed);
    testing::MoeBlockBuilder builder(rng, hw);
    Case c;
    c.graph = builder.Build(2, c.shape);
    c.shape += " (seed " + std::to_string(seed) + ")";
    if (c.shape.find("shared") == std::string::npos) out.push_back(std::move(c));
  }
  return out;
}

// Plans the forward at load 1 keeping everything (its budget is keep-all at load 1), then sees
// `r` at the gate of the last layer and revises; checks the revision against the rule and the
// optimum of the rest. Returns the revision.
MitigationResult Revise(const Case& c, const HardwareProfile& hw, double r, double& rule_s,
                        double& optimum_s) {
  const StageGraph& g = c.graph;
  CostEvaluator eval(g, hw);
  const double budget = g.KeepAllBytes(1.0);
  const Assignment planned(g.ops.size(), Strategy::kKeep);
  const int gate_layer = g.layers - 1;
  EXPECT_GT(eval.Evaluate(planned, r).device_bytes, budget) << "the rule must fire";
  const MitigationResult revised = ReplanAfterGate(eval, planned, gate_layer, r, budget);
  EXPECT_TRUE(revised.fits) << c.shape;
  EXPECT_FALSE(revised.cost.conflict) << c.shape;
  EXPECT_LE(revised.cost.device_bytes, budget) << c.shape;
  // What the forward has run keeps its plan.
  for (size_t o = 0; o < g.ops.size(); ++o) {
    if (g.ops[o].layer < gate_layer) {
      EXPECT_EQ(revised.assignment[o], planned[o]) << c.shape;
    }
  }
  const AssignmentCost rule = eval.Evaluate(FixedRule(eval, planned, gate_layer), r);
  EXPECT_LE(rule.device_bytes, budget) << c.shape;
  rule_s = rule.exposed_s;
  optimum_s = RestOptimum(eval, planned, gate_layer, r, budget);
  EXPECT_LE(revised.cost.exposed_s, rule.exposed_s + 1e-12) << c.shape;
  EXPECT_LE(revised.cost.exposed_s + kFloor, 1.5 * (optimum_s + kFloor)) << c.shape;
  return revised;
}

int Count(const MitigationResult& m, Strategy s) {
  return static_cast<int>(std::count(m.assignment.begin(), m.assignment.end(), s));
}

// Copies at the host profile's memcpy speed: moving a grown expert tensor out and back costs
// less than rerunning the expert GEMMs on the CPU, so the revision offloads (in 7 of the 8
// chunks; in the other the optimum of the rest offloads nothing either). The rule recomputed the
// MoE block: 43 to 690 times the optimum here.
TEST(ReplanAfterGate, CheapCopiesOffload) {
  const HardwareProfile hw = *HardwareProfileByName("host");
  int offloading = 0;
  for (const Case& c : HostChunks(8, hw)) {
    double rule_s = 0, optimum_s = 0;
    const MitigationResult revised = Revise(c, hw, 1.3, rule_s, optimum_s);
    std::printf(
        "%s: revised %.1f us (offload %d, recompute %d), the rule %.1f us, optimum %.1f us\n",
        c.shape.c_str(), revised.cost.exposed_s * 1e6, Count(revised, Strategy::kOffload),
        Count(revised, Strategy::kRecompute), rule_s * 1e6, optimum_s * 1e6);
    offloading += Count(revised, Strategy::kOffload) > 0 ? 1 : 0;
    EXPECT_LT(revised.cost.exposed_s, 0.5 * rule_s) << c.shape;
  }
  EXPECT_GE(offloading, 6);
}

// Copies a thousand times slower (a link of 10 MB/s): the revision recomputes, and only what the
// budget needs (the optimum of the rest in all 8; the rule cost 2.8 to 690 times it).
TEST(ReplanAfterGate, DearCopiesRecompute) {
  HardwareProfile hw = *HardwareProfileByName("host");
  hw.offload.peak_bytes_per_s /= 1000;
  hw.reload.peak_bytes_per_s /= 1000;
  for (const Case& c : HostChunks(8, hw)) {
    double rule_s = 0, optimum_s = 0;
    const MitigationResult revised = Revise(c, hw, 1.3, rule_s, optimum_s);
    std::printf(
        "%s: revised %.1f us (offload %d, recompute %d), the rule %.1f us, optimum %.1f us\n",
        c.shape.c_str(), revised.cost.exposed_s * 1e6, Count(revised, Strategy::kOffload),
        Count(revised, Strategy::kRecompute), rule_s * 1e6, optimum_s * 1e6);
    EXPECT_EQ(Count(revised, Strategy::kOffload), 0) << c.shape;
    EXPECT_GT(Count(revised, Strategy::kRecompute) + Count(revised, Strategy::kFp8), 0) << c.shape;
  }
}

// The revision uses only the strategies the planner may: a run that keeps FP8 out (the package's
// allow_fp8=False, bit-for-bit training) never gets FP8 from it, nor offload where offload is
// off (the package's bit-for-bit EP and unmodified-model tests caught FP8 in a revision).
TEST(ReplanAfterGate, UsesOnlyTheStrategiesThePlannerMay) {
  HardwareProfile hw = *HardwareProfileByName("host");
  hw.fp8_cast.peak_bytes_per_s *= 1000;  // FP8 nearly free: the revision would pick it
  for (const Case& c : HostChunks(4, hw)) {
    const StageGraph& g = c.graph;
    CostEvaluator eval(g, hw);
    const double budget = g.KeepAllBytes(1.0);
    const Assignment planned(g.ops.size(), Strategy::kKeep);
    MitigationOptions no_fp8;
    no_fp8.allow_fp8 = false;
    const MitigationResult a =
        ReplanAfterGate(eval, planned, g.layers - 1, 1.3, budget, -1, no_fp8);
    EXPECT_EQ(Count(a, Strategy::kFp8), 0) << c.shape;
    EXPECT_TRUE(a.fits) << c.shape;
    MitigationOptions recompute_only = no_fp8;
    recompute_only.allow_offload = false;
    const MitigationResult b =
        ReplanAfterGate(eval, planned, g.layers - 1, 1.3, budget, -1, recompute_only);
    EXPECT_EQ(Count(b, Strategy::kFp8) + Count(b, Strategy::kOffload), 0) << c.shape;
    const MitigationResult any = ReplanAfterGate(eval, planned, g.layers - 1, 1.3, budget);
    EXPECT_GT(Count(any, Strategy::kFp8), 0) << c.shape << ": the test's FP8 is not attractive";
  }
}

// The downgrade's search has a price (GateSearch): it runs on the training thread, so it may
// spend at most a share of the exposed overhead it could remove. On the host chunks at 1.3 the
// priced candidates leave a few microseconds exposed (CheapCopiesOffload): at a price of 1 ms per
// label the search does not run (no labels, cut), and the revision is what the search would have
// started from, still fitting and no costlier than the rule; at 1 ns per label it runs with the
// labels the share affords (fewer than the full count where that is cheaper), and at no price
// (the default) with the full count.
TEST(ReplanAfterGate, TheSearchCostsAtMostAShareOfWhatItCanRemove) {
  const HardwareProfile hw = *HardwareProfileByName("host");
  int searched = 0;
  for (const Case& c : HostChunks(8, hw)) {
    const StageGraph& g = c.graph;
    CostEvaluator eval(g, hw);
    const double budget = g.KeepAllBytes(1.0);
    const Assignment planned(g.ops.size(), Strategy::kKeep);
    const int gate = g.layers - 1;
    const MitigationResult full = ReplanAfterGate(eval, planned, gate, 1.3, budget);
    EXPECT_FALSE(full.search_cut) << c.shape;
    GateSearch dear;
    dear.share = 0.25;
    dear.seconds_per_label = 1e-3;
    const MitigationResult skipped =
        ReplanAfterGate(eval, planned, gate, 1.3, budget, -1, {}, nullptr, dear);
    const AssignmentCost rule = eval.Evaluate(FixedRule(eval, planned, gate), 1.3);
    EXPECT_TRUE(skipped.fits) << c.shape;
    EXPECT_LE(skipped.cost.device_bytes, budget) << c.shape;
    EXPECT_LE(skipped.cost.exposed_s, rule.exposed_s + 1e-12) << c.shape;
    EXPECT_GE(skipped.cost.exposed_s, full.cost.exposed_s - 1e-12) << c.shape;
    if (full.search_labels == 0) continue;  // nothing left exposed: no search either way
    ++searched;
    // 0.25 * exposed (tens of us at most) / 1 ms per label: under one label, no search.
    EXPECT_EQ(skipped.search_labels, 0) << c.shape;
    EXPECT_TRUE(skipped.search_cut) << c.shape;
    EXPECT_EQ(skipped.search_s, 0) << c.shape;
    GateSearch cheap = dear;
    cheap.seconds_per_label = 1e-9;
    const MitigationResult priced =
        ReplanAfterGate(eval, planned, gate, 1.3, budget, -1, {}, nullptr, cheap);
    const double affordable = cheap.share * skipped.cost.exposed_s / cheap.seconds_per_label;
    EXPECT_EQ(priced.search_cut, affordable < full.search_labels) << c.shape;
    if (priced.search_cut && affordable >= 16) {
      EXPECT_EQ(priced.search_labels, static_cast<int>(affordable)) << c.shape;
    }
    EXPECT_LE(priced.search_labels, full.search_labels) << c.shape;
    EXPECT_GT(full.search_s, 0) << c.shape;
  }
  EXPECT_GT(searched, 0) << "no chunk left the search anything to remove";
}

// The revision after the gate, alone and with the warm plan of the observed load, against the
// exact reference with the operators that ran pinned: within 1.5x on the instances `indices` of
// `planner_first_answer_study gate-reference SEED`.
void ExpectTheRestWithinTheBar(uint32_t seed, std::initializer_list<int> indices) {
  const HardwareProfile hw = *HardwareProfileByName("h200");
  const std::vector<testing::GateInstance> all =
      testing::GateInstances(seed, std::max(indices) + 1);
  for (const int i : indices) {
    const testing::GateInstance& x = all[static_cast<size_t>(i)];
    const CostEvaluator eval(x.graph, hw);
    auto planned = SelectMitigation(eval, 1.0, x.budget);
    ASSERT_TRUE(planned.ok()) << x.label;
    auto full = SelectMitigation(eval, x.observed, x.budget);  // the warm plan of that key
    ASSERT_TRUE(full.ok()) << x.label;
    const std::vector<Assignment> warm = {full->assignment};
    const MitigationResult alone =
        ReplanAfterGate(eval, planned->assignment, x.gate, x.observed, x.budget);
    const MitigationResult revised =
        ReplanAfterGate(eval, planned->assignment, x.gate, x.observed, x.budget, -1, {}, &warm);
    reference::Options ro;
    ro.pinned.assign(x.graph.ops.size(), -1);
    bool moe_seen = false;
    for (size_t o = 0; o < x.graph.ops.size(); ++o) {
      const Operator& op = x.graph.ops[o];
      moe_seen |= op.layer == x.gate && IsMoeBlock(op.kind);
      if (op.layer < x.gate || (op.layer == x.gate && !moe_seen)) {
        ro.pinned[o] = static_cast<int>(planned->assignment[o]);
        EXPECT_EQ(revised.assignment[o], planned->assignment[o]) << x.label << " op " << o;
        EXPECT_EQ(alone.assignment[o], planned->assignment[o]) << x.label << " op " << o;
      }
    }
    const reference::Optimum opt =
        reference::Solve(x.graph, hw, x.observed, x.budget, ro, revised.assignment);
    ASSERT_TRUE(opt.proven && opt.feasible) << x.label;
    ASSERT_TRUE(revised.fits) << x.label;
    ASSERT_TRUE(alone.fits) << x.label;
    EXPECT_LE((revised.cost.exposed_s + 1e-5) / (opt.exposed_s + 1e-5), 1.5) << x.label;
    EXPECT_LE((alone.cost.exposed_s + 1e-5) / (opt.exposed_s + 1e-5), 1.5) << x.label;
  }
}

// Issue 43's bar for the downgrade (within 1.5x of the optimum for the rest of the chunk at the
// observed load), against the exact reference with the operators that ran pinned, on unseen
// chunks of planner_first_answer_study gate-reference 4343 (GateInstances 4343: the gate of a
// random layer sees 1.3-2.6, the budget drawn below keep-all at load 1), alone and with the warm
// plan of the observed load (the full search of the whole chunk there, as PlanAfterGate finds it
// cached with the warm-up), its operators that ran set back to their plan. Before the operator DP
// over the rest of the chunk (the priced candidates, the warm plan and the fixed rule only): #8,
// #38, #68 and #83 alone recomputed 0.9-3.6 ms where the optimum exposes nothing (90-362x), and
// #57 and #87 were 9.4x and 8.3x with the warm plan too (a keep and an offload traded at once).
TEST(ReplanAfterGate, TheRestOfTheChunkAgainstTheExactReference) {
  ExpectTheRestWithinTheBar(4343, {8, 38, 57, 68, 83, 87});
}

// The worst downgrades of the studies of other seeds, each a chunk whose copies nearly fill the
// forward's window: one search thinned the pinned optimum's label away (3.61x on 9191's #23,
// 2.12x on 4343's #7, 1.94x and 2.29x on 4344's #57 and #89); the searches again below the best
// plan so far cut the labels that cannot beat it by cost (operator_dp.cc, Extra) before thinning.
TEST(ReplanAfterGate, TheWorstDowngradesOfTheStudiesAgainstTheExactReference) {
  ExpectTheRestWithinTheBar(9191, {23});
  ExpectTheRestWithinTheBar(4343, {7});
  ExpectTheRestWithinTheBar(4344, {57, 89});
}

}  // namespace
}  // namespace bgl::plan
