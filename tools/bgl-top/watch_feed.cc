#include "tools/bgl-top/watch_feed.h"

#include <algorithm>

#include "tools/bglctl/governor_address.h"

namespace bgl::top {

Result<bagualu::v1::WatchResponse> ReadOneFrame(const std::shared_ptr<grpc::Channel>& channel,
                                                const std::string& address,
                                                std::chrono::milliseconds timeout) {
  auto stub = bagualu::v1::Governor::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  bagualu::v1::WatchRequest request;
  request.set_interval_ms(100);
  request.set_max_samples(1);
  auto reader = stub->Watch(&ctx, request);
  bagualu::v1::WatchResponse frame;
  const bool got = reader->Read(&frame);
  if (got) ctx.TryCancel();  // one frame is all we need
  const grpc::Status status = reader->Finish();
  if (got) return frame;
  if (status.ok()) {
    return Status(StatusCode::kUnavailable,
                  "the governor at " + address + " ended the Watch stream without a frame");
  }
  return Status(StatusCode::kUnavailable, tools::DescribeRpcFailure(address, status));
}

WatchFeed::WatchFeed(std::shared_ptr<grpc::Channel> channel, std::string address, int interval_ms)
    : channel_(std::move(channel)), address_(std::move(address)), interval_ms_(interval_ms) {
  thread_ = std::thread([this] { Run(); });
}

WatchFeed::~WatchFeed() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    if (current_ != nullptr) current_->TryCancel();
  }
  wake_.notify_all();
  thread_.join();
}

std::vector<bagualu::v1::WatchResponse> WatchFeed::Drain() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(frames_, {});
}

std::string WatchFeed::Problem() const {
  std::lock_guard<std::mutex> lock(mu_);
  return problem_;
}

void WatchFeed::Run() {
  auto stub = bagualu::v1::Governor::NewStub(channel_);
  std::chrono::milliseconds backoff(250);
  const std::chrono::milliseconds max_backoff(5000);
  while (true) {
    grpc::ClientContext ctx;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      current_ = &ctx;
    }
    bagualu::v1::WatchRequest request;
    request.set_interval_ms(interval_ms_);
    auto reader = stub->Watch(&ctx, request);
    bagualu::v1::WatchResponse frame;
    while (reader->Read(&frame)) {
      std::lock_guard<std::mutex> lock(mu_);
      frames_.push_back(std::move(frame));
      frame = {};
      // Keep memory bounded if the UI stalls.
      if (frames_.size() > 1024) frames_.erase(frames_.begin());
      problem_.clear();
      backoff = std::chrono::milliseconds(250);
    }
    const grpc::Status status = reader->Finish();
    std::unique_lock<std::mutex> lock(mu_);
    current_ = nullptr;
    if (stop_) return;
    problem_ = status.ok() ? "the governor at " + address_ + " ended the stream; reconnecting"
                           : tools::DescribeRpcFailure(address_, status) + "; reconnecting";
    wake_.wait_for(lock, backoff, [this] { return stop_; });
    backoff = std::min(backoff * 2, max_backoff);
  }
}

}  // namespace bgl::top
