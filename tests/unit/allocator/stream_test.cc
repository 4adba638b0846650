// Stream-ordered reuse on host streams: a block freed on stream A is handed to stream B only
// after A's queued work on it has finished; record_stream delays reuse the same way.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <future>
#include <memory>
#include <thread>

#include "allocator/host_stream.h"
#include "allocator/pool.h"
#include "allocator/snapshot.h"
#include "test_util.h"

namespace bgl::alloc {
namespace {

using testing::kMiB;
using testing::make_pool;

TEST(StreamTest, BlockFreedOnBusyStreamIsNotHandedToAnotherStreamEarly) {
  PoolOptions o;
  o.limit_bytes = 4 * kMiB;  // B can only get memory by reusing A's block
  auto p = make_pool(64 * kMiB, o);
  HostStream a, b;
  constexpr std::size_t kSize = 4 * kMiB;
  auto* block = static_cast<unsigned char*>(p->allocate(kSize, &a));
  ASSERT_NE(block, nullptr);
  std::promise<void> gate;
  std::shared_future<void> opened = gate.get_future().share();
  // A's queued kernel: still writes the block after the host freed it.
  const std::uint64_t ticket = a.enqueue([=] {
    opened.wait();
    std::memset(block, 0xAA, kSize);
  });
  ASSERT_EQ(p->deallocate(block, kSize, &a), Status::kOk);
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    gate.set_value();
  });
  auto* reused = static_cast<unsigned char*>(p->allocate(kSize, &b));
  ASSERT_EQ(reused, block);
  EXPECT_TRUE(a.done(ticket));  // the pool waited for A's event
  b.enqueue([=] { std::memset(reused, 0xBB, kSize); });
  b.synchronize();
  a.synchronize();
  opener.join();
  for (std::size_t i = 0; i < kSize; i += 4093) ASSERT_EQ(reused[i], 0xBB) << "byte " << i;
  EXPECT_GE(p->stats().num_syncs, 1u);
  p->deallocate(reused, kSize, &b);
  std::string why;
  EXPECT_TRUE(p->check_invariants(&why)) << why;
}

TEST(StreamTest, SameStreamReusesAtOnceOtherStreamGetsFreshMemory) {
  auto p = make_pool(64 * kMiB);
  HostStream a, b;
  std::promise<void> gate;
  std::shared_future<void> opened = gate.get_future().share();
  void* x = p->allocate(kMiB * 3, &a);
  a.enqueue([opened] { opened.wait(); });
  p->deallocate(x, kMiB * 3, &a);
  void* y = p->allocate(kMiB * 3, &b);  // must not wait for A (the gate is still closed)
  EXPECT_NE(y, x);
  void* z = p->allocate(kMiB * 3, &a);  // stream order makes reuse on A safe
  EXPECT_EQ(z, x);
  gate.set_value();
  a.synchronize();
  EXPECT_EQ(p->stats().num_syncs, 0u);
  p->deallocate(y, kMiB * 3, &b);
  p->deallocate(z, kMiB * 3, &a);
}

TEST(StreamTest, RecordStreamKeepsBlockPendingUntilThatStreamsWorkCompletes) {
  auto p = make_pool(64 * kMiB);
  HostStream a, side;
  std::promise<void> gate;
  std::shared_future<void> opened = gate.get_future().share();
  void* x = p->allocate(kMiB, &a);
  ASSERT_EQ(p->record_stream(x, &side), Status::kOk);
  side.enqueue([opened] { opened.wait(); });
  p->deallocate(x, kMiB, &a);
  auto segs = p->segments();
  bool pending = false;
  for (auto& s : segs) {
    for (auto& b : s.blocks)
      pending |=
          b.addr == reinterpret_cast<std::uintptr_t>(x) && b.state == BlockState::kPendingFree;
  }
  EXPECT_TRUE(pending);
  Stats st = p->stats();
  EXPECT_EQ(st.allocated_bytes.current, 0);
  EXPECT_EQ(st.active_bytes.current, static_cast<std::int64_t>(kMiB));
  void* y = p->allocate(kMiB, &a);
  EXPECT_NE(y, x);  // still pending
  gate.set_value();
  side.synchronize();
  void* z = p->allocate(kMiB, &a);  // events are polled on allocation
  EXPECT_EQ(p->stats().active_bytes.current, static_cast<std::int64_t>(2 * kMiB));
  p->deallocate(y, kMiB, &a);
  p->deallocate(z, kMiB, &a);
  std::string why;
  EXPECT_TRUE(p->check_invariants(&why)) << why;
}

