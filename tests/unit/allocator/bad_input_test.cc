// Bad input the pool and the configuration must name rather than mistake: a second free of a
// block that already merged into its neighbour (two threads freeing the same pointer at once)
// is a double free, not a foreign pointer; absurd capacities are refused.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "allocator/config.h"
#include "tests/unit/allocator/test_util.h"

namespace bgl::alloc {
namespace {

using testing::kMiB;
using testing::make_pool;

TEST(BadInputTest, SecondFreeAfterMergeIsADoubleFree) {
  auto p = make_pool(64 * kMiB);
  void* a = p->allocate(4096, nullptr);
  void* b = p->allocate(4096, nullptr);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(p->deallocate(a, 4096, nullptr), Status::kOk);
  EXPECT_EQ(p->deallocate(b, 4096, nullptr), Status::kOk);  // merges with a's block
  EXPECT_EQ(p->deallocate(b, 4096, nullptr), Status::kDoubleFree);
  EXPECT_EQ(p->deallocate(a, 4096, nullptr), Status::kDoubleFree);
  const Stats st = p->stats();
  EXPECT_EQ(st.num_double_free, 2u);
  EXPECT_EQ(st.num_foreign_free, 0u);
  // A pointer that never was an allocation stays foreign.
  int local = 0;
  EXPECT_EQ(p->deallocate(&local, 4, nullptr), Status::kForeignPointer);
  EXPECT_EQ(p->stats().num_foreign_free, 1u);
}

TEST(BadInputTest, SimultaneousDoubleFreesAreCountedAsDoubleFrees) {
  auto p = make_pool(256 * kMiB);
  constexpr int kRounds = 300;
  int doubles = 0;
  for (int r = 0; r < kRounds; ++r) {
    std::vector<void*> ptrs;
    for (int i = 0; i < 4; ++i) ptrs.push_back(p->allocate(4096 * (i + 1), nullptr));
    std::atomic<int> go{0};
    std::atomic<int> results[2] = {0, 0};
    auto freer = [&](int who) {
      go.fetch_add(1);
      while (go.load() < 2) {
      }
      for (void* q : ptrs) {
        if (p->deallocate(q, 0, nullptr) == Status::kDoubleFree) results[who].fetch_add(1);
      }
    };
    std::thread t0(freer, 0), t1(freer, 1);
    t0.join();
    t1.join();
    doubles += results[0].load() + results[1].load();
  }
  const Stats st = p->stats();
  EXPECT_EQ(doubles, kRounds * 4);
  EXPECT_EQ(st.num_double_free, static_cast<std::uint64_t>(kRounds * 4));
  EXPECT_EQ(st.num_foreign_free, 0u);
  EXPECT_EQ(st.allocations.current, 0);
}

TEST(BadInputTest, AbsurdCapacityAndPageSizeAreRefused) {
  Config c;
  std::string err;
  EXPECT_FALSE(parse_config("capacity:8192TiB", &c, &err));
  EXPECT_NE(err.find("'capacity'"), std::string::npos) << err;
  EXPECT_NE(err.find("at most 64TiB"), std::string::npos) << err;
  EXPECT_FALSE(parse_config("capacity:65TiB", &c, &err));
  EXPECT_TRUE(parse_config("capacity:64TiB", &c, &err)) << err;
  EXPECT_FALSE(parse_config("page_size:2TiB", &c, &err));
  EXPECT_NE(err.find("'page_size'"), std::string::npos) << err;
}

}  // namespace
}  // namespace bgl::alloc
