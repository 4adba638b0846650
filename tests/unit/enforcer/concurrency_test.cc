// Several threads offloading, reloading and releasing their own tensors while another evicts
// under pressure (label tsan).
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "tests/unit/enforcer/test_env.h"

namespace bgl::enf::testing {
namespace {

TEST(EnforcerConcurrency, ThreadsMoveTheirTensorsWhileEvictionRuns) {
  Env env(std::size_t{64} << 20, 64 << 20);
  std::atomic<bool> stop{false};
  std::atomic<int> failures{0};
  auto worker = [&](int id) {
    HostStream compute;
    std::mt19937 rng(id);
    for (int iter = 0; iter < 40; ++iter) {
      const std::size_t bytes = 1000 + rng() % 200000;
      std::vector<std::uint8_t> data(bytes);
      for (auto& b : data) b = static_cast<std::uint8_t>(rng());
      void* p = env.pool->allocate(bytes, &compute);
      if (p == nullptr) {
        ++failures;
        continue;
      }
      std::memcpy(p, data.data(), bytes);
      TensorDesc d{p, bytes, ElemType::kBytes, iter, -1, id, &compute, true};
      std::uint64_t h = 0;
      if (env.enf->register_tensor(d, &h) != Status::kOk) {
        ++failures;
        continue;
      }
      env.enf->add_consumer(h, 1);
      env.enf->add_consumer(h, 2);
      if (iter % 3 == 0) env.enf->apply(h, Strategy::kOffload);  // may already be evicted
      void *a = nullptr, *b = nullptr;
      if (env.enf->acquire(h, 1, &compute, &a) != Status::kOk ||
          env.enf->acquire(h, 2, &compute, &b) != Status::kOk || a != b) {
        ++failures;
        continue;
      }
      compute.synchronize();
      if (std::memcmp(a, data.data(), bytes) != 0) ++failures;
      env.enf->release(h, 1, &compute);
      env.enf->release(h, 2, &compute);
    }
    compute.synchronize();
  };
  std::thread evictor([&] {
    while (!stop) {
      std::size_t freed = 0;
      env.enf->evict(1 << 20, &freed);
      env.enf->stats();
      std::this_thread::yield();
    }
  });
  std::vector<std::thread> threads;
  for (int i = 0; i < 3; ++i) threads.emplace_back(worker, i);
  for (auto& t : threads) t.join();
  stop = true;
  evictor.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(env.enf->stats().tracked, 0u);
}

}  // namespace
}  // namespace bgl::enf::testing