// Issue 45 (enforcer_capi_fuzz): a block freed while an enforcer's copy stream still used it
// waits for an event on that stream; the enforcer was destroyed (its streams with it) and the
// next allocation queried the event through the freed stream: a use after free (under ASan the
// freed stream's mutex read as locked, a hang; in a release build a new stream at the same
// address, its count restarted, kept the block pending for good). Such an event is complete.
TEST(StreamTest, AnEventOnAStreamDestroyedSinceIsCompleteAndNeverReadThroughIt) {
  auto p = make_pool(64 * kMiB);
  HostStream a;
  auto side = std::make_unique<HostStream>();
  std::promise<void> gate;
  std::shared_future<void> opened = gate.get_future().share();
  void* x = p->allocate(kMiB, &a);
  ASSERT_EQ(p->record_stream(x, side.get()), Status::kOk);
  side->enqueue([opened] { opened.wait(); });
  p->deallocate(x, kMiB, &a);  // pending on the side stream's event
  gate.set_value();
  side.reset();                     // drains its queue, then goes
  HostStream again;                 // may take the freed stream's address, its count starting at 0
  void* y = p->allocate(kMiB, &a);  // polls the pending event
  EXPECT_EQ(y, x);                  // the block came back: the event read as complete
  EXPECT_EQ(p->stats().active_bytes.current, static_cast<std::int64_t>(kMiB));
  p->deallocate(y, kMiB, &a);
  std::string why;
  EXPECT_TRUE(p->check_invariants(&why)) << why;
}

TEST(SnapshotTest, HasPyTorchKeysStatesAndTraceActions) {
  PoolOptions o;
  o.history = 1000;
  o.limit_bytes = 32 * kMiB;
  auto p = make_pool(64 * kMiB, o);
  HostStream side;
  std::promise<void> gate;
  std::shared_future<void> opened = gate.get_future().share();
  void* a = p->allocate(5 * kMiB, nullptr);
  void* b = p->allocate(3 * kMiB, nullptr);
  void* c = p->allocate(kMiB, nullptr);
  p->record_stream(c, &side);
  side.enqueue([opened] { opened.wait(); });
  p->deallocate(b, 3 * kMiB, nullptr);
  p->deallocate(c, kMiB, nullptr);
  EXPECT_EQ(p->allocate(64 * kMiB, nullptr), nullptr);  // oom
  Config config;
  nlohmann::json j = snapshot_to_json({p.get()}, config);
  for (const char* key : {"segments", "device_traces", "allocator_settings"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  std::set<std::string> states;
  for (auto& seg : j["segments"]) {
    for (const char* key :
         {"device", "address", "total_size", "allocated_size", "active_size", "requested_size",
          "stream", "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks"}) {
      EXPECT_TRUE(seg.contains(key)) << key;
    }
    for (auto& blk : seg["blocks"]) {
      for (const char* key : {"address", "size", "requested_size", "state", "frames"}) {
        EXPECT_TRUE(blk.contains(key)) << key;
      }
      states.insert(blk["state"].get<std::string>());
    }
  }
  EXPECT_EQ(states, (std::set<std::string>{"active_allocated", "active_pending_free", "inactive"}));
  gate.set_value();
  side.synchronize();
  p->deallocate(a, 5 * kMiB, nullptr);
  p->empty_cache();
  j = snapshot_to_json({p.get()}, config);
  ASSERT_EQ(j["device_traces"].size(), 1u);
  std::set<std::string> actions;
  for (auto& t : j["device_traces"][0]) {
    actions.insert(t["action"].get<std::string>());
    EXPECT_TRUE(t.contains("time_us"));
    EXPECT_TRUE(t.contains("size"));
    EXPECT_TRUE(t.contains("stream"));
    EXPECT_TRUE(t.contains(t["action"] == "oom" ? "device_free" : "addr"));
  }
  for (const char* a :
       {"alloc", "free_requested", "free_completed", "segment_map", "segment_unmap", "oom"}) {
    EXPECT_TRUE(actions.count(a)) << a;
  }
}

TEST(HistoryTest, RingKeepsNewestEntries) {
  History h;
  h.set_capacity(3);
  for (int i = 0; i < 5; ++i) h.add(TraceEntry{Action::kAlloc, std::uintptr_t(i), 1, nullptr, i});
  auto e = h.entries();
  ASSERT_EQ(e.size(), 3u);
  EXPECT_EQ(e[0].addr, 2u);
  EXPECT_EQ(e[2].addr, 4u);
  EXPECT_TRUE(h.overflowed());
}

}  // namespace
}  // namespace bgl::alloc
