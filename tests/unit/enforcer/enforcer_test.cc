// Enforcer on the host backend with real host streams.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "kernels/fp8_cast.h"
#include "tests/unit/enforcer/test_env.h"

namespace bgl::enf::testing {
namespace {

TEST(Enforcer, OffloadThenReloadIsBitIdentical) {
  Env env;
  for (std::size_t bytes : {1, 3, 7, 511, 512, 513, 4095, 4096, 65537, 1048576, 1048579, 3333333}) {
    std::vector<std::uint8_t> data;
    const std::uint64_t h = env.make(bytes, &data);
    ASSERT_EQ(env.enf->offload(h), Status::kOk) << last_error();
    EXPECT_EQ(env.info(h).placement, BGL_PLACE_HOST);
    EXPECT_EQ(env.info(h).device_ptr, nullptr);
    if (bytes % 2) {
      ASSERT_EQ(env.enf->reload(h), Status::kOk);  // explicit prefetch, else acquire
    }
    env.expect_data(h, data);
    ASSERT_EQ(env.enf->release(h, -1, &env.compute), Status::kOk);
  }
  const auto s = env.enf->stats();
  EXPECT_EQ(s.offloads, 12u);
  EXPECT_EQ(s.reloads, 12u);
  EXPECT_EQ(s.tracked, 0u);
  EXPECT_EQ(s.retired, 12u);
}

TEST(Enforcer, DeviceBlockIsNotReusedBeforeItsOffloadCompletes) {
  Env env;
  std::vector<std::uint8_t> data;
  const std::uint64_t h = env.make(1 << 20, &data);
  const void* old = env.info(h).device_ptr;
  Gate gate(env.d2h);  // the D2H copy cannot run yet
  ASSERT_EQ(env.enf->offload(h), Status::kOk);
  // The compute stream allocates and overwrites memory of the same size at once. Handing the
  // offloaded block out now would corrupt the copy still queued on the D2H stream.
  std::vector<void*> scribbled;
  for (int i = 0; i < 4; ++i) {
    void* p = env.pool->allocate(1 << 20, &env.compute);
    ASSERT_NE(p, nullptr);
    EXPECT_NE(p, old);
    std::memset(p, 0xEE, 1 << 20);
    scribbled.push_back(p);
  }
  gate.open();
  env.expect_data(h, data);
  for (void* p : scribbled) env.pool->deallocate(p, 0, &env.compute);
  // Once the copy completed, the block is reusable.
  env.d2h.synchronize();
  EXPECT_EQ(env.enf->release(h, -1, &env.compute), Status::kOk);
}

TEST(Enforcer, ReloadNeverStartsBeforeItsOffloadFinished) {
  Env env;
  for (int round = 0; round < 8; ++round) {
    std::vector<std::uint8_t> data;
    const std::uint64_t h = env.make(300000 + round, &data);
    Gate gate(env.d2h);
    ASSERT_EQ(env.enf->offload(h), Status::kOk);
    ASSERT_EQ(env.enf->reload(h), Status::kOk);  // queued at once on the H2D stream
    gate.open();
    env.expect_data(h, data);
    env.enf->release(h, -1, &env.compute);
  }
}

TEST(Enforcer, CopyWaitCountsTheTimeACallerWasBlockedOnACopy) {
  Env env;
  std::vector<std::uint8_t> data;
  const std::uint64_t h = env.make(1 << 20, &data);
  std::thread opener;
  {
    Gate gate(env.d2h);  // the offload's copy cannot finish before open()
    ASSERT_EQ(env.enf->offload(h), Status::kOk);
    EXPECT_EQ(env.enf->stats().copy_wait_ns, 0u);  // queued, nobody waited
    opener = std::thread([&gate] {
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      gate.open();
    });
    // Blocks until the gate opens: at least the 30 ms the copy was held (a lower bound a
    // loaded machine only lengthens).
    ASSERT_EQ(env.enf->wait_tensor(h), Status::kOk) << last_error();
    opener.join();
  }
  const std::uint64_t blocked = env.enf->stats().copy_wait_ns;
  EXPECT_GE(blocked, 30'000'000u);
  env.expect_data(h, data);  // the reload's wait adds to it, never takes away
  EXPECT_GE(env.enf->stats().copy_wait_ns, blocked);
  ASSERT_EQ(env.enf->release(h, -1, &env.compute), Status::kOk);
}

TEST(Enforcer, TensorWithTwoConsumersMovesOnceAndBothGetIt) {
  Env env;
  std::vector<std::uint8_t> data;
  const std::uint64_t h = env.make(100001, &data);
  ASSERT_EQ(env.enf->add_consumer(h, 5), Status::kOk);
  ASSERT_EQ(env.enf->add_consumer(h, 9), Status::kOk);
  // Both savers' plans say offload: the second apply is a no-op.
  ASSERT_EQ(env.enf->apply(h, Strategy::kOffload), Status::kOk);
  ASSERT_EQ(env.enf->apply(h, Strategy::kOffload), Status::kOk);
  void *p5 = nullptr, *p9 = nullptr;
  ASSERT_EQ(env.enf->acquire(h, 5, &env.compute, &p5), Status::kOk);
  ASSERT_EQ(env.enf->acquire(h, 9, &env.compute, &p9), Status::kOk);
  EXPECT_EQ(p5, p9);
  env.compute.synchronize();
  EXPECT_EQ(std::memcmp(p9, data.data(), data.size()), 0);
  auto s = env.enf->stats();
  EXPECT_EQ(s.offloads, 1u);
  EXPECT_EQ(s.reloads, 1u);
  EXPECT_EQ(s.bytes_d2h, 100001u);
  ASSERT_EQ(env.enf->release(h, 5, &env.compute), Status::kOk);
  EXPECT_EQ(env.enf->stats().tracked, 1u);  // still held by operator 9
  ASSERT_EQ(env.enf->release(h, 9, &env.compute), Status::kOk);
  EXPECT_EQ(env.enf->stats().tracked, 0u);
}

TEST(Enforcer, Fp8StoreFreesTheOriginalAndRestoresTheHostTwinsValues) {
  Env env;
  const std::size_t n = 1000;  // BF16, not a multiple of the block
  std::vector<std::uint8_t> data(2 * n);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0, 2);
  for (std::size_t i = 0; i < n; ++i)
    kern::store_elem(data.data(), kern::DType::kBF16, i, normal(rng));
  void* p = env.pool->allocate(data.size(), &env.compute);
  std::memcpy(p, data.data(), data.size());
  TensorDesc d{p, data.size(), ElemType::kBF16, 0, 0, 0, &env.compute, true};
  std::uint64_t h = 0;
  ASSERT_EQ(env.enf->register_tensor(d, &h), Status::kOk);
  ASSERT_EQ(env.enf->add_consumer(h, 1), Status::kOk);
  ASSERT_EQ(env.enf->add_consumer(h, 2), Status::kOk);
  const auto before = env.pool->stats().allocated_bytes.current;
  ASSERT_EQ(env.enf->apply(h, Strategy::kFp8), Status::kOk);
  ASSERT_EQ(env.enf->apply(h, Strategy::kFp8), Status::kOk);  // second consumer: moved once
  env.compute.synchronize();
  auto i = env.info(h);
  EXPECT_EQ(i.placement, BGL_PLACE_FP8);
  EXPECT_EQ(i.device_ptr, nullptr);
  EXPECT_EQ(i.fp8_bytes, 1008u + 8 * 4);
  // Only the FP8 copy is live now.
  EXPECT_EQ(env.pool->stats().allocated_bytes.current,
            before - static_cast<std::int64_t>(env.pool->round_size(2 * n)) +
                static_cast<std::int64_t>(env.pool->round_size(i.fp8_bytes)));
  std::vector<std::uint8_t> q(n);
  std::vector<float> scales(8);
  kern::cast_to_fp8_host(data.data(), kern::DType::kBF16, n, q.data(), scales.data(), 128);
  std::vector<std::uint8_t> want(2 * n);
  kern::cast_from_fp8_host(q.data(), scales.data(), n, 128, kern::DType::kBF16, want.data());
  env.expect_data(h, want, 1);
  void* p2 = nullptr;
  ASSERT_EQ(env.enf->acquire(h, 2, &env.compute, &p2), Status::kOk);
  EXPECT_EQ(env.enf->stats().fp8_uncasts, 1u);
  EXPECT_EQ(env.info(h).fp8_ptr, nullptr);  // the FP8 copy is gone once restored
  EXPECT_EQ(env.pool->stats().allocated_bytes.current,
            before);  // one full-precision copy again
  env.enf->release(h, 1, &env.compute);
  env.enf->release(h, 2, &env.compute);
}

TEST(Enforcer, RecomputeCallbackFiresOnceWhenTwoConsumersNeedIt) {
  Env env;
  std::vector<std::uint8_t> data;
  const std::uint64_t h = env.make(4096, &data, /*producer=*/4);
  env.enf->add_consumer(h, 7);
  env.enf->add_consumer(h, 8);
  int calls = 0;
  env.enf->set_recompute([&](std::uint64_t handle, int producer, int, void** out) {
    ++calls;
    EXPECT_EQ(handle, h);
    EXPECT_EQ(producer, 4);
    void* p = env.pool->allocate(4096, &env.compute);
    std::memcpy(p, data.data(), 4096);
    *out = p;
    return 0;
  });
  ASSERT_EQ(env.enf->apply(h, Strategy::kRecompute), Status::kOk);
  EXPECT_EQ(env.info(h).placement, BGL_PLACE_DROPPED);
  env.expect_data(h, data, 7);
  env.expect_data(h, data, 8);
  EXPECT_EQ(calls, 1);
  env.enf->release(h, 7, &env.compute);
  env.enf->release(h, 8, &env.compute);
}

TEST(Enforcer, BadInputLeavesStateUnchanged) {
  Env env(std::size_t{256} << 20, /*pinned=*/256 << 10);
  std::vector<std::uint8_t> data;
  const std::uint64_t h = env.make(1 << 20, &data);
  const auto before = env.info(h);

  EXPECT_EQ(env.enf->offload(h + 100), Status::kUnknownHandle);
  EXPECT_NE(last_error().find("unknown tensor handle"), std::string::npos) << last_error();
  void* p = nullptr;
  EXPECT_EQ(env.enf->acquire(h + 100, -1, &env.compute, &p), Status::kUnknownHandle);

  TensorDesc again{before.device_ptr, 1 << 20, ElemType::kBytes, 0, -1, 0, &env.compute, true};
  std::uint64_t h2 = 0;
  EXPECT_EQ(env.enf->register_tensor(again, &h2), Status::kDuplicate);
  EXPECT_NE(last_error().find("already tracked"), std::string::npos) << last_error();
  EXPECT_EQ(env.enf->stats().tracked, 1u);
  env.enf->add_consumer(h, 3);
  EXPECT_EQ(env.enf->add_consumer(h, 3), Status::kDuplicate);

  EXPECT_EQ(env.enf->reload(h), Status::kInvalidState);
  EXPECT_NE(last_error().find("never offloaded"), std::string::npos) << last_error();

  // 1 MiB does not fit in a 256 KiB pinned pool.
  EXPECT_EQ(env.enf->offload(h), Status::kPinnedExhausted);
  EXPECT_NE(last_error().find("pinned host pool exhausted"), std::string::npos) << last_error();
  EXPECT_EQ(env.enf->stats().pinned_failures, 1u);

  EXPECT_EQ(env.enf->store_fp8(h), Status::kInvalidArgument);  // bytes, not floats
  ASSERT_EQ(env.enf->apply(h, Strategy::kRecompute), Status::kOk);
  EXPECT_EQ(env.enf->apply(h, Strategy::kOffload), Status::kConflict);
  EXPECT_NE(last_error().find("already moved by recompute"), std::string::npos) << last_error();
  EXPECT_EQ(env.enf->acquire(h, 3, &env.compute, &p), Status::kCallbackError);  // no callback
  const auto after = env.info(h);
  EXPECT_EQ(after.placement, BGL_PLACE_DROPPED);
  EXPECT_EQ(after.num_consumers, 1);
  EXPECT_EQ(env.enf->unregister(h), Status::kOk);
  EXPECT_EQ(env.enf->unregister(h), Status::kUnknownHandle);
}

TEST(Enforcer, BadInputOnAHealthyTensorKeepsItsBytes) {
  Env env(std::size_t{256} << 20, /*pinned=*/256 << 10);
  std::vector<std::uint8_t> data;
  const std::uint64_t h = env.make(1 << 20, &data);
  const auto before = env.info(h);
  EXPECT_EQ(env.enf->offload(h), Status::kPinnedExhausted);
  EXPECT_EQ(env.enf->reload(h), Status::kInvalidState);
  const auto after = env.info(h);
  EXPECT_EQ(after.placement, before.placement);
  EXPECT_EQ(after.device_ptr, before.device_ptr);
  EXPECT_EQ(after.applied, BGL_STRATEGY_KEEP);
  EXPECT_EQ(env.enf->stats().offloads, 0u);
  env.expect_data(h, data);
  env.enf->release(h, -1, &env.compute);
}

TEST(Enforcer, PressureEvictsTheTensorsNeededLastAndFreesEnough) {
  // 16 MiB device; twelve 1 MiB activations of micro-batches 0..2, producers 0..3.
  Env env(std::size_t{16} << 20);
  std::vector<std::uint64_t> handles;
  std::vector<std::vector<std::uint8_t>> data(12);
  for (int mb = 0; mb < 3; ++mb) {
    for (int op = 0; op < 4; ++op) {
      handles.push_back(env.make(1 << 20, &data[handles.size()], op, mb));
    }
  }
  // Ask for 7 MiB more than fits: the callback must evict about that much.
  const std::size_t free_now =
      env.pool->limit() - static_cast<std::size_t>(env.pool->stats().allocated_bytes.current);
  void* big = env.pool->allocate(free_now + (3 << 20), &env.compute);
  ASSERT_NE(big, nullptr) << last_error();
  const auto s = env.enf->stats();
  EXPECT_GE(s.evicted_bytes, 3u << 20);
  EXPECT_GE(s.pressure_calls, 1u);
  // Evicted: micro-batch 2 first (needed last), within it the earliest operators first.
  std::vector<int> evicted;
  for (std::size_t i = 0; i < handles.size(); ++i) {
    if (env.info(handles[i]).placement == BGL_PLACE_HOST) evicted.push_back(static_cast<int>(i));
  }
  ASSERT_GE(evicted.size(), 3u);
  const std::vector<int> order = {8, 9, 10, 11, 4, 5, 6, 7, 0, 1, 2, 3};
  for (std::size_t k = 0; k < evicted.size(); ++k) {
    EXPECT_NE(std::find(order.begin(), order.begin() + evicted.size(), evicted[k]),
              order.begin() + evicted.size())
        << "evicted tensor " << evicted[k] << " before one needed later";
  }
  env.pool->deallocate(big, 0, &env.compute);
  // Everything comes back intact.
  for (std::size_t i = 0; i < handles.size(); ++i) {
    env.expect_data(handles[i], data[i]);
    env.enf->release(handles[i], -1, &env.compute);
  }
}

TEST(Enforcer, EvictTakesLargestNeedOrderFirst) {
  Env env;
  std::vector<std::uint8_t> data;
  std::vector<std::uint64_t> hs;
  for (int i = 0; i < 5; ++i) hs.push_back(env.make(1 << 20, &data, i, 0));
  env.enf->set_need_order(hs[1], std::int64_t{1} << 60);  // needed last of all
  std::size_t freed = 0;
  ASSERT_EQ(env.enf->evict(std::size_t{3} << 19, &freed), Status::kOk);  // 1.5 MiB -> two
  EXPECT_GE(freed, std::size_t{3} << 19);
  EXPECT_EQ(env.info(hs[1]).placement, BGL_PLACE_HOST);
  EXPECT_EQ(env.info(hs[0]).placement, BGL_PLACE_HOST);  // producer 0: backward reaches it last
  for (int i : {2, 3, 4}) EXPECT_EQ(env.info(hs[i]).placement, BGL_PLACE_DEVICE);
  std::size_t bytes = 0, count = 0;
  env.enf->movable(0, Strategy::kOffload, &bytes, &count);
  EXPECT_EQ(count, 3u);
  EXPECT_EQ(bytes, 3u << 20);
}

TEST(Enforcer, PinnedCapacityFollowsTheGrant) {
  Env env(std::size_t{256} << 20, std::size_t{8} << 20);
  std::vector<std::vector<std::uint8_t>> data(3);
  std::vector<std::uint64_t> hs;
  for (int i = 0; i < 3; ++i) hs.push_back(env.make(std::size_t{1} << 20, &data[i], i, 0));
  ASSERT_EQ(env.enf->apply(hs[0], Strategy::kOffload), Status::kOk);
  ASSERT_EQ(env.enf->set_pinned_capacity(std::size_t{3} << 19), Status::kOk);  // 1.5 MiB
  EXPECT_EQ(env.enf->stats().pinned_capacity, std::size_t{3} << 19);
  EXPECT_EQ(env.enf->apply(hs[1], Strategy::kOffload), Status::kPinnedExhausted);
  EXPECT_EQ(env.info(hs[1]).placement, BGL_PLACE_DEVICE);  // stays where it was
  ASSERT_EQ(env.enf->set_pinned_capacity(std::size_t{8} << 20), Status::kOk);
  ASSERT_EQ(env.enf->apply(hs[1], Strategy::kOffload), Status::kOk);
  for (int i : {0, 1, 2}) env.expect_data(hs[i], data[i]);
}

TEST(Enforcer, PrefetchReloadsInNeedOrderWithinTheBound) {
  Env env(std::size_t{256} << 20, 64 << 20, /*max_inflight=*/2);
  std::vector<std::vector<std::uint8_t>> data(5);
  std::vector<std::uint64_t> hs;
  for (int i = 0; i < 5; ++i) {
    hs.push_back(env.make(4096 + 64 * i, &data[i], i, 3));
    ASSERT_EQ(env.enf->apply(hs[i], Strategy::kOffload), Status::kOk);
    env.enf->set_need_order(hs[i], 10 - i);  // the last produced is needed first
  }
  std::size_t issued = 0;
  ASSERT_EQ(env.enf->prefetch(3, &issued), Status::kOk);
  EXPECT_EQ(issued, 2u);  // the bound
  EXPECT_EQ(env.info(hs[4]).placement, BGL_PLACE_DEVICE);
  EXPECT_EQ(env.info(hs[3]).placement, BGL_PLACE_DEVICE);
  EXPECT_EQ(env.info(hs[2]).placement, BGL_PLACE_HOST);
  ASSERT_EQ(env.enf->prefetch(3, &issued), Status::kOk);
  EXPECT_EQ(issued, 0u);  // both still wait for their consumer
  ASSERT_EQ(env.enf->prefetch(7, &issued), Status::kOk);
  EXPECT_EQ(issued, 0u);            // another micro-batch has nothing offloaded
  env.expect_data(hs[4], data[4]);  // taken: room for one more
  ASSERT_EQ(env.enf->prefetch(3, &issued), Status::kOk);
  EXPECT_EQ(issued, 1u);
  EXPECT_EQ(env.info(hs[2]).placement, BGL_PLACE_DEVICE);
  for (int i : {3, 2, 1, 0}) env.expect_data(hs[i], data[i]);
}

// Prefetch looks at its micro-batch's tensors only (the tracker's index by micro-batch): the
// offloaded tensors of another one stay on the host, retired ones leave the index, and equal
// need orders go in registration order.
TEST(Enforcer, PrefetchTakesItsMicroBatchOnlyAndTiesInRegistrationOrder) {
  Env env(std::size_t{256} << 20, 64 << 20, /*max_inflight=*/2);
  std::vector<std::vector<std::uint8_t>> data(6);
  std::vector<std::uint64_t> hs;
  for (int i = 0; i < 6; ++i) {
    hs.push_back(env.make(4096, &data[i], i, i % 2));  // micro-batches 0, 1, 0, 1, 0, 1
    ASSERT_EQ(env.enf->apply(hs[i], Strategy::kOffload), Status::kOk);
    env.enf->set_need_order(hs[i], 5);
  }
  ASSERT_EQ(env.enf->unregister(hs[1]), Status::kOk);  // retired: gone from the index too
  std::size_t issued = 0;
  ASSERT_EQ(env.enf->prefetch(1, &issued), Status::kOk);
  EXPECT_EQ(issued, 2u);
  EXPECT_EQ(env.info(hs[3]).placement, BGL_PLACE_DEVICE);
  EXPECT_EQ(env.info(hs[5]).placement, BGL_PLACE_DEVICE);
  for (int i : {0, 2, 4}) EXPECT_EQ(env.info(hs[i]).placement, BGL_PLACE_HOST);
  ASSERT_EQ(env.enf->prefetch(0, &issued), Status::kOk);
  EXPECT_EQ(issued, 2u);  // the bound counts the micro-batch's own untaken reloads
  EXPECT_EQ(env.info(hs[0]).placement, BGL_PLACE_DEVICE);
  EXPECT_EQ(env.info(hs[2]).placement, BGL_PLACE_DEVICE);
  EXPECT_EQ(env.info(hs[4]).placement, BGL_PLACE_HOST);
  for (int i : {3, 5}) env.expect_data(hs[i], data[i]);
  for (int i : {0, 2, 4}) env.expect_data(hs[i], data[i]);
}

TEST(Enforcer, PressureGivesBackUntakenReloadsAndTheDataSurvives) {
  Env env(std::size_t{256} << 20, 64 << 20, /*max_inflight=*/4);
  std::vector<std::vector<std::uint8_t>> data(3);
  std::vector<std::uint64_t> hs;
  for (int i = 0; i < 3; ++i) {
    hs.push_back(env.make(std::size_t{1} << 20, &data[i], i, 0));
    ASSERT_EQ(env.enf->apply(hs[i], Strategy::kOffload), Status::kOk);
  }
  ASSERT_EQ(env.enf->prefetch(0, nullptr), Status::kOk);
  env.expect_data(hs[0], data[0]);  // taken: not given back
  std::size_t freed = 0;
  ASSERT_EQ(env.enf->evict(std::size_t{2} << 20, &freed), Status::kOk);
  EXPECT_GE(freed, std::size_t{2} << 20);
  EXPECT_EQ(env.info(hs[0]).placement, BGL_PLACE_DEVICE);
  EXPECT_EQ(env.info(hs[1]).placement, BGL_PLACE_HOST);
  EXPECT_EQ(env.info(hs[2]).placement, BGL_PLACE_HOST);
  EXPECT_EQ(env.enf->stats().unreloads, 2u);
  for (int i : {1, 2}) env.expect_data(hs[i], data[i]);  // reloaded again from the pinned copy
  EXPECT_EQ(env.enf->stats().reloads, 5u);
}

TEST(Enforcer, TakeOffloadedReturnsScheduledOffloadsOnceComplete) {
  Env env(std::size_t{256} << 20, 64 << 20, /*max_inflight=*/4);
  std::vector<std::vector<std::uint8_t>> data(3);
  std::vector<std::uint64_t> hs;
  for (int i = 0; i < 3; ++i) {
    hs.push_back(env.make(8192, &data[i], i, 5));
    ASSERT_EQ(env.enf->set_strategy(hs[i], i == 1 ? Strategy::kKeep : Strategy::kOffload),
              Status::kOk);
    ASSERT_EQ(env.enf->set_graph_index(hs[i], i, 10 + i), Status::kOk);
  }
  EXPECT_EQ(env.enf->set_graph_index(hs[0], -2, 0), Status::kInvalidArgument);
  plan::IssueItem f, o;
  f.chain = plan::Chain::kForward;
  o.chain = plan::Chain::kOffload;
  o.resource = plan::Resource::kD2H;
  o.first = 10;
  o.last = 12;
  ASSERT_EQ(env.enf->schedule_begin({f, o}, 5, -1), Status::kOk);
  std::uint64_t out[4];
  std::size_t n = 9;
  ASSERT_EQ(env.enf->take_offloaded(out, 4, &n), Status::kOk);
  EXPECT_EQ(n, 0u);  // nothing issued before compute reached the round
  ASSERT_EQ(env.enf->schedule_reached(plan::Chain::kForward, 0), Status::kOk);
  ASSERT_EQ(env.enf->schedule_finish(), Status::kOk);
  ASSERT_EQ(env.enf->take_offloaded(out, 1, &n), Status::kOk);  // one at a time
  ASSERT_EQ(n, 1u);
  EXPECT_EQ(out[0], hs[0]);
  ASSERT_EQ(env.enf->take_offloaded(out, 4, &n), Status::kOk);
  ASSERT_EQ(n, 1u);
  EXPECT_EQ(out[0], hs[2]);
  ASSERT_EQ(env.enf->take_offloaded(out, 4, &n), Status::kOk);
  EXPECT_EQ(n, 0u);  // taken once
  EXPECT_EQ(env.enf->take_offloaded(nullptr, 4, &n), Status::kInvalidArgument);
  for (int i = 0; i < 3; ++i) env.expect_data(hs[i], data[i]);
}

}  // namespace
TEST(Enforcer, ScheduledOffloadIsNotTakenBeforeItsCopyRanEvenWhenReloadedMeanwhile) {
  // The package lets the source of a scheduled offload go when take_offloaded reports it. A
  // reload queued behind the copy (the backward began) puts the tensor on the device again
  // before the copy ran: reporting it then let PyTorch reuse the source under the copy, and the
  // backward read what the reload copied back (a NaN loss in CI's interleaved pipeline test).
  Env env(std::size_t{256} << 20, 64 << 20, /*max_inflight=*/4);
  std::vector<std::uint8_t> data;
  const std::uint64_t h = env.make(1 << 16, &data, 0, 5);
  ASSERT_EQ(env.enf->set_strategy(h, Strategy::kOffload), Status::kOk);
  ASSERT_EQ(env.enf->set_graph_index(h, 0, 10), Status::kOk);
  plan::IssueItem f, o;
  f.chain = plan::Chain::kForward;
  o.chain = plan::Chain::kOffload;
  o.resource = plan::Resource::kD2H;
  o.first = o.last = 10;
  ASSERT_EQ(env.enf->schedule_begin({f, o}, 5, -1), Status::kOk);
  Gate gate(env.d2h);  // the D2H copy cannot run yet
  ASSERT_EQ(env.enf->schedule_reached(plan::Chain::kForward, 0), Status::kOk);
  ASSERT_EQ(env.info(h).placement, BGL_PLACE_HOST);
  std::size_t issued = 0;
  ASSERT_EQ(env.enf->prefetch(5, &issued), Status::kOk);
  ASSERT_EQ(issued, 1u);
  ASSERT_EQ(env.info(h).placement, BGL_PLACE_DEVICE);  // reloaded, behind the copy
  std::uint64_t out[4];
  std::size_t n = 9;
  ASSERT_EQ(env.enf->take_offloaded(out, 4, &n), Status::kOk);
  EXPECT_EQ(n, 0u);  // the source is still being read
  gate.open();
  env.d2h.synchronize();
  ASSERT_EQ(env.enf->take_offloaded(out, 4, &n), Status::kOk);
  ASSERT_EQ(n, 1u);
  EXPECT_EQ(out[0], h);
  ASSERT_EQ(env.enf->schedule_finish(), Status::kOk);
  env.expect_data(h, data);
}

TEST(Enforcer, OffloadingAnUntakenReloadGivesTheBlockBackAndKeepsOnePinnedCopy) {
  Env env(std::size_t{256} << 20, 64 << 20, /*max_inflight=*/4);
  std::vector<std::uint8_t> data;
  const std::uint64_t h = env.make(1 << 20, &data, 0, 2);
  ASSERT_EQ(env.enf->offload(h), Status::kOk);
  ASSERT_EQ(env.enf->prefetch(2, nullptr), Status::kOk);
  ASSERT_EQ(env.info(h).placement, BGL_PLACE_DEVICE);
  const std::size_t pinned = env.enf->stats().pinned_in_use;
  ASSERT_EQ(env.enf->offload(h), Status::kOk);  // pressure before any consumer took it
  EXPECT_EQ(env.info(h).placement, BGL_PLACE_HOST);
  EXPECT_EQ(env.enf->stats().pinned_in_use, pinned);  // no second pinned copy
  EXPECT_EQ(env.enf->stats().offloads, 1u);
  EXPECT_EQ(env.enf->stats().unreloads, 1u);
  env.expect_data(h, data);
}

}  // namespace bgl::enf::testing
