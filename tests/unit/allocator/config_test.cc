// BGL_ALLOC_CONF parsing: every key, sizes, and errors that name the key or value.
#include "allocator/config.h"

#include <gtest/gtest.h>

namespace bgl::alloc {
namespace {

TEST(ConfigTest, ParsesEveryKey) {
  Config c;
  std::string err;
  ASSERT_TRUE(parse_config(
      "backend:host, devices:2,capacity:8GiB,page_size:64KiB,expandable:false,limit:0.75,"
      "small_max:256KiB,round_divisions:4,defrag:off,defrag_slack:0.1,history:5000,log:0",
      &c, &err))
      << err;
  EXPECT_EQ(c.backend, "host");
  EXPECT_EQ(c.devices, 2);
  EXPECT_EQ(c.capacity, std::size_t{8} << 30);
  EXPECT_EQ(c.page_size, std::size_t{64} << 10);
  EXPECT_FALSE(c.expandable);
  EXPECT_DOUBLE_EQ(c.pool.limit_fraction, 0.75);
  EXPECT_EQ(c.pool.small_max, std::size_t{256} << 10);
  EXPECT_EQ(c.pool.round_divisions, 4u);
  EXPECT_FALSE(c.pool.defrag);
  EXPECT_DOUBLE_EQ(c.pool.defrag_slack, 0.1);
  EXPECT_EQ(c.pool.history, 5000u);
  EXPECT_FALSE(c.pool.log);
  ASSERT_TRUE(parse_config("limit:70GiB", &c, &err));
  EXPECT_EQ(c.pool.limit_bytes, std::size_t{70} << 30);
  ASSERT_TRUE(parse_config("", &c, &err));
}

TEST(ConfigTest, Sizes) {
  std::size_t n = 0;
  EXPECT_TRUE(parse_size("4096", &n));
  EXPECT_EQ(n, 4096u);
  EXPECT_TRUE(parse_size("1.5GiB", &n));
  EXPECT_EQ(n, std::size_t{3} << 29);
  EXPECT_TRUE(parse_size("2GB", &n));
  EXPECT_EQ(n, 2000000000u);
  EXPECT_TRUE(parse_size("512M", &n));
  EXPECT_EQ(n, std::size_t{512} << 20);
  EXPECT_FALSE(parse_size("12XB", &n));
  EXPECT_FALSE(parse_size("", &n));
  EXPECT_FALSE(parse_size("-1", &n));
  EXPECT_FALSE(parse_size("99999999999TiB", &n));
}

TEST(ConfigTest, ErrorsNameKeyAndValue) {
  Config c;
  std::string err;
  EXPECT_FALSE(parse_config("backend:host,colour:blue", &c, &err));
  EXPECT_NE(err.find("unknown key 'colour'"), std::string::npos) << err;
  EXPECT_FALSE(parse_config("capacity:lots", &c, &err));
  EXPECT_NE(err.find("'lots'"), std::string::npos) << err;
  EXPECT_NE(err.find("'capacity'"), std::string::npos) << err;
  EXPECT_FALSE(parse_config("limit:1.5", &c, &err));
  EXPECT_NE(err.find("'limit'"), std::string::npos) << err;
  EXPECT_FALSE(parse_config("backend:tpu", &c, &err));
  EXPECT_NE(err.find("'backend'"), std::string::npos) << err;
  EXPECT_FALSE(parse_config("page_size:3000", &c, &err));
  EXPECT_FALSE(parse_config("round_divisions:3", &c, &err));
  EXPECT_FALSE(parse_config("history", &c, &err));
  EXPECT_NE(err.find("not key:value"), std::string::npos) << err;
}

}  // namespace
}  // namespace bgl::alloc
