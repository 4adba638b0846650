#include "governor/planner/dual_batch.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <random>

#include "governor/planner/model_config.h"

namespace bgl::plan {
namespace {

// Brute force over every interleaving: every sequence of rounds, no memoisation.
double BruteForce(const Chains& chains, std::array<int, kChainCount> pos) {
  bool done = true;
  for (int c = 0; c < kChainCount; ++c) done &= pos[c] == static_cast<int>(chains[c].size());
  if (done) return 0;
  double best = std::numeric_limits<double>::infinity();
  for (unsigned mask = 1; mask < 16; ++mask) {
    std::array<int, kChainCount> issued{-1, -1, -1, -1};
    auto next = pos;
    bool valid = true;
    for (int c = 0; c < kChainCount; ++c) {
      if (!(mask & (1u << c))) continue;
      if (pos[c] >= static_cast<int>(chains[c].size())) valid = false;
      issued[c] = pos[c];
      ++next[c];
    }
    if (!valid) continue;
    best = std::min(best, RoundTime(chains, issued) + BruteForce(chains, next));
  }
  return best;
}

// Up to three stages per chain and seven in all, so the unmemoised brute force stays small.
Chains RandomChains(std::mt19937& rng) {
  std::uniform_int_distribution<int> len(0, 3);
  std::array<int, kChainCount> lengths;
  do {
    for (int& l : lengths) l = len(rng);
  } while (lengths[0] + lengths[1] + lengths[2] + lengths[3] > 7);
  std::uniform_real_distribution<double> dur(0.1, 5.0);
  std::uniform_int_distribution<int> res(0, 1);
  Chains chains;
  for (int c = 0; c < kChainCount; ++c) {
    for (int i = 0; i < lengths[c]; ++i) {
      Resource r;
      if (c == 0 || c == 1)
        r = res(rng) ? Resource::kCompute : Resource::kComm;
      else if (c == 2)
        r = Resource::kD2H;
      else
        r = res(rng) ? Resource::kH2D : Resource::kCompute;
      chains[c].push_back({r, dur(rng), i, i});
    }
  }
  return chains;
}

TEST(DualBatch, EqualsBruteForceAndKeepsChainOrder) {
  std::mt19937 rng(42);
  for (int instance = 0; instance < 300; ++instance) {
    const Chains chains = RandomChains(rng);
    const DualBatchSchedule s = SolveDualBatch(chains);
    const double brute = BruteForce(chains, {0, 0, 0, 0});
    ASSERT_NEAR(s.overlapped_s, brute, 1e-9) << "instance " << instance;
    // The issue order replays to the same time and never reorders a chain.
    std::array<int, kChainCount> next{0, 0, 0, 0};
    double replayed = 0;
    for (const IssueRound& round : s.rounds) {
      for (int c = 0; c < kChainCount; ++c) {
        if (round.stage[c] < 0) continue;
        ASSERT_EQ(round.stage[c], next[c]) << "chain " << c << " reordered";
        ++next[c];
      }
      replayed += RoundTime(chains, round.stage);
    }
    for (int c = 0; c < kChainCount; ++c) ASSERT_EQ(next[c], static_cast<int>(chains[c].size()));
    EXPECT_NEAR(replayed, s.overlapped_s, 1e-9);
    EXPECT_LE(s.overlapped_s, s.serial_s + 1e-12);
  }
}

TEST(DualBatch, OverlapsIndependentResources) {
  Chains chains;
  chains[0] = {{Resource::kCompute, 3, 0, 0}};
  chains[2] = {{Resource::kD2H, 2, 0, 0}};
  chains[3] = {{Resource::kH2D, 1, 0, 0}};
  const auto s = SolveDualBatch(chains);
  EXPECT_DOUBLE_EQ(s.overlapped_s, 3);
  EXPECT_DOUBLE_EQ(s.serial_s, 6);
  EXPECT_EQ(s.rounds.size(), 1u);
}

TEST(DualBatch, ChainsSplitAtCommunication) {
  auto c = LoadModelConfig(std::string(BGL_MODELS_DIR) + "/glm-423b-a30b.json");
  HardwareProfile hw = *HardwareProfileByName("paper");
  StageGraph g = *BuildStageGraph(*c, hw);
  CostEvaluator eval(g, hw);
  Assignment keep(g.ops.size(), Strategy::kKeep);
  Assignment off = keep;
  off[g.FindOp("L0.expert_fc1")] = Strategy::kOffload;
  off[g.FindOp("L1.expert_act")] = Strategy::kRecompute;
  PointUnits u;
  u.forward = &keep;
  u.backward = &keep;
  u.offload = &off;
  u.recover = &off;
  const Chains chains = BuildChains(eval, u);
  // Per layer: compute, dispatch, compute, combine -> 8 forward stages for 2 layers.
  EXPECT_EQ(chains[0].size(), 8u);
  for (size_t i = 1; i < chains[0].size(); ++i) {
    EXPECT_NE(chains[0][i].resource, chains[0][i - 1].resource);
  }
  ASSERT_FALSE(chains[2].empty());
  EXPECT_EQ(chains[2][0].resource, Resource::kD2H);
  ASSERT_GE(chains[3].size(), 2u);
  EXPECT_EQ(chains[3][0].resource, Resource::kCompute);  // layer 1's recompute comes first
  const auto s = SolveDualBatch(chains);
  EXPECT_LT(s.overlapped_s, s.serial_s);
}

}  // namespace
}  // namespace bgl::plan
