#include "base/units.h"

#include <gtest/gtest.h>

namespace bgl {
namespace {

TEST(ParseBytes, AcceptsPlainAndUnits) {
  EXPECT_EQ(*ParseBytes("4096", "x"), 4096);
  EXPECT_EQ(*ParseBytes("64GiB", "x"), int64_t{64} << 30);
  EXPECT_EQ(*ParseBytes("80GB", "x"), int64_t{80} * 1000 * 1000 * 1000);
  EXPECT_EQ(*ParseBytes("1.5 MiB", "x"), 1536 * 1024);
  EXPECT_EQ(*ParseBytes("512mb", "x"), 512 * 1000 * 1000);
}

TEST(ParseBytes, RejectsBadInputNamingTheValue) {
  auto negative = ParseBytes("-1GiB", "--capacity");
  ASSERT_FALSE(negative.ok());
  EXPECT_NE(negative.status().message().find("--capacity"), std::string::npos);
  EXPECT_NE(negative.status().message().find("non-negative"), std::string::npos);
  EXPECT_FALSE(ParseBytes("lots", "x").ok());
  EXPECT_FALSE(ParseBytes("12 parsecs", "x").ok());
  EXPECT_FALSE(ParseBytes("", "x").ok());
  EXPECT_FALSE(ParseBytes("1e30TiB", "x").ok());
}

TEST(FormatBytes, ReadsWell) {
  EXPECT_EQ(FormatBytes(512), "512 B");
  EXPECT_EQ(FormatBytes(1.25 * (1 << 30)), "1.25 GiB");
  EXPECT_EQ(FormatBytes(1010.0 * (1 << 20)), "1010 MiB");  // never "1.01e+03 MiB"
  EXPECT_EQ(FormatBytes(12.5 * (1 << 20)), "12.5 MiB");
  EXPECT_EQ(FormatSeconds(2.5e-3), "2.50 ms");
}

}  // namespace
}  // namespace bgl
