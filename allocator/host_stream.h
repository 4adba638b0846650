// HostStream: a FIFO work queue run by one worker thread, the host backend's stand-in for a
// CUDA stream. Work items run in order; an event is "all items enqueued so far have run".
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "allocator/export.h"

namespace bgl::alloc {

// A simulated device stream. Thread safe. Items run one at a time in queue order, on the worker
// or on a thread waiting for them. The destructor drains the queue.
class BGL_ALLOC_INTERNAL HostStream {
 public:
  HostStream();
  ~HostStream();
  HostStream(const HostStream&) = delete;
  HostStream& operator=(const HostStream&) = delete;

  // Queues `work`; returns its ticket (1, 2, ...).
  std::uint64_t enqueue(std::function<void()> work);
  // As enqueue, but only the worker runs `work`, never a waiting thread (a stalled item must
  // not hold up the thread whose wait is bounded).
  std::uint64_t enqueue_on_worker(std::function<void()> work);
  // Ticket of the last queued item (0 when nothing was ever queued).
  std::uint64_t enqueued() const;
  // True when every item with ticket <= `ticket` has run.
  bool done(std::uint64_t ticket) const;
  // Blocks until every item with ticket <= `ticket` has run. While the worker is idle the
  // caller runs the next queued items itself (in order, one at a time with the worker), which
  // spares a synchronous copy two thread hand-offs.
  void wait(std::uint64_t ticket) const;
  // As wait, for at most `timeout`; false when the items had not all run by then.
  bool wait_for(std::uint64_t ticket, std::chrono::milliseconds timeout) const;
  // Blocks until the queue is empty.
  void synchronize() const;
  bool synchronize_for(std::chrono::milliseconds timeout) const;

  // True when `p` points to a live HostStream (so foreign handles can be told apart).
  static bool is_live(const void* p);
  // The process-unique serial of the live HostStream at `p` (never 0), or 0.
  static std::uint64_t serial_of(const void* p);
  // done(ticket) of the stream at `p` if it is still the one with `serial` (0: any live one);
  // true when that stream was destroyed (its destructor ran every item first), without
  // touching it.
  static bool done_if_live(const void* p, std::uint64_t serial, std::uint64_t ticket);
  // Whether the stream at `p` with `serial` is still alive (else an event on it is complete).
  static bool same_stream(const void* p, std::uint64_t serial);

 private:
  void run();
  // Runs the front item with `lock` released; needs it held, the queue non-empty, none running.
  void run_front(std::unique_lock<std::mutex>& lock) const;

  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  struct Item {
    std::function<void()> work;
    bool worker_only = false;
  };
  std::uint64_t push(std::function<void()> work, bool worker_only);
  // Blocks until `ticket` ran or `deadline` (none: max) passed; false on the deadline.
  bool wait_until(std::uint64_t ticket, std::chrono::steady_clock::time_point deadline) const;

  mutable std::deque<Item> queue_;
  std::uint64_t enqueued_ = 0;
  mutable std::uint64_t completed_ = 0;
  mutable bool running_ = false;  // an item is running (on the worker or a waiter)
  bool stop_ = false;
  const std::uint64_t serial_;
  std::thread worker_;
};

}  // namespace bgl::alloc
