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
  EXPECT_EQ(*ParseBytes("2kib", "x"), 2048);
  EXPECT_EQ(*ParseBytes("1TB", "x"), int64_t{1'000'000'000'000});
  EXPECT_EQ(*ParseBytes("3B", "x"), 3);
  // Whole byte counts stay exact past 2^53; fractions are rounded to whole bytes.
  EXPECT_EQ(*ParseBytes("9007199254740993", "x"), int64_t{9007199254740993});
  EXPECT_EQ(*ParseBytes("0.3KiB", "x"), 307);
}

TEST(ParseBytes, RefusesABareUnitNamingBothSpellings) {
  for (const char* text : {"8G", "8g", "8 G"}) {
    auto r = ParseBytes(text, "--capacity");
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_NE(
        r.status().message().find("--capacity: '" + std::string(text) +
                                  "' is ambiguous: write 8GiB (2^30 bytes each) or 8GB (10^9)"),
        std::string::npos)
        << r.status().message();
  }
  EXPECT_NE(
      ParseBytes("512K", "x").status().message().find("512KiB (2^10 bytes each) or 512KB (10^3)"),
      std::string::npos);
  EXPECT_NE(ParseBytes("1.5M", "x").status().message().find("1.5MiB (2^20 bytes each) or 1.5MB"),
            std::string::npos);
  EXPECT_NE(ParseBytes("2t", "x").status().message().find("2TiB (2^40 bytes each) or 2TB (10^12)"),
            std::string::npos);
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
  EXPECT_FALSE(ParseBytes("0x10", "x").ok());
  EXPECT_FALSE(ParseBytes("1.2.3MiB", "x").ok());
  EXPECT_FALSE(ParseBytes("9223372036854775808", "x").ok());  // 2^63: out of range
  EXPECT_FALSE(ParseBytes("8388608TiB", "x").ok());           // 2^63 bytes
}

TEST(FormatBytes, ReadsWell) {
  EXPECT_EQ(FormatBytes(512), "512 B");
  EXPECT_EQ(FormatBytes(1.25 * (1 << 30)), "1.25 GiB");
  EXPECT_EQ(FormatBytes(1010.0 * (1 << 20)), "0.99 GiB");  // at most three integer digits
  EXPECT_EQ(FormatBytes(12.5 * (1 << 20)), "12.5 MiB");
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBytes(999), "999 B");
  EXPECT_EQ(FormatBytes(1000), "0.98 KiB");
  EXPECT_EQ(FormatBytes(399.0 * (1 << 20)), "399 MiB");
  EXPECT_EQ(FormatBytes(20.0 * (1 << 30)), "20.0 GiB");
  // Where the exact figure matters, the count follows in parentheses.
  EXPECT_EQ(FormatBytes(12638097408.0, true), "11.8 GiB (12638097408 bytes)");
  EXPECT_EQ(FormatBytes(512, true), "512 B");
  EXPECT_EQ(FormatSeconds(2.5e-3), "2.50 ms");
}

}  // namespace
}  // namespace bgl
