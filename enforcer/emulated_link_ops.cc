// EmulatedLinkOps (emulated_link_ops.h). Each copy between device and pinned memory becomes
// three items in its stream's order: note the start, the upstream's copy, wait until start +
// floor + bytes / rate. On the calling thread (a null stream, synchronous copies) the same three
// steps run at once.
#include "enforcer/emulated_link_ops.h"

#include <chrono>
#include <iterator>
#include <map>
#include <mutex>
#include <thread>

#include "allocator/host_stream.h"
#include "enforcer/detail/forwarding_ops.h"

namespace bgl::enf {
namespace {

using alloc::HostStream;

class SteadyLinkClock final : public LinkClock {
 public:
  double now_s() override {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  void sleep_until_s(double t) override {
    const auto until = std::chrono::steady_clock::time_point(
        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
            std::chrono::duration<double>(t)));
    std::this_thread::sleep_until(until);
  }
};

class EmulatedLinkOps final : public detail::ForwardingOps {
 public:
  EmulatedLinkOps(std::unique_ptr<DeviceOps> upstream, const LinkTimes& times, LinkClock* clock)
      : ForwardingOps(std::move(upstream)), times_(times), clock_(clock) {}

  Status copy(void* dst, const void* src, std::size_t n, Stream s) override {
    const plan::Roofline* link = pinned(dst, n)   ? &times_.offload
                                 : pinned(src, n) ? &times_.reload
                                                  : nullptr;
    if (link == nullptr) return upstream().copy(dst, src, n, s);
    const double seconds = link->Time(static_cast<double>(n));
    HostStream* h = HostStream::is_live(s) ? static_cast<HostStream*>(s) : nullptr;
    if (h == nullptr) {  // the calling thread
      const double start = clock_->now_s();
      const Status st = upstream().copy(dst, src, n, s);
      clock_->sleep_until_s(start + seconds);
      return st;
    }
    // The start is when the stream reaches the copy (after what was queued before it).
    auto start = std::make_shared<double>(0.0);
    h->enqueue([this, start] { *start = clock_->now_s(); });
    const Status st = upstream().copy(dst, src, n, s);
    h->enqueue([this, start, seconds] { clock_->sleep_until_s(*start + seconds); });
    return st;
  }

  void* host_alloc(std::size_t bytes) override {
    void* p = upstream().host_alloc(bytes);
    if (p != nullptr) {
      std::lock_guard<std::mutex> lock(mu_);
      ranges_[reinterpret_cast<std::uintptr_t>(p)] = bytes;
    }
    return p;
  }
  void host_free(void* p) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ranges_.erase(reinterpret_cast<std::uintptr_t>(p));
    }
    upstream().host_free(p);
  }

 private:
  // Whether [p, p + n) lies in pinned host memory this object handed out.
  bool pinned(const void* p, std::size_t n) {
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ranges_.upper_bound(a);
    if (it == ranges_.begin()) return false;
    it = std::prev(it);
    return a + n <= it->first + it->second;
  }

  const LinkTimes times_;
  LinkClock* const clock_;
  std::mutex mu_;
  std::map<std::uintptr_t, std::size_t> ranges_;  // pinned allocations: start -> bytes
};

}  // namespace

LinkClock& steady_link_clock() {
  static SteadyLinkClock clock;
  return clock;
}

std::unique_ptr<DeviceOps> make_emulated_link_ops(std::unique_ptr<DeviceOps> upstream,
                                                  const LinkTimes& times, LinkClock* clock) {
  return std::make_unique<EmulatedLinkOps>(std::move(upstream), times,
                                           clock != nullptr ? clock : &steady_link_clock());
}

}  // namespace bgl::enf
