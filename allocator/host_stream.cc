#include "allocator/host_stream.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <random>
#include <unordered_map>

namespace bgl::alloc {
namespace {

std::mutex& registry_mu() {
  static std::mutex mu;
  return mu;
}
// Live streams and their serials (a new stream may reuse a destroyed one's address).
std::unordered_map<const void*, std::uint64_t>& registry() {
  static auto* map = new std::unordered_map<const void*, std::uint64_t>();
  return *map;
}
std::atomic<std::uint64_t> next_serial{1};

// BGL_HOST_STREAM_JITTER_US=N: every item waits a random 0..N microseconds before it runs, so
// tests can shake out races between streams that a quiet machine never shows (0: off).
int jitter_us() {
  static const int us = [] {
    const char* v = std::getenv("BGL_HOST_STREAM_JITTER_US");
    return v == nullptr ? 0 : std::max(0, std::atoi(v));
  }();
  return us;
}

void jitter() {
  const int us = jitter_us();
  if (us == 0) return;
  thread_local std::minstd_rand rng(std::random_device{}());
  std::this_thread::sleep_for(std::chrono::microseconds(rng() % (us + 1)));
}

}  // namespace

HostStream::HostStream() : serial_(next_serial.fetch_add(1)) {
  {
    std::lock_guard<std::mutex> lock(registry_mu());
    registry()[this] = serial_;
  }
  worker_ = std::thread([this] { run(); });
}

HostStream::~HostStream() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
  std::lock_guard<std::mutex> lock(registry_mu());
  registry().erase(this);
}

bool HostStream::is_live(const void* p) {
  if (p == nullptr) return false;
  std::lock_guard<std::mutex> lock(registry_mu());
  return registry().count(p) != 0;
}

std::uint64_t HostStream::serial_of(const void* p) {
  if (p == nullptr) return 0;
  std::lock_guard<std::mutex> lock(registry_mu());
  const auto it = registry().find(p);
  return it == registry().end() ? 0 : it->second;
}

bool HostStream::done_if_live(const void* p, std::uint64_t serial, std::uint64_t ticket) {
  std::lock_guard<std::mutex> lock(registry_mu());  // the stream cannot go while it is held
  const auto it = registry().find(p);
  if (it == registry().end() || (serial != 0 && it->second != serial)) return true;
  return static_cast<const HostStream*>(p)->done(ticket);
}

bool HostStream::same_stream(const void* p, std::uint64_t serial) {
  std::lock_guard<std::mutex> lock(registry_mu());
  const auto it = registry().find(p);
  return it != registry().end() && (serial == 0 || it->second == serial);
}

std::uint64_t HostStream::enqueue(std::function<void()> work) {
  return push(std::move(work), false);
}

std::uint64_t HostStream::enqueue_on_worker(std::function<void()> work) {
  return push(std::move(work), true);
}

std::uint64_t HostStream::push(std::function<void()> work, bool worker_only) {
  std::uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(Item{std::move(work), worker_only});
    ticket = ++enqueued_;
  }
  cv_.notify_all();
  return ticket;
}

std::uint64_t HostStream::enqueued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return enqueued_;
}

bool HostStream::done(std::uint64_t ticket) const {
  std::lock_guard<std::mutex> lock(mu_);
  return completed_ >= ticket;
}

void HostStream::wait(std::uint64_t ticket) const {
  wait_until(ticket, std::chrono::steady_clock::time_point::max());
}

bool HostStream::wait_for(std::uint64_t ticket, std::chrono::milliseconds timeout) const {
  return wait_until(ticket, std::chrono::steady_clock::now() + timeout);
}

bool HostStream::wait_until(std::uint64_t ticket,
                            std::chrono::steady_clock::time_point deadline) const {
  std::unique_lock<std::mutex> lock(mu_);
  while (completed_ < ticket) {
    if (!running_ && !queue_.empty() && !queue_.front().worker_only) {
      run_front(lock);  // the worker is idle or not yet awake: run the next item here
      continue;
    }
    if (deadline == std::chrono::steady_clock::time_point::max()) {
      cv_.wait(lock);
    } else if (cv_.wait_until(lock, deadline) == std::cv_status::timeout) {
      return completed_ >= ticket;
    }
  }
  return true;
}

void HostStream::synchronize() const { wait(enqueued()); }

bool HostStream::synchronize_for(std::chrono::milliseconds timeout) const {
  return wait_for(enqueued(), timeout);
}

void HostStream::run_front(std::unique_lock<std::mutex>& lock) const {
  auto work = std::move(queue_.front().work);
  queue_.pop_front();
  running_ = true;
  lock.unlock();
  jitter();
  work();
  lock.lock();
  running_ = false;
  ++completed_;
  cv_.notify_all();
}

void HostStream::run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return (stop_ && queue_.empty()) || (!queue_.empty() && !running_); });
    if (queue_.empty()) return;  // stop_ and drained
    run_front(lock);
  }
}

}  // namespace bgl::alloc
