// GovernorService: the gRPC transport of GovernorCore. Resolves each call's Caller from the
// connection (PeerRegistry for unix-socket connections, unauthenticated for TCP), and runs the
// Watch stream loop until the client cancels, max_samples were sent, or the daemon drains.
// Each open Watch stream holds a server thread, so their number is limited per uid and in
// total (WatchLimits); every error message leaving the daemon is bounded (BoundErrorMessage).
// Thread-safe: gRPC calls the handlers from its thread pool; the setters from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>

#include "bagualu/v1/governor.grpc.pb.h"
#include "governor/service/governor_core.h"
#include "governor/service/peer_registry.h"

namespace bgl::gov {

// Concurrent Watch streams the daemon serves; one more is RESOURCE_EXHAUSTED naming the key.
struct WatchLimits {
  int max_watch_streams = 64;         // in total
  int max_watch_streams_per_uid = 8;  // per caller uid (all TCP callers share one uid)
};

class GovernorService final : public bagualu::v1::Governor::Service {
 public:
  GovernorService(GovernorCore* core, const PeerRegistry* peers) : core_(core), peers_(peers) {}

  // Members of this group (besides root) read every session; -1: none.
  void SetAdminGroup(int64_t gid) { admin_gid_.store(gid); }
  // Ends Watch streams promptly (drain).
  void BeginShutdown() { stopping_.store(true); }
  // Streams already open stay open when a limit is lowered; new ones are checked against it.
  void SetWatchLimits(const WatchLimits& limits);
  // Watch streams open now (in total).
  int watch_streams() const;

  grpc::Status Register(grpc::ServerContext* ctx, const bagualu::v1::RegisterRequest* req,
                        bagualu::v1::RegisterResponse* resp) override;
  grpc::Status Plan(grpc::ServerContext* ctx, const bagualu::v1::PlanRequest* req,
                    bagualu::v1::PlanResponse* resp) override;
  grpc::Status Report(grpc::ServerContext* ctx, const bagualu::v1::ReportRequest* req,
                      bagualu::v1::ReportResponse* resp) override;
  grpc::Status Unregister(grpc::ServerContext* ctx, const bagualu::v1::UnregisterRequest* req,
                          bagualu::v1::UnregisterResponse* resp) override;
  grpc::Status ListSessions(grpc::ServerContext* ctx, const bagualu::v1::ListSessionsRequest* req,
                            bagualu::v1::ListSessionsResponse* resp) override;
  grpc::Status Watch(grpc::ServerContext* ctx, const bagualu::v1::WatchRequest* req,
                     grpc::ServerWriter<bagualu::v1::WatchResponse>* writer) override;
  grpc::Status Snapshot(grpc::ServerContext* ctx, const bagualu::v1::SnapshotRequest* req,
                        bagualu::v1::SnapshotResponse* resp) override;

 private:
  // The caller of this RPC; false (and UNAUTHENTICATED in *status) for an unknown fd peer.
  bool Resolve(grpc::ServerContext* ctx, Caller* caller, grpc::Status* status) const;
  // Takes one Watch slot for `uid`; RESOURCE_EXHAUSTED naming the limit when none is free.
  grpc::Status AcquireWatch(uint32_t uid);
  void ReleaseWatch(uint32_t uid);
  grpc::Status RunWatch(const Caller& caller, grpc::ServerContext* ctx,
                        const bagualu::v1::WatchRequest* req,
                        grpc::ServerWriter<bagualu::v1::WatchResponse>* writer);

  GovernorCore* core_;
  const PeerRegistry* peers_;
  std::atomic<int64_t> admin_gid_{-1};
  std::atomic<bool> stopping_{false};
  mutable std::mutex watch_mu_;  // guards the three below
  WatchLimits watch_limits_;
  int watch_total_ = 0;
  std::unordered_map<uint32_t, int> watch_per_uid_;
};

}  // namespace bgl::gov
