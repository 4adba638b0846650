// The dashboard's data: frames from the daemon's Watch stream. ReadOneFrame serves --once and
// --json; WatchFeed keeps a stream open on a background thread and reconnects with backoff
// when the daemon restarts, so the dashboard survives upgrades.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "bagualu/v1/governor.grpc.pb.h"
#include "base/status.h"

namespace bgl::top {

// One frame, or an Unavailable error that names `address`.
Result<bagualu::v1::WatchResponse> ReadOneFrame(const std::shared_ptr<grpc::Channel>& channel,
                                                const std::string& address,
                                                std::chrono::milliseconds timeout);

// A Watch stream read on a background thread.
class WatchFeed {
 public:
  WatchFeed(std::shared_ptr<grpc::Channel> channel, std::string address, int interval_ms);
  ~WatchFeed();  // cancels the stream and joins the thread
  WatchFeed(const WatchFeed&) = delete;
  WatchFeed& operator=(const WatchFeed&) = delete;

  // Frames received since the last call, oldest first.
  std::vector<bagualu::v1::WatchResponse> Drain();
  // Why no frames arrive (empty while streaming).
  std::string Problem() const;

 private:
  void Run();

  std::shared_ptr<grpc::Channel> channel_;
  std::string address_;
  int interval_ms_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;
  grpc::ClientContext* current_ = nullptr;  // the open stream's context, for cancellation
  std::vector<bagualu::v1::WatchResponse> frames_;
  std::string problem_;
  std::thread thread_;
};

}  // namespace bgl::top
