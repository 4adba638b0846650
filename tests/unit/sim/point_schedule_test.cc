#include "tools/bgl-sim/point_schedule.h"

#include <gtest/gtest.h>

#include <set>
#include <utility>

namespace bgl::sim {
namespace {

using plan::Chain;
using plan::Resource;

plan::ChainStage Stage(Resource r, double d) {
  plan::ChainStage s;
  s.resource = r;
  s.duration_s = d;
  return s;
}

plan::Chains ExampleChains() {
  plan::Chains c;
  c[0] = {Stage(Resource::kCompute, 1), Stage(Resource::kComm, 2)};
  c[1] = {Stage(Resource::kComm, 1), Stage(Resource::kCompute, 3)};
  c[2] = {Stage(Resource::kD2H, 5)};
  c[3] = {Stage(Resource::kH2D, 1), Stage(Resource::kCompute, 2)};
  return c;
}

TEST(PointScheduleTest, RoundsSerialiseOneResourceAndOverlapOthers) {
  const plan::Chains chains = ExampleChains();
  const auto items = LockstepItems(chains);
  // Round 0: F0 compute 1, B0 comm 1, O0 d2h 5, R0 h2d 1 -> 5.
  // Round 1: F1 comm 2, B1 compute 3, R1 compute 2 -> compute 5.
  const PointSchedule s = ScheduleRounds(items, true);
  EXPECT_DOUBLE_EQ(s.duration_s, 10);
  EXPECT_DOUBLE_EQ(s.forward_end_s, 7);
  ASSERT_EQ(s.intervals.size(), 7u);
  for (const auto& iv : s.intervals) {
    if (iv.chain == Chain::kRecover && iv.stage == 1) {
      EXPECT_DOUBLE_EQ(iv.start_s, 8);  // after B1 on the compute engine
      EXPECT_DOUBLE_EQ(iv.end_s, 10);
    }
  }
}

TEST(PointScheduleTest, SerialRunsForwardRecomputeBackwardOnOneStream) {
  const PointSchedule s = ScheduleSerial(ExampleChains(), true);
  // F 0-3, R's recompute 3-5 (its reload ran 0-1 on H2D), B 5-9; the offload runs 0-5 on D2H.
  EXPECT_DOUBLE_EQ(s.forward_end_s, 3);
  EXPECT_DOUBLE_EQ(s.duration_s, 9);
  for (const auto& iv : s.intervals) {
    if (iv.chain == Chain::kBackward && iv.stage == 0) {
      EXPECT_DOUBLE_EQ(iv.start_s, 5);
    }
    if (iv.chain == Chain::kOffload) {
      EXPECT_DOUBLE_EQ(iv.end_s, 5);
    }
  }
}

TEST(PointScheduleTest, ChainsFromItemsRoundTrips) {
  const plan::Chains chains = ExampleChains();
  const plan::Chains back = ChainsFromItems(LockstepItems(chains));
  for (int c = 0; c < plan::kChainCount; ++c) {
    ASSERT_EQ(back[c].size(), chains[c].size());
    for (size_t i = 0; i < chains[c].size(); ++i) {
      EXPECT_EQ(back[c][i].resource, chains[c][i].resource);
      EXPECT_DOUBLE_EQ(back[c][i].duration_s, chains[c][i].duration_s);
    }
  }
}

TEST(PointScheduleTest, PointsCoverEveryStepOnceAndNeverPairAUnitWithItself) {
  for (int rank : {0, 3, 7}) {
    for (int chunks : {1, 2}) {
      auto steps = plan::BuildSchedule(8, rank, 16, chunks);
      ASSERT_TRUE(steps.ok());
      const auto points = GroupPoints(*steps);
      std::set<std::pair<int, int>> forwards, backwards;
      for (const PointRef& p : points) {
        ASSERT_TRUE(p.f_mb >= 0 || p.b_mb >= 0);
        if (p.f_mb >= 0) {
          EXPECT_TRUE(forwards.insert({p.f_mb, p.f_chunk}).second);
        }
        if (p.b_mb >= 0) {
          EXPECT_TRUE(backwards.insert({p.b_mb, p.b_chunk}).second);
        }
        if (p.f_mb >= 0 && p.b_mb >= 0) {
          EXPECT_FALSE(p.f_mb == p.b_mb && p.f_chunk == p.b_chunk) << "rank " << rank;
        }
      }
      EXPECT_EQ(forwards.size(), 16u * chunks);
      EXPECT_EQ(backwards.size(), 16u * chunks);
    }
  }
}

}  // namespace
}  // namespace bgl::sim
