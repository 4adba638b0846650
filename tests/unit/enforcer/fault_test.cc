// Fault injection (allocator/detail/fault.h, enforcer/detail/fault_injecting_ops.h) and bounded
// waits: every injected failure ends absorbed or with an error that names it, the tensor's data
// and the pinned and device blocks intact; a stalled copy's wait gives up (label tsan).
#include "allocator/detail/fault.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <future>
#include <string>
#include <thread>

#include "allocator/error.h"
#include "enforcer/detail/fault_injecting_ops.h"
#include "tests/unit/enforcer/test_env.h"

namespace bgl::enf::testing {
namespace {

namespace fault = alloc::detail;
using fault::FaultAction;
using fault::FaultKind;
using std::chrono::milliseconds;

// Injection off and the default bounds before and after each test (the state is the process's).
class Faults : public ::testing::Test {
 protected:
  void SetUp() override { reset(); }
  void TearDown() override { reset(); }
  static void reset() {
    std::string error;
    ASSERT_TRUE(fault::configure_faults("", &error)) << error;
    fault::set_wait_timeout(milliseconds(60000));
    fault::set_stall_duration(milliseconds(0));  // default: twice the timeout
  }
  // Pinned bytes in use once the copies are done (blocks freed after an event are counted until
  // the pool looks at them again: set_pinned_capacity does).
  static std::uint64_t pinned_in_use(Env& e) {
    EXPECT_EQ(e.enf->synchronize(), Status::kOk) << alloc::last_error();
    EXPECT_EQ(e.enf->set_pinned_capacity(e.enf->stats().pinned_capacity), Status::kOk);
    return e.enf->stats().pinned_in_use;
  }
  static void configure(const std::string& spec) {
    std::string error;
    ASSERT_TRUE(fault::configure_faults(spec, &error)) << error;
  }
  // An enforcer whose ops inject faults, over host streams.
  static std::unique_ptr<Env> env(std::size_t pinned = 64 << 20) {
    return std::make_unique<Env>(
        std::size_t{256} << 20, pinned, 4, true,
        std::make_unique<detail::FaultInjectingOps>(make_host_device_ops()));
  }
};

TEST_F(Faults, ASpecThatCannotBeReadIsRefusedNamingItsPart) {
  for (const char* bad : {"pinned", "pinned:0", "pinned:-1", "disk:3", "copy:x", "stall:2+"}) {
    std::string error;
    EXPECT_FALSE(fault::configure_faults(std::string("copy:1,") + bad, &error)) << bad;
    EXPECT_NE(error.find(bad), std::string::npos) << error;
  }
}

TEST_F(Faults, OnlyTheNthOperationFailsOrFromTheNthOnWithAPlus) {
  configure("copy:3,device:2+");
  std::string copies, devices;
  for (int i = 0; i < 5; ++i) {
    copies += fault::fault_point(FaultKind::kCopy) == FaultAction::kFail ? 'F' : '.';
    devices += fault::fault_point(FaultKind::kDevice) == FaultAction::kFail ? 'F' : '.';
  }
  EXPECT_EQ(copies, "..F..");
  EXPECT_EQ(devices, ".FFFF");
  EXPECT_EQ(fault::fault_point(FaultKind::kPinned), FaultAction::kNone);
  EXPECT_EQ(fault::fault_operations(FaultKind::kCopy), 5u);
  EXPECT_EQ(fault::fault_operations(FaultKind::kPinned), 1u);
  EXPECT_EQ(fault::faults_fired(), 5u);
  configure("count");  // counts, fails nothing
  for (int i = 0; i < 4; ++i) EXPECT_EQ(fault::fault_point(FaultKind::kCopy), FaultAction::kNone);
  EXPECT_EQ(fault::fault_operations(FaultKind::kCopy), 4u);
  EXPECT_EQ(fault::faults_fired(), 0u);
}

TEST(HostStreamBoundedWait, GivesUpWhileTheWorkRunsAndSucceedsOnceItRan) {
  HostStream s;
  std::promise<void> gate;
  auto opened = gate.get_future().share();
  // On the worker: a waiter runs other items itself while the worker is idle (the next test).
  const std::uint64_t t = s.enqueue_on_worker([opened] { opened.wait(); });
  EXPECT_FALSE(s.wait_for(t, milliseconds(1)));
  EXPECT_FALSE(s.synchronize_for(milliseconds(1)));
  gate.set_value();
  EXPECT_TRUE(s.wait_for(t, milliseconds(3600 * 1000)));
  EXPECT_TRUE(s.done(t));
}

TEST(HostStreamBoundedWait, AWaiterNeverRunsAWorkerOnlyItem) {
  // A waiting thread runs queued items itself while the worker is idle; an item queued with
  // enqueue_on_worker (a stalled copy) must stay on the worker, or the bounded wait would hang
  // in it. Many tries: a waiter that took it would do so in some of them.
  for (int i = 0; i < 200; ++i) {
    HostStream s;
    std::thread::id ran_on;
    const std::uint64_t t = s.enqueue_on_worker([&] { ran_on = std::this_thread::get_id(); });
    ASSERT_TRUE(s.wait_for(t, milliseconds(3600 * 1000)));
    ASSERT_NE(ran_on, std::this_thread::get_id()) << "try " << i;
  }
}

TEST_F(Faults, AFailedPinnedAllocationIsRetriedOnceAndTheOffloadGoesOn) {
  auto e = env();
  configure("pinned:1");
  std::vector<std::uint8_t> data;
  const std::uint64_t h = e->make(300000, &data);
  ASSERT_EQ(e->enf->offload(h), Status::kOk) << alloc::last_error();
  EXPECT_EQ(fault::faults_fired(), 1u);
  EXPECT_EQ(fault::fault_operations(FaultKind::kPinned), 2u);  // the failure and the retry
  e->expect_data(h, data);
  ASSERT_EQ(e->enf->release(h, -1, &e->compute), Status::kOk);
}

TEST_F(Faults, PinnedAllocationsThatKeepFailingEndTheOffloadWithAnErrorAndNothingMoved) {
  auto e = env();
  configure("pinned:1+");
  std::vector<std::uint8_t> data;
  const std::uint64_t h = e->make(300000, &data);
  ASSERT_EQ(e->enf->offload(h), Status::kPinnedExhausted);
  EXPECT_NE(alloc::last_error().find("fault injection: pinned host allocation"), std::string::npos)
      << alloc::last_error();
  EXPECT_EQ(e->info(h).placement, BGL_PLACE_DEVICE);
  EXPECT_EQ(pinned_in_use(*e), 0u);
  e->expect_data(h, data);
  ASSERT_EQ(e->enf->release(h, -1, &e->compute), Status::kOk);
}

TEST_F(Faults, AFailedOffloadCopyLeavesTheTensorOnTheDeviceAndGivesThePinnedBlockBack) {
  auto e = env();
  std::vector<std::uint8_t> data;
  const std::uint64_t h = e->make(300000, &data);
  configure("copy:1");
  ASSERT_EQ(e->enf->offload(h), Status::kBackendError);
  EXPECT_NE(alloc::last_error().find("offload tensor"), std::string::npos) << alloc::last_error();
  EXPECT_NE(alloc::last_error().find("fault injection: copy"), std::string::npos)
      << alloc::last_error();
  EXPECT_EQ(e->info(h).placement, BGL_PLACE_DEVICE);
  EXPECT_EQ(pinned_in_use(*e), 0u);
  // The next copy works: the offload and its reload give the same bytes back.
  ASSERT_EQ(e->enf->offload(h), Status::kOk) << alloc::last_error();
  e->expect_data(h, data);
  ASSERT_EQ(e->enf->release(h, -1, &e->compute), Status::kOk);
  EXPECT_EQ(pinned_in_use(*e), 0u);
}

TEST_F(Faults, AFailedReloadCopyReturnsTheDeviceBlockAndTheNextAcquireReloads) {
  auto e = env();
  std::vector<std::uint8_t> data;
  const std::uint64_t h = e->make(300000, &data);
  configure("copy:2");  // the offload is copy 1, the reload copy 2
  ASSERT_EQ(e->enf->offload(h), Status::kOk) << alloc::last_error();
  ASSERT_EQ(e->enf->wait_tensor(h), Status::kOk);
  const auto allocated = e->pool->stats().allocated_bytes.current;
  void* p = nullptr;
  ASSERT_EQ(e->enf->acquire(h, -1, &e->compute, &p), Status::kBackendError);
  EXPECT_NE(alloc::last_error().find("reload tensor"), std::string::npos) << alloc::last_error();
  EXPECT_EQ(e->info(h).placement, BGL_PLACE_HOST);
  EXPECT_EQ(e->pool->stats().allocated_bytes.current, allocated);  // the device block went back
  e->expect_data(h, data);
  ASSERT_EQ(e->enf->release(h, -1, &e->compute), Status::kOk);
  EXPECT_EQ(pinned_in_use(*e), 0u);
}

TEST_F(Faults, AFailedFp8CastLeavesTheTensorInFullPrecision) {
  auto e = env();
  std::vector<std::uint8_t> data;
  const std::uint64_t h2 = e->make(4096 * 4, &data, 0, 0, -1, ElemType::kF32);
  const auto allocated = e->pool->stats().allocated_bytes.current;
  configure("copy:1");
  ASSERT_EQ(e->enf->store_fp8(h2), Status::kBackendError);
  EXPECT_NE(alloc::last_error().find("fault injection: FP8 cast"), std::string::npos)
      << alloc::last_error();
  EXPECT_EQ(e->info(h2).placement, BGL_PLACE_DEVICE);
  EXPECT_EQ(e->pool->stats().allocated_bytes.current, allocated);  // the FP8 block went back
  e->expect_data(h2, data);
  ASSERT_EQ(e->enf->release(h2, -1, &e->compute), Status::kOk);
}

TEST_F(Faults, AStalledCopyEndsTheWaitWithAnErrorAndTheDataArrivesOnceItRuns) {
  auto e = env();
  fault::set_wait_timeout(milliseconds(20));
  fault::set_stall_duration(milliseconds(3600 * 1000));  // until released below
  std::vector<std::uint8_t> data;
  const std::uint64_t h = e->make(300000, &data);
  configure("stall:1");
  ASSERT_EQ(e->enf->offload(h), Status::kOk) << alloc::last_error();
  ASSERT_EQ(e->enf->wait_tensor(h), Status::kBackendError);
  EXPECT_NE(alloc::last_error().find("its offload copy: the stream work before an event did not "
                                     "complete within 20 ms (BGL_WAIT_TIMEOUT_MS)"),
            std::string::npos)
      << alloc::last_error();
  ASSERT_EQ(e->enf->synchronize(), Status::kBackendError);
  EXPECT_NE(alloc::last_error().find("offload stream"), std::string::npos) << alloc::last_error();
  EXPECT_EQ(fault::faults_fired(), 1u);
  fault::release_stalls();
  fault::set_wait_timeout(milliseconds(3600 * 1000));
  ASSERT_EQ(e->enf->wait_tensor(h), Status::kOk) << alloc::last_error();
  e->expect_data(h, data);
  ASSERT_EQ(e->enf->release(h, -1, &e->compute), Status::kOk);
  EXPECT_EQ(pinned_in_use(*e), 0u);
}

TEST_F(Faults, AReloadBehindAStalledOffloadTimesOutOnTheConsumerStream) {
  // The reload waits for the offload on the H2D stream (a device-side wait); the host's wait on
  // the consumer's data is the bounded one.
  auto e = env();
  fault::set_wait_timeout(milliseconds(20));
  fault::set_stall_duration(milliseconds(3600 * 1000));
  std::vector<std::uint8_t> data;
  const std::uint64_t h = e->make(300000, &data);
  configure("stall:1");
  ASSERT_EQ(e->enf->offload(h), Status::kOk);
  ASSERT_EQ(e->enf->reload(h), Status::kOk);
  ASSERT_EQ(e->enf->wait_tensor(h), Status::kBackendError);
  EXPECT_NE(alloc::last_error().find("did not complete within 20 ms"), std::string::npos)
      << alloc::last_error();
  fault::release_stalls();
  fault::set_wait_timeout(milliseconds(3600 * 1000));
  e->expect_data(h, data);
  ASSERT_EQ(e->enf->release(h, -1, &e->compute), Status::kOk);
}

TEST_F(Faults, AnAcquireOnTheCallingThreadWhoseReloadStallsIsAnErrorNotEarlyData) {
  // Found by the fault sweep (copy threads, a stalled offload): the host backend's null stream
  // makes the acquire's wait for the reload a host wait; it timed out and the acquire returned
  // the block before the reload wrote it (a wrong gradient). The acquire fails instead, and a
  // later one waits again.
  auto e = env();
  fault::set_wait_timeout(milliseconds(20));
  fault::set_stall_duration(milliseconds(3600 * 1000));
  std::vector<std::uint8_t> data;
  const std::uint64_t h = e->make(300000, &data);
  configure("stall:1");
  ASSERT_EQ(e->enf->offload(h), Status::kOk);
  ASSERT_EQ(e->enf->reload(h), Status::kOk);
  void* p = nullptr;
  ASSERT_EQ(e->enf->acquire(h, -1, nullptr, &p), Status::kBackendError);
  EXPECT_EQ(p, nullptr);
  EXPECT_NE(alloc::last_error().find("acquire tensor"), std::string::npos) << alloc::last_error();
  EXPECT_NE(alloc::last_error().find("did not complete within 20 ms"), std::string::npos)
      << alloc::last_error();
  fault::release_stalls();
  fault::set_wait_timeout(milliseconds(3600 * 1000));
  ASSERT_EQ(e->enf->acquire(h, -1, nullptr, &p), Status::kOk) << alloc::last_error();
  EXPECT_EQ(std::memcmp(p, data.data(), data.size()), 0);
  ASSERT_EQ(e->enf->release(h, -1, nullptr), Status::kOk);
}

TEST_F(Faults, AnOffloadOnTheCallingThreadBehindAStalledProducerIsAnErrorNotACopyOfEarlyData) {
  // Synchronous copies (null copy streams): the offload's wait for the producer's stream is a
  // host wait; when it times out no copy is made (it would read data not yet written).
  HostBackendOptions bo;
  bo.capacity = std::size_t{64} << 20;
  bo.page_size = 64 << 10;
  Pool pool(std::make_unique<HostBackend>(bo), PoolOptions{});
  EnforcerOptions eo;
  eo.pinned_capacity = 16 << 20;
  eo.sync_copies = true;
  std::string error;
  auto enf = Enforcer::create(
      &pool, std::make_unique<detail::FaultInjectingOps>(make_host_device_ops()), eo, &error);
  ASSERT_NE(enf, nullptr) << error;
  HostStream producer;
  void* ptr = pool.allocate(4096, &producer);
  std::promise<void> gate;
  auto opened = gate.get_future().share();
  producer.enqueue_on_worker([opened, ptr] {
    opened.wait();
    std::memset(ptr, 7, 4096);  // the producer's kernel, late
  });
  TensorDesc d{ptr, 4096, ElemType::kBytes, 0, -1, 0, &producer, true};
  std::uint64_t h = 0;
  ASSERT_EQ(enf->register_tensor(d, &h), Status::kOk);
  fault::set_wait_timeout(milliseconds(20));
  ASSERT_EQ(enf->offload(h), Status::kBackendError);
  EXPECT_NE(alloc::last_error().find("its producer's stream"), std::string::npos)
      << alloc::last_error();
  bgl_enf_tensor_info i{};
  ASSERT_EQ(enf->info(h, &i), Status::kOk);
  EXPECT_EQ(i.placement, BGL_PLACE_DEVICE);
  EXPECT_EQ(enf->stats().pinned_in_use, 0u);
  gate.set_value();
  fault::set_wait_timeout(milliseconds(3600 * 1000));
  ASSERT_EQ(enf->offload(h), Status::kOk) << alloc::last_error();
  void* p = nullptr;
  ASSERT_EQ(enf->acquire(h, -1, nullptr, &p), Status::kOk);
  EXPECT_EQ(static_cast<std::uint8_t*>(p)[4095], 7);
  ASSERT_EQ(enf->release(h, -1, nullptr), Status::kOk);
  enf.reset();
  producer.synchronize();
}

TEST_F(Faults, EveryPinnedBlockIsCountedUntilTheEnforcerGivesItBack) {
  const std::int64_t before = fault::pinned_blocks_live();
  auto e = env();
  std::vector<std::uint8_t> data;
  const std::uint64_t h = e->make(300000, &data);
  ASSERT_EQ(e->enf->offload(h), Status::kOk);
  EXPECT_EQ(fault::pinned_blocks_live(), before + 1);
  e->expect_data(h, data);
  ASSERT_EQ(e->enf->release(h, -1, &e->compute), Status::kOk);
  e->enf.reset();  // the pinned pool's cache goes with it
  EXPECT_EQ(fault::pinned_blocks_live(), before);
}

TEST_F(Faults, AnEnforcerDestroyedWhileACopyStallsWaitsForItBeforeFreeingItsMemory) {
  // The destructor's waits are the one unbounded kind: the pinned block and the device block
  // the stalled copy uses must outlive it (ASan and TSan see a free before the copy ran).
  auto e = env();
  fault::set_wait_timeout(milliseconds(5));
  fault::set_stall_duration(milliseconds(3600 * 1000));
  std::vector<std::uint8_t> data;
  const std::uint64_t h = e->make(300000, &data);
  configure("stall:1");
  ASSERT_EQ(e->enf->offload(h), Status::kOk);
  std::promise<void> destroyed;
  auto done = destroyed.get_future();
  std::thread t([&] {
    e->enf.reset();
    destroyed.set_value();
  });
  // Not destroyed while the copy stalls (it waits however long, past many timeouts).
  EXPECT_EQ(done.wait_for(milliseconds(50)), std::future_status::timeout);
  fault::release_stalls();
  t.join();
}

TEST_F(Faults, ARetireDuringAStalledReloadKeepsThePinnedBlockUntilTheReloadHasReadIt) {
  // Issue 45 (enforcer_capi_fuzz): the retire gave the pinned block back after an event on the
  // offload stream only, so while the reload still read it on the H2D stream it was cached, and
  // a smaller pinned capacity freed it under the copy (ASan: a read after free). Regression
  // input fuzz/regressions/enforcer_capi_fuzz/retire-during-reload-then-smaller-pinned-capacity.
  // (The release below may come before the H2D worker reaches the stall: the stall counts
  // releases from when it fired, so this does not wait the hour.)
  auto e = env();
  fault::set_stall_duration(milliseconds(3600 * 1000));  // until released below
  std::vector<std::uint8_t> data;
  const std::uint64_t h = e->make(300000, &data);
  ASSERT_EQ(e->enf->offload(h), Status::kOk) << alloc::last_error();
  ASSERT_EQ(e->enf->wait_tensor(h), Status::kOk) << alloc::last_error();
  configure("stall:1");  // the reload's copy
  ASSERT_EQ(e->enf->reload(h), Status::kOk) << alloc::last_error();
  ASSERT_EQ(e->enf->release(h, -1, &e->compute), Status::kOk) << alloc::last_error();
  ASSERT_EQ(e->enf->set_pinned_capacity(0), Status::kOk);  // frees every cached block
  EXPECT_GE(e->enf->stats().pinned_in_use, 300000u);       // still the reload's
  EXPECT_EQ(fault::faults_fired(), 1u);
  fault::release_stalls();
  EXPECT_EQ(pinned_in_use(*e), 0u);
}

TEST_F(Faults, AFailedDeviceGrowthIsRetriedByThePoolAndEveryFailureIsAnOutOfMemory) {
  auto e = env();
  configure("device:1");
  void* p = e->pool->allocate(1 << 20, &e->compute);
  EXPECT_NE(p, nullptr) << alloc::last_error();  // the pool grows again after its cache
  EXPECT_EQ(fault::faults_fired(), 1u);
  e->pool->deallocate(p, 1 << 20, &e->compute);
  e->pool->empty_cache();
  configure("device:1+");
  EXPECT_EQ(e->pool->allocate(8 << 20, &e->compute), nullptr);
  EXPECT_NE(alloc::last_error().find("out of memory"), std::string::npos) << alloc::last_error();
  EXPECT_NE(alloc::last_error().find("fault injection: device operation #"), std::string::npos)
      << alloc::last_error();
  configure("");
  p = e->pool->allocate(8 << 20, &e->compute);
  EXPECT_NE(p, nullptr);
  e->pool->deallocate(p, 8 << 20, &e->compute);
}

}  // namespace
}  // namespace bgl::enf::testing
