// RemoteGovernor: the Governor interface over gRPC to bgl-governord (normally its unix socket).
// Planning calls use a short deadline (20 ms by default) and fail fast while the daemon is
// down; a background thread reconnects with exponential backoff and re-registers every session
// after a daemon restart, so the handles callers hold keep working (old -> new id mapping).
// Also exposes the read-side RPCs (health, sessions, watch, snapshot) for tools.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "bagualu/v1/governor.grpc.pb.h"
#include "governor/client/governor.h"

namespace bgl::gov {

// The default daemon address.
inline constexpr const char* kDefaultGovernorAddress = "unix:///run/bagualu/governor.sock";

// Address from $BGL_GOVERNOR (as bglctl, bgl-top and the Python package read it), else the
// default unix socket.
std::string GovernorAddressFromEnv();

// A channel to the daemon with the message-size limits and reconnect backoff the clients use.
std::shared_ptr<grpc::Channel> MakeGovernorChannel(const std::string& address,
                                                   std::chrono::milliseconds max_backoff =
                                                       std::chrono::milliseconds(1000));

struct RemoteOptions {
  std::string address = kDefaultGovernorAddress;
  std::chrono::microseconds deadline{20000};                // Plan, PlanAfterGate, Report
  std::chrono::milliseconds register_deadline{2000};        // Register, Unregister, re-register
  std::chrono::milliseconds min_backoff{10};                // reconnect probing
  std::chrono::milliseconds max_backoff{1000};
  bool reconnect = true;  // false: no background thread (tools)
};

class RemoteGovernor : public Governor {
 public:
  explicit RemoteGovernor(RemoteOptions options = {});
  ~RemoteGovernor() override;
  RemoteGovernor(const RemoteGovernor&) = delete;
  RemoteGovernor& operator=(const RemoteGovernor&) = delete;

  Result<SessionInfo> Register(const Registration& registration) override;
  Result<plan::Plan> Plan(const std::string& session_id,
                          const plan::SchedulePoint& point) override;
  Result<plan::Plan> PlanAfterGate(const std::string& session_id,
                                   const GateObservation& gate) override;
  Status Report(const std::string& session_id, const Consumption& consumption) override;
  Status Unregister(const std::string& session_id) override;

  // Keeps `registration` and registers it with the daemon as soon as the daemon answers (now,
  // or after a reconnect); returns the handle at once, also while the daemon is absent.
  std::string RegisterWhenAvailable(const Registration& registration);
  // The daemon's current id for a handle ("" while not registered there).
  std::string DaemonSessionId(const std::string& handle) const;
  // True while the daemon answers (false after UNAVAILABLE until the reconnect succeeds).
  bool connected() const { return connected_.load(std::memory_order_acquire); }
  // Number of successful re-registrations after daemon restarts (for tests and logs).
  uint64_t reregistrations() const { return reregistrations_.load(); }

  // Read side, for tools (bgl-top, bglctl). `deadline` bounds each call.
  Status Health(std::chrono::milliseconds deadline = std::chrono::milliseconds(1000));
  Result<bagualu::v1::ListSessionsResponse> ListSessions(
      std::chrono::milliseconds deadline = std::chrono::milliseconds(1000));
  Result<bagualu::v1::SnapshotResponse> Snapshot(
      const std::string& session_id,
      std::chrono::milliseconds deadline = std::chrono::milliseconds(5000));
  // Streams until `on_sample` returns false, max_samples arrive, or the stream ends.
  Status Watch(const bagualu::v1::WatchRequest& request,
               const std::function<bool(const bagualu::v1::WatchResponse&)>& on_sample);
  bagualu::v1::Governor::Stub& stub() { return *stub_; }
  const RemoteOptions& options() const { return options_; }

 private:
  struct Entry {
    Registration registration;
    std::string daemon_id;  // "" while not registered with the current daemon
    bool registered_once = false;
  };
  // The daemon id for a handle, or an error (unknown handle, or not registered yet).
  Result<std::string> Resolve(const std::string& handle) const;
  // Records a failed RPC: UNAVAILABLE marks the daemon down, an unknown session marks the
  // handle for re-registration. Returns the Status to give the caller.
  Status OnFailure(const std::string& handle, const grpc::Status& status);
  void MarkDown();
  void ReconnectLoop();
  bool RegisterEntry(const std::string& handle);
  void SetDeadline(grpc::ClientContext& ctx, std::chrono::microseconds d) const;

  RemoteOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<bagualu::v1::Governor::Stub> stub_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Entry> sessions_;  // handle -> registration and current daemon id
  uint64_t next_pending_ = 0;
  bool stopping_ = false;
  bool wake_ = false;
  std::atomic<bool> connected_{true};
  std::atomic<uint64_t> reregistrations_{0};
  std::thread reconnect_thread_;
};

}  // namespace bgl::gov
