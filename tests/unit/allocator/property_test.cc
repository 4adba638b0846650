// Random operation sequences checked against a shadow model: block structure invariants,
// non-overlap and content of live blocks, and exact statistics.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <vector>

#include "allocator/host_stream.h"
#include "allocator/pool.h"
#include "test_util.h"

namespace bgl::alloc {
namespace {

using testing::kGiB;
using testing::kMiB;
using testing::make_pool;

struct Live {
  std::size_t requested;
  std::size_t rounded;
  unsigned char tag;
};

struct Shadow {
  std::map<std::uintptr_t, Live> live;
  std::int64_t allocated = 0, requested = 0, peak_allocated = 0, peak_requested = 0;
  std::uint64_t allocs = 0, frees = 0;
};

void check(const Pool& p, const Shadow& s) {
  std::string why;
  ASSERT_TRUE(p.check_invariants(&why)) << why;
  Stats st = p.stats();
  ASSERT_EQ(st.allocated_bytes.current, s.allocated);
  ASSERT_EQ(st.requested_bytes.current, s.requested);
  ASSERT_EQ(st.allocated_bytes.peak, s.peak_allocated);
  ASSERT_EQ(st.requested_bytes.peak, s.peak_requested);
  ASSERT_EQ(st.allocations.current, static_cast<std::int64_t>(s.live.size()));
  ASSERT_EQ(st.num_allocs, s.allocs);
  ASSERT_EQ(st.num_frees, s.frees);
  ASSERT_GE(st.reserved_bytes.current, st.allocated_bytes.current);
  ASSERT_LE(static_cast<std::size_t>(st.reserved_bytes.current), p.limit());
  // Live blocks never overlap and keep their contents.
  std::uintptr_t prev_end = 0;
  for (const auto& [addr, l] : s.live) {
    ASSERT_GE(addr, prev_end);
    prev_end = addr + l.rounded;
    const auto* b = reinterpret_cast<const unsigned char*>(addr);
    ASSERT_EQ(b[0], l.tag);
    ASSERT_EQ(b[l.requested - 1], l.tag);
    ASSERT_EQ(b[l.requested / 2], l.tag);
  }
}

void run_sequence(unsigned seed, bool expandable, PoolOptions o, std::size_t capacity, int ops) {
  auto p = make_pool(capacity, o, expandable);
  HostStream s1, s2;
  Stream streams[] = {nullptr, &s1, &s2};
  std::mt19937_64 rng(seed);
  Shadow sh;
  for (int i = 0; i < ops; ++i) {
    const int op = static_cast<int>(rng() % 100);
    if (op < 55 || sh.live.empty()) {
      std::size_t size;
      switch (rng() % 4) {
        case 0:
          size = 1 + rng() % 4096;
          break;
        case 1:
          size = 1 + rng() % kMiB;
          break;
        case 2:
          size = kMiB + rng() % (8 * kMiB);
          break;
        default:
          size = 8 * kMiB + rng() % (40 * kMiB);
          break;
      }
      Stream st = streams[rng() % 3];
      void* ptr = p->allocate(size, st);
      if (ptr == nullptr) continue;  // over the limit: allowed, must leave the pool consistent
      const auto tag = static_cast<unsigned char>(rng());
      auto* b = static_cast<unsigned char*>(ptr);
      b[0] = b[size / 2] = b[size - 1] = tag;
      const std::size_t rounded = p->round_size(size);
      sh.live[reinterpret_cast<std::uintptr_t>(ptr)] = Live{size, rounded, tag};
      sh.allocated += static_cast<std::int64_t>(rounded);
      sh.requested += static_cast<std::int64_t>(size);
      sh.peak_allocated = std::max(sh.peak_allocated, sh.allocated);
      sh.peak_requested = std::max(sh.peak_requested, sh.requested);
      ++sh.allocs;
    } else if (op < 97) {
      auto it = sh.live.begin();
      std::advance(it, static_cast<long>(rng() % sh.live.size()));
      ASSERT_EQ(p->deallocate(reinterpret_cast<void*>(it->first), it->second.requested,
                              streams[rng() % 3]),
                Status::kOk);
      sh.allocated -= static_cast<std::int64_t>(it->second.rounded);
      sh.requested -= static_cast<std::int64_t>(it->second.requested);
      ++sh.frees;
      sh.live.erase(it);
    } else {
      p->empty_cache();
    }
    check(*p, sh);
    if (::testing::Test::HasFatalFailure()) {
      FAIL() << "seed " << seed << " op " << i;
    }
  }
  for (auto& [addr, l] : sh.live)
    p->deallocate(reinterpret_cast<void*>(addr), l.requested, nullptr);
  p->empty_cache();
  std::string why;
  EXPECT_TRUE(p->check_invariants(&why)) << why;
  EXPECT_EQ(p->stats().reserved_bytes.current, 0);
}

TEST(PoolPropertyTest, ExpandableRandomSequencesMatchShadow) {
  for (unsigned seed = 1; seed <= 6; ++seed) {
    PoolOptions o;
    o.defrag = seed % 2 == 0;
    o.round_divisions = seed % 3 == 0 ? 4 : 0;
    run_sequence(seed, true, o, 2 * kGiB, 1500);
  }
}

TEST(PoolPropertyTest, TightLimitRandomSequencesMatchShadow) {
  for (unsigned seed = 11; seed <= 14; ++seed) {
    PoolOptions o;
    o.limit_bytes = 160 * kMiB;  // frequent pressure, releases and OOMs
    o.defrag = seed % 2 == 0;
    run_sequence(seed, true, o, kGiB, 1500);
  }
}

TEST(PoolPropertyTest, SegmentModeRandomSequencesMatchShadow) {
  for (unsigned seed = 21; seed <= 23; ++seed) {
    PoolOptions o;
    o.limit_bytes = seed == 23 ? 200 * kMiB : 0;
    run_sequence(seed, false, o, kGiB, 1500);
  }
}

}  // namespace
}  // namespace bgl::alloc
