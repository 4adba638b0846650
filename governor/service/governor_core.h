// GovernorCore: the request handlers of the Governor service without the transport: sessions,
// validation, authorisation and per-GPU state. The gRPC adapter (GovernorService) and the fuzz
// harness both call it. Thread-safe; calls on one session serialise on that session.
#pragma once

#include <grpcpp/support/status.h>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "bagualu/v1/governor.pb.h"
#include "governor/common/node_arbiter.h"
#include "governor/common/registration.h"
#include "governor/service/caller.h"
#include "governor/service/metrics.h"
#include "governor/service/session.h"

namespace bgl::gov {

class GovernorCore {
 public:
  // `metrics` may be null (tests); it must outlive the core.
  // With `node`, sessions get pinned host grants and bandwidth shares from it (issue 14);
  // without, plans have no host limit and full bandwidth.
  explicit GovernorCore(Metrics* metrics = nullptr, RequestLimits limits = {},
                        std::optional<NodeArbiter> node = std::nullopt);

  // Limits can change at run time (SIGHUP); existing sessions are kept.
  void SetLimits(const RequestLimits& limits);
  RequestLimits limits() const;
  // The node's calibration (bgl-governord --calibration: the machine's measured rooflines, a
  // checked calibration document), applied to every session registered after the call before
  // the session's own calibration; null: none.
  void SetCalibration(std::optional<nlohmann::json> calibration);
  // Draining: plans in progress stop at their next deadline check (UNAVAILABLE) and new ones
  // are refused the same way, so SIGTERM never waits for a long plan. Any thread; irreversible.
  void CancelPlans();

  grpc::Status Register(const Caller& caller, const bagualu::v1::RegisterRequest& req,
                        bagualu::v1::RegisterResponse* resp);
  grpc::Status Plan(const Caller& caller, const bagualu::v1::PlanRequest& req,
                    bagualu::v1::PlanResponse* resp);
  grpc::Status Report(const Caller& caller, const bagualu::v1::ReportRequest& req,
                      bagualu::v1::ReportResponse* resp);
  grpc::Status Unregister(const Caller& caller, const bagualu::v1::UnregisterRequest& req,
                          bagualu::v1::UnregisterResponse* resp);
  grpc::Status ListSessions(const Caller& caller, const bagualu::v1::ListSessionsRequest& req,
                            bagualu::v1::ListSessionsResponse* resp);
  grpc::Status Snapshot(const Caller& caller, const bagualu::v1::SnapshotRequest& req,
                        bagualu::v1::SnapshotResponse* resp);
  // Checks a WatchRequest (the stream loop lives in the transport).
  grpc::Status ValidateWatch(const bagualu::v1::WatchRequest& req) const;
  // One Watch sample: per-GPU state over the sessions the caller may see.
  void Sample(const Caller& caller, bagualu::v1::WatchResponse* resp);

  // Removes the sessions of processes `alive` says are gone; returns how many.
  int Reap(const std::function<bool(int32_t pid)>& alive);
  // Publishes per-GPU gauges, per-session host grants and use, per-link offloading sessions and
  // the session count.
  void PublishMetrics();
  size_t session_count() const;
  // The node's grants now: (session id, grant), and the sum; empty without a NodeArbiter.
  std::vector<std::pair<std::string, int64_t>> HostGrants() const;

 private:
  // The session `id` names, if `caller` may change it (owner uid and pid) or, with
  // `read_only`, read it (owner uid, or admin). NOT_FOUND when there is none; PERMISSION_DENIED
  // naming the id when it is another user's (or, to change it, another process's).
  grpc::Status Find(const Caller& caller, const std::string& id, bool read_only,
                    std::shared_ptr<Session>* out) const;
  grpc::Status Reject(const char* method, grpc::Status status);
  bool Visible(const Caller& caller, const Session& s) const;
  // Returns `node_id`'s grant to the node (no-op without an arbiter).
  void ReleaseGrant(uint64_t node_id);
  // Fills the node fields of a Session message from `s` and the arbiter.
  void FillNodeFields(const Session& s, bagualu::v1::Session* out) const;

  Metrics* metrics_;
  std::atomic<bool> stopping_{false};  // set by CancelPlans; read by every plan's Deadline
  mutable std::shared_mutex mu_;       // guards sessions_ and limits_
  RequestLimits limits_;
  std::optional<nlohmann::json> calibration_;  // guarded by mu_
  std::unordered_map<std::string, std::shared_ptr<Session>> sessions_;
  // The node's grants and link shares. Guarded by node_mu_, which is taken alone (never while
  // holding mu_, a planner's lock or a session's mu).
  mutable std::mutex node_mu_;
  std::optional<NodeArbiter> node_;
  uint64_t next_node_id_ = 1;  // guarded by node_mu_
  // The warm-up plans the sessions of one job share (issue 43), by SharingKey (job id and every
  // registration field that shapes a plan); held by the sessions' planners, so the plans outlive
  // any one session and go with the job's last. Guarded by mu_.
  std::unordered_map<std::string, std::weak_ptr<plan::SharedPlans>> shared_plans_;
};

}  // namespace bgl::gov
