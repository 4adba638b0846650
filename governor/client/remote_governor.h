// RemoteGovernor: the Governor interface over gRPC to bgl-governord (normally its unix socket),
// for the C++ tests and benchmarks (and the read side of tools). Training plans through the
// Python package's client (bagualu/planning/governor.py); both follow one table of what each
// failed call does, docs/operations.md "Failed calls", checked against the same cases
// (tests/governor_client_cases.json) on both sides. Planning calls use a short deadline and fail
// fast while the daemon is down (the caller answers them with its embedded planner,
// AnswerInProcess); a background thread retries with jittered exponential backoff and registers
// every session again once the daemon answers (the handles callers hold keep working; the
// sessions held before an outage are ended), at once for a session the daemon lost.
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
#include <vector>

#include "bagualu/v1/governor.grpc.pb.h"
#include "governor/client/failure.h"
#include "governor/client/governor.h"

namespace bgl::gov {

// The default daemon address.
inline constexpr const char* kDefaultGovernorAddress = "unix:///run/bagualu/governor.sock";

// Address from $BGL_GOVERNOR (as bglctl, bgl-top and the Python package read it), else the
// default unix socket.
std::string GovernorAddressFromEnv();

// A channel to the daemon with the message-size limits and reconnect backoff the clients use.
std::shared_ptr<grpc::Channel> MakeGovernorChannel(
    const std::string& address,
    std::chrono::milliseconds max_backoff = std::chrono::milliseconds(1000));

// The defaults are the Python client's (docs/operations.md, "Failed calls").
struct RemoteOptions {
  std::string address = kDefaultGovernorAddress;
  std::chrono::microseconds deadline{500000};         // Plan, PlanAfterGate, Report, Unregister
  std::chrono::milliseconds register_deadline{2000};  // Register, re-register
  std::chrono::milliseconds probe_deadline{50};       // the retry's first call (ListSessions)
  std::chrono::milliseconds min_backoff{100};         // the first retry after an outage
  std::chrono::milliseconds max_backoff{2000};        // the delay doubles up to this
  double backoff_jitter = 0.2;  // each delay is drawn from [1 - jitter, 1] x the nominal one
  bool reconnect = true;        // false: no background thread (tools)
};

class RemoteGovernor : public Governor {
 public:
  explicit RemoteGovernor(RemoteOptions options = {});
  ~RemoteGovernor() override;
  RemoteGovernor(const RemoteGovernor&) = delete;
  RemoteGovernor& operator=(const RemoteGovernor&) = delete;

  Result<SessionInfo> Register(const Registration& registration) override;
  Result<plan::Plan> Plan(const std::string& session_id, const plan::SchedulePoint& point) override;
  Result<plan::Plan> PlanAfterGate(const std::string& session_id,
                                   const GateObservation& gate) override;
  Status Report(const std::string& session_id, const Consumption& consumption) override;
  Status Unregister(const std::string& session_id) override;

  // Keeps `registration` and registers it with the daemon as soon as the daemon answers (now,
  // or after a reconnect); returns the handle at once, also while the daemon is absent.
  std::string RegisterWhenAvailable(const Registration& registration);
  // The daemon's current id for a handle ("" while not registered there).
  std::string DaemonSessionId(const std::string& handle) const;
  // True while the daemon answers (false after an outage until the retry registers again).
  bool connected() const { return connected_.load(std::memory_order_acquire); }
  // Waits up to `timeout` until the daemon answers and `handle` is registered with it.
  bool WaitReady(const std::string& handle, std::chrono::milliseconds timeout);
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
  // Records a failed planning call as the table says (an outage or the quota marks the daemon
  // down, a lost session is registered again at once). Returns the Status to give the caller.
  Status OnFailure(const std::string& handle, const grpc::Status& status);
  // The daemon is down: every session registers again once it answers; the ids it held are
  // ended then (the daemon may still hold them, e.g. after a missed deadline).
  void MarkDown();
  void SetConnected();
  std::chrono::milliseconds Jittered(std::chrono::milliseconds nominal);
  void EndStaleSessions();
  void ReconnectLoop();
  bool RegisterEntry(const std::string& handle);
  void SetDeadline(grpc::ClientContext& ctx, std::chrono::microseconds d) const;

  RemoteOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<bagualu::v1::Governor::Stub> stub_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Entry> sessions_;  // handle -> registration and current daemon id
  std::vector<std::string> stale_;         // daemon ids held before an outage, to end
  uint64_t next_pending_ = 0;
  bool stopping_ = false;
  bool wake_ = false;
  std::atomic<bool> connected_{true};
  std::atomic<uint64_t> reregistrations_{0};
  std::thread reconnect_thread_;
};

}  // namespace bgl::gov
