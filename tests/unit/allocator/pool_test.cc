// Pool behaviour on the host backend: placement, split/merge, growth, limits, OOM, release.
#include "allocator/pool.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "test_util.h"

namespace bgl::alloc {
namespace {

using testing::kGiB;
using testing::kMiB;
using testing::make_pool;

void expect_ok(const Pool& p) {
  std::string why;
  EXPECT_TRUE(p.check_invariants(&why)) << why;
}

TEST(PoolTest, RoundsToMinimumBlockAndDivisions) {
  auto p = make_pool(kGiB);
  EXPECT_EQ(p->round_size(1), 512u);
  EXPECT_EQ(p->round_size(513), 1024u);
  EXPECT_EQ(p->round_size(1200), 1536u);
  PoolOptions o;
  o.round_divisions = 4;
  auto q = make_pool(kGiB, o);
  EXPECT_EQ(q->round_size(5000), 5120u);  // [4096, 8192) in steps of 1024
  EXPECT_EQ(q->round_size(1200), 1536u);  // steps never go below 512 bytes
  EXPECT_EQ(q->round_size(1024), 1024u);
  EXPECT_EQ(q->round_size(5 * kMiB + 1), 6 * kMiB);
}

TEST(PoolTest, AllocateWriteFreeReuse) {
  auto p = make_pool(kGiB);
  void* a = p->allocate(1000, nullptr);
  ASSERT_NE(a, nullptr);
  std::memset(a, 0x5a, 1000);
  EXPECT_EQ(p->deallocate(a, 1000, nullptr), Status::kOk);
  void* b = p->allocate(1000, nullptr);
  EXPECT_EQ(a, b);  // cache hit
  Stats st = p->stats();
  EXPECT_EQ(st.num_allocs, 2u);
  EXPECT_EQ(st.num_frees, 1u);
  EXPECT_EQ(st.num_maps, 1u);
  EXPECT_EQ(st.reserved_bytes.current, static_cast<std::int64_t>(2 * kMiB));
  EXPECT_EQ(st.allocated_bytes.current, 1024);
  EXPECT_EQ(st.requested_bytes.current, 1000);
  p->deallocate(b, 1000, nullptr);
  expect_ok(*p);
}

TEST(PoolTest, SplitAndMergeRestoreOneFreeBlock) {
  auto p = make_pool(kGiB);
  std::vector<void*> v;
  for (int i = 0; i < 8; ++i) v.push_back(p->allocate(3 * kMiB, nullptr));
  // Contiguous in the large arena: growth extends the free tail, so blocks are adjacent.
  for (int i = 1; i < 8; ++i) {
    EXPECT_EQ(static_cast<char*>(v[i]) - static_cast<char*>(v[i - 1]),
              static_cast<std::ptrdiff_t>(3 * kMiB));
  }
  for (int i : {1, 3, 5, 7, 0, 2, 6, 4}) {
    p->deallocate(v[i], 3 * kMiB, nullptr);
    expect_ok(*p);
  }
  auto segs = p->segments();
  ASSERT_EQ(segs.size(), 1u);
  ASSERT_EQ(segs[0].blocks.size(), 1u);
  EXPECT_EQ(segs[0].blocks[0].state, BlockState::kFree);
  EXPECT_EQ(segs[0].size, 24 * kMiB);
}

TEST(PoolTest, GrowthExtendsAdjacentFreeBlockInsteadOfNewRange) {
  auto p = make_pool(kGiB);
  void* a = p->allocate(3 * kMiB, nullptr);  // maps 4 MiB; 1 MiB free tail
  void* b = p->allocate(4 * kMiB, nullptr);  // extends the tail by 4 MiB... only 3 MiB needed
  EXPECT_EQ(static_cast<char*>(b) - static_cast<char*>(a), static_cast<std::ptrdiff_t>(3 * kMiB));
  EXPECT_EQ(p->stats().reserved_bytes.current, static_cast<std::int64_t>(8 * kMiB));
  EXPECT_EQ(p->stats().segments.current, 1);
  p->deallocate(a, 3 * kMiB, nullptr);
  p->deallocate(b, 4 * kMiB, nullptr);
  expect_ok(*p);
}

TEST(PoolTest, SmallAndLargeRequestsUseSeparateArenas) {
  auto p = make_pool(kGiB);
  void* s = p->allocate(4096, nullptr);
  void* l = p->allocate(8 * kMiB, nullptr);
  auto segs = p->segments();
  ASSERT_EQ(segs.size(), 2u);
  EXPECT_TRUE(segs[0].small);
  EXPECT_FALSE(segs[1].small);
  p->deallocate(s, 4096, nullptr);
  p->deallocate(l, 8 * kMiB, nullptr);
  expect_ok(*p);
}

TEST(PoolTest, CapacityLimitAsFractionAndBytes) {
  PoolOptions o;
  o.limit_fraction = 0.5;
  EXPECT_EQ(make_pool(64 * kMiB, o)->limit(), 32 * kMiB);
  o.limit_bytes = 20 * kMiB;
  EXPECT_EQ(make_pool(64 * kMiB, o)->limit(), 20 * kMiB);
  o.limit_bytes = 128 * kMiB;  // never above the physical capacity
  EXPECT_EQ(make_pool(64 * kMiB, o)->limit(), 64 * kMiB);
}

TEST(PoolTest, OomMessageStatesRequestFreeReservedAndFragmentation) {
  PoolOptions o;
  o.limit_bytes = 16 * kMiB;
  o.defrag = false;
  auto p = make_pool(64 * kMiB, o);
  std::vector<void*> v;
  for (int i = 0; i < 8; ++i) v.push_back(p->allocate(2 * kMiB - 4096, nullptr));
  // Free every other block: 8 MiB cached but in 4 KiB-misaligned pieces that keep pages pinned.
  for (int i = 0; i < 8; i += 2) p->deallocate(v[i], 2 * kMiB - 4096, nullptr);
  void* big = p->allocate(12 * kMiB, nullptr);
  EXPECT_EQ(big, nullptr);
  const std::string msg = last_error();
  EXPECT_NE(msg.find("out of memory on device 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("requested 12.0 MiB (12582912 bytes)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("free "), std::string::npos) << msg;
  EXPECT_NE(msg.find("reserved but unallocated"), std::string::npos) << msg;
  EXPECT_NE(msg.find("fragmentation"), std::string::npos) << msg;
  EXPECT_NE(msg.find("largest free block"), std::string::npos) << msg;
  EXPECT_EQ(p->stats().num_ooms, 1u);
  expect_ok(*p);
  for (int i = 1; i < 8; i += 2) p->deallocate(v[i], 2 * kMiB - 4096, nullptr);
  EXPECT_NE(big = p->allocate(12 * kMiB, nullptr), nullptr);
  p->deallocate(big, 12 * kMiB, nullptr);
  expect_ok(*p);
}

TEST(PoolTest, ReleasesCachedPagesUnderPressure) {
  PoolOptions o;
  o.limit_bytes = 32 * kMiB;
  o.defrag = false;
  auto p = make_pool(64 * kMiB, o);
  void* small = p->allocate(20 * kMiB, nullptr);
  p->deallocate(small, 20 * kMiB, nullptr);
  // A 16 MiB block placed after a live 10 MiB one cannot reuse the cached 20 MiB run fully:
  void* a = p->allocate(10 * kMiB, nullptr);
  void* b = p->allocate(30 * kMiB - 10 * kMiB, nullptr);  // fits only if free pages are reused
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  Stats st = p->stats();
  EXPECT_LE(st.reserved_bytes.current, static_cast<std::int64_t>(32 * kMiB));
  p->deallocate(a, 10 * kMiB, nullptr);
  p->deallocate(b, 20 * kMiB, nullptr);
  // Pressure: a request larger than the cached run forces unmapping and remapping.
  void* c = p->allocate(32 * kMiB, nullptr);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(p->stats().num_ooms, 0u);
  p->deallocate(c, 32 * kMiB, nullptr);
  expect_ok(*p);
}

TEST(PoolTest, EmptyCacheUnmapsFreePagesOnly) {
  auto p = make_pool(kGiB);
  void* keep = p->allocate(3 * kMiB, nullptr);
  void* drop = p->allocate(9 * kMiB, nullptr);
  p->deallocate(drop, 9 * kMiB, nullptr);
  const std::int64_t before = p->stats().reserved_bytes.current;
  const std::size_t released = p->empty_cache();
  const std::int64_t after = p->stats().reserved_bytes.current;
  EXPECT_EQ(before - after, static_cast<std::int64_t>(released));
  EXPECT_EQ(after, static_cast<std::int64_t>(4 * kMiB));  // page holding the live block's tail
  std::memset(keep, 1, 3 * kMiB);                         // still mapped
  p->deallocate(keep, 3 * kMiB, nullptr);
  p->empty_cache();
  EXPECT_EQ(p->stats().reserved_bytes.current, 0);
  EXPECT_EQ(p->stats().segments.current, 0);
  expect_ok(*p);
}

TEST(PoolTest, PressureCallbackGetsBytesNeededAndCanFree) {
  PoolOptions o;
  o.limit_bytes = 16 * kMiB;
  auto p = make_pool(64 * kMiB, o);
  void* hog = p->allocate(12 * kMiB, nullptr);
  std::size_t asked = 0;
  int calls = 0;
  p->add_pressure_callback([&](int device, std::size_t needed) -> std::size_t {
    EXPECT_EQ(device, 0);
    asked = needed;
    ++calls;
    EXPECT_EQ(p->deallocate(hog, 12 * kMiB, nullptr), Status::kOk);  // runs without the lock
    return 12 * kMiB;
  });
  void* x = p->allocate(10 * kMiB, nullptr);
  ASSERT_NE(x, nullptr);
  EXPECT_EQ(calls, 1);
  EXPECT_GE(asked, 6 * kMiB);
  EXPECT_LE(asked, 10 * kMiB);
  Stats st = p->stats();
  EXPECT_EQ(st.num_pressure_calls, 1u);
  EXPECT_EQ(st.pressure_bytes_freed, 12 * kMiB);
  EXPECT_EQ(st.num_ooms, 0u);
  p->deallocate(x, 10 * kMiB, nullptr);
  expect_ok(*p);
}

TEST(PoolTest, SegmentHooksSeeEveryMapAndUnmap) {
  auto p = make_pool(kGiB);
  std::int64_t mapped = 0;
  int maps = 0, unmaps = 0;
  int id = p->add_segment_hook([&](int, void*, std::size_t bytes, bool is_map) {
    mapped += is_map ? static_cast<std::int64_t>(bytes) : -static_cast<std::int64_t>(bytes);
    (is_map ? maps : unmaps)++;
  });
  void* a = p->allocate(5 * kMiB, nullptr);
  void* b = p->allocate(1000, nullptr);
  EXPECT_EQ(mapped, p->stats().reserved_bytes.current);
  p->deallocate(a, 5 * kMiB, nullptr);
  p->deallocate(b, 1000, nullptr);
  p->empty_cache();
  EXPECT_EQ(mapped, 0);
  EXPECT_EQ(maps, 2);
  EXPECT_EQ(unmaps, 2);
  p->remove_segment_hook(id);
  p->deallocate(p->allocate(kMiB * 3, nullptr), 0, nullptr);
  EXPECT_EQ(maps, 2);
}

TEST(PoolTest, SegmentModeCachesAndFreesWholeSegments) {
  auto p = make_pool(kGiB, {}, /*expandable=*/false);
  void* a = p->allocate(3 * kMiB, nullptr);
  void* b = p->allocate(100, nullptr);
  EXPECT_EQ(p->stats().segments.current, 2);
  p->deallocate(a, 3 * kMiB, nullptr);
  void* c = p->allocate(3 * kMiB, nullptr);
  EXPECT_EQ(a, c);
  p->deallocate(c, 3 * kMiB, nullptr);
  p->deallocate(b, 100, nullptr);
  expect_ok(*p);
  p->empty_cache();
  EXPECT_EQ(p->stats().reserved_bytes.current, 0);
  expect_ok(*p);
}

TEST(PoolTest, ZeroAndHugeSizesAreErrorsAndCounted) {
  auto p = make_pool(kGiB);
  ::testing::internal::CaptureStderr();
  PoolOptions o;  // logging on for this pool
  auto loud = std::make_unique<Pool>(std::make_unique<HostBackend>(HostBackendOptions{}), o);
  EXPECT_EQ(loud->allocate(0, nullptr), nullptr);
  EXPECT_EQ(loud->allocate(std::size_t{1} << 62, nullptr), nullptr);
  EXPECT_EQ(loud->allocate(~std::size_t{0}, nullptr), nullptr);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("bgl_alloc: allocation of 0 bytes"), std::string::npos) << err;
  EXPECT_NE(err.find("larger than the capacity limit"), std::string::npos) << err;
  Stats st = loud->stats();
  EXPECT_EQ(st.num_invalid_size, 3u);
  EXPECT_EQ(st.num_ooms, 2u);
  void* ok = loud->allocate(100, nullptr);
  EXPECT_NE(ok, nullptr);
  loud->deallocate(ok, 100, nullptr);
  expect_ok(*loud);
}

TEST(PoolTest, BadFreesAreReportedCountedAndHarmless) {
  PoolOptions o;
  auto p = std::make_unique<Pool>(std::make_unique<HostBackend>(HostBackendOptions{}), o);
  void* a = p->allocate(4096, nullptr);
  void* b = p->allocate(8192, nullptr);
  int local = 0;
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(p->deallocate(&local, 4, nullptr), Status::kForeignPointer);
  EXPECT_EQ(p->deallocate(static_cast<char*>(a) + 16, 0, nullptr), Status::kForeignPointer);
  EXPECT_EQ(p->deallocate(a, 4096, nullptr), Status::kOk);
  EXPECT_EQ(p->deallocate(a, 4096, nullptr), Status::kDoubleFree);
  EXPECT_EQ(p->deallocate(b, 100, nullptr), Status::kWrongSize);  // freed anyway
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("not an allocation of this allocator"), std::string::npos) << err;
  EXPECT_NE(err.find("double free"), std::string::npos) << err;
  EXPECT_NE(err.find("allocated with size 8192"), std::string::npos) << err;
  Stats st = p->stats();
  EXPECT_EQ(st.num_foreign_free, 2u);
  EXPECT_EQ(st.num_double_free, 1u);
  EXPECT_EQ(st.num_wrong_size, 1u);
  EXPECT_EQ(st.allocated_bytes.current, 0);
  expect_ok(*p);
  void* c = p->allocate(4096, nullptr);
  EXPECT_NE(c, nullptr);
  p->deallocate(c, 4096, nullptr);
  expect_ok(*p);
}

TEST(PoolTest, DefragKeepsReservedNearAllocatedWhenSizesDrift) {
  PoolOptions o;
  o.defrag_slack = 0.0;
  auto p = make_pool(4 * kGiB, o);
  std::int64_t peak_live = 0;
  // Each step holds blocks of a growing size while older, smaller holes cannot fit them.
  std::vector<void*> keep;
  for (int step = 0; step < 12; ++step) {
    std::size_t sz = (8 + step) * kMiB + 12345;
    std::vector<void*> v;
    for (int i = 0; i < 6; ++i) v.push_back(p->allocate(sz, nullptr));
    keep.push_back(p->allocate(kMiB / 2 + 77, nullptr));
    peak_live = std::max(peak_live, p->stats().allocated_bytes.current);
    for (void* x : v) p->deallocate(x, sz, nullptr);
    expect_ok(*p);
  }
  Stats st = p->stats();
  // Reserved peak stays within a few pages per live block of the live peak.
  EXPECT_LE(st.reserved_bytes.peak, peak_live + static_cast<std::int64_t>(16 * kMiB));
  for (void* x : keep) p->deallocate(x, kMiB / 2 + 77, nullptr);
  expect_ok(*p);
}

}  // namespace
}  // namespace bgl::alloc
