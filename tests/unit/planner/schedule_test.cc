#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>

#include "governor/planner/pipeline_schedule.h"

namespace bgl::plan {
namespace {

void CheckWellFormed(const std::vector<Step>& steps, int mbs, int chunks, int max_live) {
  std::set<std::pair<int, int>> live, done;
  int peak = 0;
  for (const Step& s : steps) {
    const auto unit = std::pair{s.micro_batch, s.chunk};
    if (s.forward) {
      ASSERT_FALSE(live.count(unit) || done.count(unit));
      live.insert(unit);
    } else {
      ASSERT_TRUE(live.count(unit)) << "backward before forward: " << s.micro_batch;
      live.erase(unit);
      done.insert(unit);
    }
    peak = std::max(peak, static_cast<int>(live.size()));
  }
  EXPECT_TRUE(live.empty());
  EXPECT_EQ(done.size(), static_cast<size_t>(mbs * chunks));
  EXPECT_EQ(peak, max_live);
}

TEST(Schedule, OneFOneB) {
  for (int rank = 0; rank < 4; ++rank) {
    auto steps = BuildSchedule(4, rank, 8, 1);
    ASSERT_TRUE(steps.ok());
    const int w = 4 - rank - 1;
    CheckWellFormed(*steps, 8, 1, w + 1);
    int warm = 0, cool = 0;
    for (const Step& s : *steps) {
      warm += s.phase == Phase::kWarmup;
      cool += s.phase == Phase::kCooldown;
    }
    EXPECT_EQ(warm, w);
    EXPECT_EQ(cool, w);
    EXPECT_EQ(ForwardsUntilNextBackward(*steps, 0), w + 1);
  }
}

TEST(Schedule, InterleavedMatchesMegatron) {
  // PP 8, 2 chunks, 32 micro-batches: rank 0 warms up with (8-1)*2 + (2-1)*8 = 22 forwards.
  auto steps = BuildSchedule(8, 0, 32, 2);
  ASSERT_TRUE(steps.ok());
  EXPECT_EQ(WarmupForwards(8, 0, 32, 2), 22);
  CheckWellFormed(*steps, 32, 2, 23);
  // The first eight forwards are micro-batches 0..7 of chunk 0, then chunk 1.
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ((*steps)[i].micro_batch, i);
    EXPECT_EQ((*steps)[i].chunk, 0);
    EXPECT_EQ((*steps)[8 + i].chunk, 1);
  }
  // Backwards start with the last chunk.
  for (const Step& s : *steps) {
    if (!s.forward) {
      EXPECT_EQ(s.chunk, 1);
      EXPECT_EQ(s.micro_batch, 0);
      break;
    }
  }
}

TEST(Schedule, BadArguments) {
  EXPECT_FALSE(BuildSchedule(4, 4, 8, 1).ok());
  EXPECT_FALSE(BuildSchedule(4, 0, 0, 1).ok());
  EXPECT_FALSE(BuildSchedule(4, 0, 6, 2).ok());  // interleaving needs B % P == 0
  EXPECT_FALSE(ParsePhase("middle").ok());
  // Counts past the bound are an error naming it, not gigabytes of steps (planner_capi_fuzz).
  auto huge = BuildSchedule(4, 0, 1 << 30, 2);
  ASSERT_FALSE(huge.ok());
  EXPECT_NE(huge.status().message().find("at most"), std::string::npos);
  EXPECT_FALSE(BuildSchedule(1 << 30, 0, 4, 4).ok());
  EXPECT_TRUE(BuildSchedule(4, 0, 1 << 10, 2).ok());
}

}  // namespace
}  // namespace bgl::plan
