// The host backend's streaming copy: byte-exact for every size around the threshold and the
// cache line, every alignment of source and destination, and large copies.
#include "kernels/stream_copy.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace bgl::kern {
namespace {

std::vector<std::uint8_t> pattern(std::size_t n, std::uint32_t seed) {
  std::vector<std::uint8_t> v(n);
  std::uint32_t x = seed * 2654435761u + 1;
  for (auto& b : v) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    b = static_cast<std::uint8_t>(x);
  }
  return v;
}

void expect_copy(std::size_t n, std::size_t src_off, std::size_t dst_off) {
  const auto src = pattern(n + src_off, static_cast<std::uint32_t>(n + 31 * src_off));
  // Guard bytes around the destination catch a write past either end.
  std::vector<std::uint8_t> dst(n + dst_off + 64, 0xA5);
  stream_copy_host(dst.data() + dst_off, src.data() + src_off, n);
  for (std::size_t i = 0; i < dst_off; ++i) ASSERT_EQ(dst[i], 0xA5) << "before, n=" << n;
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_EQ(dst[dst_off + i], src[src_off + i])
        << "byte " << i << " of " << n << " (src+" << src_off << ", dst+" << dst_off << ")";
  }
  for (std::size_t i = dst_off + n; i < dst.size(); ++i) ASSERT_EQ(dst[i], 0xA5) << "after";
}

TEST(StreamCopy, SmallCopiesAreExact) {
  for (std::size_t n : {0, 1, 15, 16, 17, 63, 64, 65, 4095}) expect_copy(n, 0, 0);
}

TEST(StreamCopy, EverySizeAroundTheThresholdAndEveryAlignment) {
  for (std::size_t n = kStreamCopyMin - 70; n <= kStreamCopyMin + 130; ++n) {
    for (std::size_t src_off : {0, 1, 8, 15}) {
      for (std::size_t dst_off : {0, 1, 7, 16, 33}) expect_copy(n, src_off, dst_off);
    }
  }
}

TEST(StreamCopy, LargeCopiesAreExact) {
  for (std::size_t n : {std::size_t{1} << 20, (std::size_t{3} << 20) + 77}) {
    expect_copy(n, 3, 5);
    expect_copy(n, 0, 0);
  }
}

}  // namespace
}  // namespace bgl::kern
