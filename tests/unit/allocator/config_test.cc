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

TEST(ConfigTest, SizesFollowTheOneRule) {
  Config c;
  std::string err;
  ASSERT_TRUE(parse_config("capacity:1.5GiB,limit:2GB,small_max:4096", &c, &err)) << err;
  EXPECT_EQ(c.capacity, std::size_t{3} << 29);
  EXPECT_EQ(c.pool.limit_bytes, 2000000000u);
  EXPECT_EQ(c.pool.small_max, 4096u);
  // A bare K/M/G/T is refused (binary or decimal?), the message names the key and both spellings.
  EXPECT_FALSE(parse_config("capacity:512M", &c, &err));
  EXPECT_NE(
      err.find("key 'capacity': '512M' is ambiguous: write 512MiB (2^20 bytes each) or 512MB"),
      std::string::npos)
      << err;
  EXPECT_FALSE(parse_config("capacity:12XB", &c, &err));
  EXPECT_FALSE(parse_config("capacity:-1", &c, &err));
  EXPECT_FALSE(parse_config("capacity:99999999999TiB", &c, &err));
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
