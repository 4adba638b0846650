// HostStream: a FIFO work queue run by one worker thread, the host backend's stand-in for a
// CUDA stream. Work items run in order; an event is "all items enqueued so far have run".
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace bgl::alloc {

// A simulated device stream. Thread safe. The destructor drains the queue.
class HostStream {
 public:
  HostStream();
  ~HostStream();
  HostStream(const HostStream&) = delete;
  HostStream& operator=(const HostStream&) = delete;

  // Queues `work`; returns its ticket (1, 2, ...).
  std::uint64_t enqueue(std::function<void()> work);
  // Ticket of the last queued item (0 when nothing was ever queued).
  std::uint64_t enqueued() const;
  // True when every item with ticket <= `ticket` has run.
  bool done(std::uint64_t ticket) const;
  // Blocks until every item with ticket <= `ticket` has run.
  void wait(std::uint64_t ticket) const;
  // Blocks until the queue is empty.
  void synchronize() const;

  // True when `p` points to a live HostStream (so foreign handles can be told apart).
  static bool is_live(const void* p);

 private:
  void run();

  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  std::uint64_t enqueued_ = 0;
  std::uint64_t completed_ = 0;
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace bgl::alloc
