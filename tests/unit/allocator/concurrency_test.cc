// Concurrent use of one pool from several threads and streams (run under ThreadSanitizer).
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "allocator/host_stream.h"
#include "allocator/pool.h"
#include "test_util.h"

namespace bgl::alloc {
namespace {

using testing::kMiB;
using testing::make_pool;

TEST(ConcurrencyTest, ThreadsOnStreamsAllocateFreeAndHandOff) {
  PoolOptions o;
  o.limit_bytes = 96 * kMiB;  // tight enough for steals, releases and some OOMs
  auto p = make_pool(256 * kMiB, o);
  constexpr int kThreads = 4;
  constexpr int kOps = 1500;
  std::vector<std::unique_ptr<HostStream>> streams;
  for (int t = 0; t < kThreads; ++t) streams.push_back(std::make_unique<HostStream>());
  std::mutex handoff_mu;
  std::vector<std::pair<void*, std::size_t>> handoff;  // freed by whichever thread takes it
  std::atomic<bool> corrupt{false};
  std::atomic<bool> stop{false};
  std::thread observer([&] {
    while (!stop.load()) {
      (void)p->stats();
      (void)p->segments();
      std::this_thread::yield();
    }
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<unsigned>(t + 1));
      HostStream* s = streams[t].get();
      std::vector<std::pair<unsigned char*, std::size_t>> mine;
      for (int i = 0; i < kOps; ++i) {
        const int op = static_cast<int>(rng() % 10);
        if (op < 5 || mine.empty()) {
          const std::size_t size = rng() % 2 ? 1 + rng() % 65536 : kMiB + rng() % (6 * kMiB);
          auto* ptr = static_cast<unsigned char*>(p->allocate(size, s));
          if (ptr == nullptr) continue;
          const auto tag = static_cast<unsigned char>(t + 1);
          // The stream's queued work owns the bytes until it runs.
          s->enqueue(
              [ptr, size, tag] { std::memset(ptr, tag, std::min<std::size_t>(size, 4096)); });
          mine.emplace_back(ptr, size);
        } else if (op < 8) {
          auto [ptr, size] = mine.back();
          mine.pop_back();
          s->enqueue([ptr, size, &corrupt, t] {
            if (ptr[0] != static_cast<unsigned char>(t + 1) ||
                ptr[std::min<std::size_t>(size, 4096) - 1] != static_cast<unsigned char>(t + 1)) {
              corrupt = true;
            }
          });
          EXPECT_EQ(p->deallocate(ptr, size, s), Status::kOk);
        } else if (op < 9) {
          s->synchronize();  // hand a finished block to another thread
          auto [ptr, size] = mine.back();
          mine.pop_back();
          std::lock_guard<std::mutex> lock(handoff_mu);
          handoff.emplace_back(ptr, size);
        } else {
          std::pair<void*, std::size_t> item{nullptr, 0};
          {
            std::lock_guard<std::mutex> lock(handoff_mu);
            if (!handoff.empty()) {
              item = handoff.back();
              handoff.pop_back();
            }
          }
          if (item.first != nullptr) {
            EXPECT_EQ(p->deallocate(item.first, item.second, s), Status::kOk);
          }
          if (i % 200 == 0) p->empty_cache();
        }
      }
      s->synchronize();
      for (auto [ptr, size] : mine) p->deallocate(ptr, size, s);
    });
  }
  for (auto& th : threads) th.join();
  stop = true;
  observer.join();
  for (auto [ptr, size] : handoff) p->deallocate(ptr, size, nullptr);
  for (auto& s : streams) s->synchronize();
  EXPECT_FALSE(corrupt.load());
  std::string why;
  EXPECT_TRUE(p->check_invariants(&why)) << why;
  EXPECT_EQ(p->stats().allocated_bytes.current, 0);
  p->empty_cache();
  EXPECT_EQ(p->stats().reserved_bytes.current, 0);
}

}  // namespace
}  // namespace bgl::alloc
