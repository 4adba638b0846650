#include "tools/bgl-sim/load_trace.h"

#include <gtest/gtest.h>

namespace bgl::sim {
namespace {

TEST(LoadTraceTest, MatchesThePapersDistribution) {
  LoadSpec spec;
  spec.seed = 7;
  auto trace = GenerateLoads(spec, 4000, 2, 32);
  ASSERT_TRUE(trace.ok()) << trace.status().message();
  int spikes = 0;
  for (int it = 0; it < trace->iterations(); ++it) {
    const double worst = trace->MaxLoad(it);
    EXPECT_GE(worst, 1.0);
    EXPECT_LE(worst, spec.spike_max);
    if (trace->spike[it]) {
      ++spikes;
      EXPECT_GE(worst, spec.normal_max);
    } else {
      EXPECT_LT(worst, spec.normal_max) << "iteration " << it;
    }
  }
  // 2.9% of 4000 is 116; allow sampling noise.
  EXPECT_GT(spikes, 80);
  EXPECT_LT(spikes, 155);
}

TEST(LoadTraceTest, SameSeedSameLoads) {
  LoadSpec spec;
  auto a = GenerateLoads(spec, 50, 2, 8);
  auto b = GenerateLoads(spec, 50, 2, 8);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->loads, b->loads);
  spec.seed = 2;
  auto c = GenerateLoads(spec, 50, 2, 8);
  ASSERT_TRUE(c.ok());
  EXPECT_NE(a->loads, c->loads);
}

TEST(LoadTraceTest, ParsesARouterLog) {
  auto trace =
      ParseLoadLog("# router log\n1.0, 1.1 1.05 1\n\n2.6 1 1 1  # spike\n", "log", 2, 4, 1.2);
  ASSERT_TRUE(trace.ok()) << trace.status().message();
  ASSERT_EQ(trace->iterations(), 2);
  EXPECT_EQ(trace->spike[0], 0);
  EXPECT_EQ(trace->spike[1], 1);
  EXPECT_DOUBLE_EQ(trace->loads[1][1][0], 2.6);
}

TEST(LoadTraceTest, RejectsBadLogs) {
  auto short_line = ParseLoadLog("1 1 1\n", "log", 1, 4, 1.2);
  ASSERT_FALSE(short_line.ok());
  EXPECT_NE(short_line.status().message().find("log:1: expected 4"), std::string::npos);
  auto bad_value = ParseLoadLog("1 1 x 1\n", "log", 1, 4, 1.2);
  ASSERT_FALSE(bad_value.ok());
  EXPECT_NE(bad_value.status().message().find("'x'"), std::string::npos);
  EXPECT_FALSE(ParseLoadLog("1 1 0 1\n", "log", 1, 4, 1.2).ok());
  EXPECT_FALSE(ParseLoadLog("# nothing\n", "log", 1, 4, 1.2).ok());
  EXPECT_FALSE(ReadLoadLog("/no/such/file", 1, 4, 1.2).ok());
}

}  // namespace
}  // namespace bgl::sim
