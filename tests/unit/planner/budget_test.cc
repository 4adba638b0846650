#include "governor/planner/budget.h"

#include <gtest/gtest.h>

#include <random>

#include "governor/planner/pipeline_schedule.h"

namespace bgl::plan {
namespace {

TEST(AssignBudget, EvenShareNeverBelowM0) {
  auto d = AssignBudget(100, 20, 4, 5);
  EXPECT_FALSE(d.infeasible);
  EXPECT_DOUBLE_EQ(d.budget, 20);
  d = AssignBudget(100, 90, 1, 5);
  EXPECT_DOUBLE_EQ(d.budget, 10);
  d = AssignBudget(100, 90, 3, 5);  // 10 free for 3 batches of at least 5: pressure
  EXPECT_TRUE(d.infeasible);
  EXPECT_DOUBLE_EQ(d.budget, 5);
}

// Replays Algorithm 1 over a schedule where each forward consumes a random fraction of its
// budget, or overshoots it on a 2.6x spike when deferred planning cannot help.
struct ReplayResult {
  double max_used = 0;
  bool stayed_feasible = true;
};

ReplayResult Replay(const std::vector<Step>& steps, double m_max, double m0, std::mt19937& rng,
                    bool spikes_obey_budget) {
  BudgetTracker tracker(m_max, m0);
  std::uniform_real_distribution<double> use(0.3, 1.0);
  std::bernoulli_distribution spike(0.03);
  ReplayResult out;
  for (size_t i = 0; i < steps.size(); ++i) {
    const Step& s = steps[i];
    if (!s.forward) {
      tracker.OnBackward(s.micro_batch, s.chunk);
      continue;
    }
    const BudgetDecision d = tracker.OnForward(ForwardsUntilNextBackward(steps, i));
    if (d.infeasible) {
      out.stayed_feasible = false;
      continue;
    }
    double actual = std::max(m0, d.budget * use(rng));
    if (spike(rng)) actual = spikes_obey_budget ? d.budget : std::max(m0, actual * 2.6);
    tracker.OnReport(s.micro_batch, s.chunk, actual);
    out.max_used = std::max(out.max_used, tracker.used());
  }
  return out;
}

TEST(BudgetTracker, NeverSumsPastCapacityWhileM0IsFeasible) {
  std::mt19937 rng(2026);
  for (int trial = 0; trial < 500; ++trial) {
    std::uniform_int_distribution<int> pp(2, 8), rank_pick(0, 7), mbs_mult(1, 4), chunks(1, 2);
    const int p = pp(rng);
    const int rank = rank_pick(rng) % p;
    const int v = chunks(rng);
    const int mbs = p * mbs_mult(rng);
    auto steps = BuildSchedule(p, rank, mbs, v);
    ASSERT_TRUE(steps.ok());
    const double m0 = 1.0;
    const double m_max = (WarmupForwards(p, rank, mbs, v) + 1) * m0 * (1.0 + trial % 7);
    const ReplayResult r = Replay(*steps, m_max, m0, rng, /*spikes_obey_budget=*/true);
    EXPECT_TRUE(r.stayed_feasible) << "trial " << trial;
    EXPECT_LE(r.max_used, m_max * (1 + 1e-12)) << "trial " << trial;
  }
}

TEST(BudgetTracker, OverEstimateRaisesLaterBudgets) {
  BudgetTracker tracker(100, 1);
  const double first = tracker.OnForward(4).budget;  // 25
  tracker.OnReport(0, 0, first);                     // predicted: full share
  const double if_predicted = tracker.OnForward(3).budget;
  tracker.OnReport(0, 0, 10);  // the real consumption was lower: re-base
  const double rebased = tracker.OnForward(3).budget;
  EXPECT_GT(rebased, if_predicted);
  EXPECT_DOUBLE_EQ(rebased, 30);
}

TEST(BudgetTracker, WarmupSpikeShrinksLaterWarmupBudgets) {
  BudgetTracker tracker(100, 1);
  const double b0 = tracker.OnForward(4).budget;
  tracker.OnReport(0, 0, b0 * 2.6);  // a 2.6x spike the plan could not absorb
  const double b1 = tracker.OnForward(3).budget;
  EXPECT_LT(b1, b0);
  // The remaining warmup batches still fit: three budgets of b1 sum to what is left.
  EXPECT_NEAR(3 * b1, 100 - b0 * 2.6, 1e-9);
}

TEST(BudgetTracker, BackwardReleasesToTheNextForward) {
  BudgetTracker tracker(100, 1);
  tracker.OnReport(0, 0, 40);
  tracker.OnReport(1, 0, 40);
  EXPECT_DOUBLE_EQ(tracker.OnForward(1).budget, 20);
  tracker.OnBackward(0, 0);
  EXPECT_DOUBLE_EQ(tracker.OnForward(1).budget, 60);
  tracker.OnBackward(0, 0);  // a second release of the same batch changes nothing
  EXPECT_DOUBLE_EQ(tracker.used(), 40);
}

}  // namespace
}  // namespace bgl::plan
