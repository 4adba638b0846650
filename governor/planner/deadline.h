// Deadline: a cooperative time limit on one planning call. The planner's loops (the cost
// evaluator the greedy calls, the dual-batch DP) call Check(); once the limit has passed, or the
// host has raised its cancel flag (a draining daemon), Check() unwinds the call and the planner's
// public method returns the Status() below, its state unchanged.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

#include "base/status.h"

namespace bgl::plan {

namespace detail {
// Thrown by Deadline::Check() and caught by StagePlanner's public methods; never escapes them.
struct DeadlineExpired {};
}  // namespace detail

// Threading: one Deadline belongs to one planning call on one thread (Check() keeps a counter);
// the cancel flag it watches may be set from any thread.
class Deadline {
 public:
  using Clock = std::chrono::steady_clock;

  // No limit and no cancel flag: Check() never throws.
  Deadline() = default;
  // Expires `limit_ms` milliseconds from now (<= 0: never); `cancel` (may be null) ends it early.
  Deadline(int64_t limit_ms, const std::atomic<bool>* cancel)
      : limit_ms_(limit_ms),
        at_(limit_ms > 0 ? Clock::now() + std::chrono::milliseconds(limit_ms)
                         : Clock::time_point::max()),
        cancel_(cancel) {}

  bool Unlimited() const { return limit_ms_ <= 0 && cancel_ == nullptr; }
  bool Cancelled() const { return cancel_ != nullptr && cancel_->load(std::memory_order_relaxed); }
  bool Expired() const { return Cancelled() || (limit_ms_ > 0 && Clock::now() >= at_); }

  // Cheap enough for inner loops: reads the clock every 16th call.
  void Check() const {
    if (Unlimited() || (++calls_ & 15u) != 0) return;
    if (Expired()) throw detail::DeadlineExpired{};
  }

  // Why the call ended: UNAVAILABLE when cancelled, else RESOURCE_EXHAUSTED naming the limit.
  Status ToStatus() const {
    if (Cancelled()) return {StatusCode::kUnavailable, "plan: cancelled (the daemon is stopping)"};
    return {StatusCode::kResourceExhausted,
            "plan: planning took longer than the limit of " + std::to_string(limit_ms_) +
                " ms (plan_timeout_ms); the model's layer graph is too large or its timings "
                "too extreme to plan"};
  }

 private:
  int64_t limit_ms_ = 0;
  Clock::time_point at_ = Clock::time_point::max();
  const std::atomic<bool>* cancel_ = nullptr;
  mutable uint32_t calls_ = 0;
};

}  // namespace bgl::plan
