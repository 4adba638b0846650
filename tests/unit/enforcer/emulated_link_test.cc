// EmulatedLinkOps on simulated time (no wall-clock assertion): a copy between device and pinned
// memory takes its link's time from when its stream reaches it, so it hides behind compute only
// when issued ahead; the bytes really move; other work keeps its own cost.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <numeric>
#include <thread>
#include <vector>

#include "enforcer/emulated_link_ops.h"

namespace bgl::enf {
namespace {

// Simulated time: sleeping until t moves time to t (a discrete-event clock); the test's
// "compute" moves it with advance_to. Counts the stream items that read the time.
class SimClock final : public LinkClock {
 public:
  double now_s() override {
    std::lock_guard<std::mutex> lock(mu_);
    ++reads_;
    return now_;
  }
  void sleep_until_s(double t) override {
    std::lock_guard<std::mutex> lock(mu_);
    now_ = std::max(now_, t);
  }
  void advance_to(double t) { sleep_until_s(t); }
  double time() {
    std::lock_guard<std::mutex> lock(mu_);
    return now_;
  }
  int reads() {
    std::lock_guard<std::mutex> lock(mu_);
    return reads_;
  }

 private:
  std::mutex mu_;
  double now_ = 0;
  int reads_ = 0;
};

class EmulatedLink : public ::testing::Test {
 protected:
  void SetUp() override {
    LinkTimes times;
    times.offload = {/*launch_floor_s=*/0.5, /*peak_bytes_per_s=*/1000};  // 4000 B: 4 s
    times.reload = {/*launch_floor_s=*/0.5, /*peak_bytes_per_s=*/2000};   // 4000 B: 2 s
    ops_ = make_emulated_link_ops(make_host_device_ops(), times, &clock_);
    ASSERT_EQ(ops_->create_stream(&d2h_), Status::kOk);
    host_ = static_cast<std::uint8_t*>(ops_->host_alloc(kBytes));
    ASSERT_NE(host_, nullptr);
    device_.resize(kBytes);
    std::iota(device_.begin(), device_.end(), 0);
  }
  void TearDown() override {
    ops_->synchronize(d2h_);
    ops_->destroy_stream(d2h_);
    ops_->host_free(host_);
  }
  // Waits (really) until the stream has started `n` copies: each notes its start time.
  void started(int n) {
    while (clock_.reads() < n) std::this_thread::yield();
  }

  static constexpr std::size_t kBytes = 4000;
  SimClock clock_;
  std::unique_ptr<DeviceOps> ops_;
  Stream d2h_ = nullptr;
  std::uint8_t* host_ = nullptr;
  std::vector<std::uint8_t> device_;
};

TEST_F(EmulatedLink, AnOffloadIssuedAheadHidesBehindComputeLongerThanIt) {
  ASSERT_EQ(ops_->copy(host_, device_.data(), kBytes, d2h_), Status::kOk);
  const Event done = ops_->record(d2h_);
  started(1);
  clock_.advance_to(5.0);  // 5 s of compute on the training thread; the copy takes 4 s
  ops_->wait(done);
  EXPECT_DOUBLE_EQ(clock_.time(), 5.0);                      // nothing exposed
  EXPECT_EQ(std::memcmp(host_, device_.data(), kBytes), 0);  // the bytes moved
}

TEST_F(EmulatedLink, AnOffloadIssuedWhenNeededCostsItsWholeTime) {
  clock_.advance_to(5.0);  // the compute ran first
  ASSERT_EQ(ops_->copy(host_, device_.data(), kBytes, d2h_), Status::kOk);
  const Event done = ops_->record(d2h_);
  ops_->wait(done);
  EXPECT_DOUBLE_EQ(clock_.time(), 9.0);  // 4 s exposed: bytes over the offload rate
}

TEST_F(EmulatedLink, ComputeShorterThanTheCopyExposesTheRest) {
  ASSERT_EQ(ops_->copy(host_, device_.data(), kBytes, d2h_), Status::kOk);
  const Event done = ops_->record(d2h_);
  started(1);
  clock_.advance_to(1.5);
  ops_->wait(done);
  EXPECT_DOUBLE_EQ(clock_.time(), 4.0);  // 2.5 s of the 4 s exposed
}

TEST_F(EmulatedLink, CopiesOnOneStreamQueueLikeOneCopyEngine) {
  ASSERT_EQ(ops_->copy(host_, device_.data(), kBytes / 2, d2h_), Status::kOk);  // 2 s
  ASSERT_EQ(ops_->copy(host_ + kBytes / 2, device_.data() + kBytes / 2, kBytes / 2, d2h_),
            Status::kOk);
  ops_->wait(ops_->record(d2h_));
  EXPECT_DOUBLE_EQ(clock_.time(), 4.0);  // one after the other
}

TEST_F(EmulatedLink, ReloadTakesTheReloadRateAndTheFloorBoundsSmallCopies) {
  std::memcpy(host_, device_.data(), kBytes);
  std::vector<std::uint8_t> back(kBytes, 0);
  ASSERT_EQ(ops_->copy(back.data(), host_, kBytes, d2h_), Status::kOk);
  ops_->wait(ops_->record(d2h_));
  EXPECT_DOUBLE_EQ(clock_.time(), 2.0);
  EXPECT_EQ(back, device_);
  ASSERT_EQ(ops_->copy(back.data(), host_, 10, d2h_), Status::kOk);  // 5 ms of bytes: the floor
  ops_->wait(ops_->record(d2h_));
  EXPECT_DOUBLE_EQ(clock_.time(), 2.5);
}

TEST_F(EmulatedLink, DeviceCopiesAndCastsKeepTheirOwnCost) {
  std::vector<std::uint8_t> other(kBytes, 0);
  ASSERT_EQ(ops_->copy(other.data(), device_.data(), kBytes, d2h_), Status::kOk);
  ops_->wait(ops_->record(d2h_));
  EXPECT_DOUBLE_EQ(clock_.time(), 0.0);
  EXPECT_EQ(other, device_);
}

TEST_F(EmulatedLink, OnTheCallingThreadTheCopyCostsItsTimeThere) {
  ASSERT_EQ(ops_->copy(host_, device_.data(), kBytes, nullptr), Status::kOk);
  EXPECT_DOUBLE_EQ(clock_.time(), 4.0);
  EXPECT_EQ(std::memcmp(host_, device_.data(), kBytes), 0);
}

TEST_F(EmulatedLink, MemoryNotHandedOutByTheOpsIsNotPinned) {
  // A pointer just past the pinned allocation is device memory to the emulation.
  std::vector<std::uint8_t> a(kBytes), b(kBytes);
  ASSERT_EQ(ops_->copy(a.data(), b.data(), kBytes, nullptr), Status::kOk);
  EXPECT_DOUBLE_EQ(clock_.time(), 0.0);
}

}  // namespace
}  // namespace bgl::enf
