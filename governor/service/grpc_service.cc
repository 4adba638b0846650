#include "governor/service/grpc_service.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "governor/service/error_text.h"

namespace bgl::gov {

namespace pb = bagualu::v1;

bool GovernorService::Resolve(grpc::ServerContext* ctx, Caller* caller,
                              grpc::Status* status) const {
  const std::string peer = ctx->peer();
  if (auto creds = peers_->Lookup(peer)) {
    caller->uid = creds->uid;
    caller->pid = creds->pid;
    caller->user = creds->user;
    const int64_t admin = admin_gid_.load();
    // Privileged readers: root, the daemon's own uid (the admin tools run as the service's
    // user; it can read the daemon's memory anyway) and the admin group.
    caller->admin = creds->uid == 0 || creds->uid == static_cast<uint32_t>(geteuid()) ||
                    (admin >= 0 && (creds->gid == static_cast<uint32_t>(admin) ||
                                    std::find(creds->groups.begin(), creds->groups.end(),
                                              static_cast<gid_t>(admin)) != creds->groups.end()));
    return true;
  }
  if (peer.rfind("fd:", 0) == 0) {
    *status = {grpc::StatusCode::UNAUTHENTICATED,
               "peer: no credentials for this connection (it was closed or its number reused)"};
    return false;
  }
  // TCP: no peer credentials; the caller sees only sessions created over TCP.
  *caller = Caller{};
  return true;
}

#define BGL_RESOLVE_CALLER() \
  Caller caller;             \
  if (grpc::Status s; !Resolve(ctx, &caller, &s)) return s

// Every status leaving the daemon goes through BoundErrorStatus (see error_text.h).

grpc::Status GovernorService::Register(grpc::ServerContext* ctx, const pb::RegisterRequest* req,
                                       pb::RegisterResponse* resp) {
  BGL_RESOLVE_CALLER();
  return BoundErrorStatus(core_->Register(caller, *req, resp));
}

grpc::Status GovernorService::Plan(grpc::ServerContext* ctx, const pb::PlanRequest* req,
                                   pb::PlanResponse* resp) {
  BGL_RESOLVE_CALLER();
  return BoundErrorStatus(core_->Plan(caller, *req, resp));
}

grpc::Status GovernorService::Report(grpc::ServerContext* ctx, const pb::ReportRequest* req,
                                     pb::ReportResponse* resp) {
  BGL_RESOLVE_CALLER();
  return BoundErrorStatus(core_->Report(caller, *req, resp));
}

grpc::Status GovernorService::Unregister(grpc::ServerContext* ctx, const pb::UnregisterRequest* req,
                                         pb::UnregisterResponse* resp) {
  BGL_RESOLVE_CALLER();
  return BoundErrorStatus(core_->Unregister(caller, *req, resp));
}

grpc::Status GovernorService::ListSessions(grpc::ServerContext* ctx,
                                           const pb::ListSessionsRequest* req,
                                           pb::ListSessionsResponse* resp) {
  BGL_RESOLVE_CALLER();
  return BoundErrorStatus(core_->ListSessions(caller, *req, resp));
}

grpc::Status GovernorService::Snapshot(grpc::ServerContext* ctx, const pb::SnapshotRequest* req,
                                       pb::SnapshotResponse* resp) {
  BGL_RESOLVE_CALLER();
  return BoundErrorStatus(core_->Snapshot(caller, *req, resp));
}

void GovernorService::SetWatchLimits(const WatchLimits& limits) {
  std::lock_guard<std::mutex> lock(watch_mu_);
  watch_limits_ = limits;
}

int GovernorService::watch_streams() const {
  std::lock_guard<std::mutex> lock(watch_mu_);
  return watch_total_;
}

grpc::Status GovernorService::AcquireWatch(uint32_t uid) {
  std::lock_guard<std::mutex> lock(watch_mu_);
  if (watch_total_ >= watch_limits_.max_watch_streams) {
    return {grpc::StatusCode::RESOURCE_EXHAUSTED,
            "max_watch_streams: the daemon's limit of " +
                std::to_string(watch_limits_.max_watch_streams) +
                " concurrent Watch streams is reached; close one (bgl-top) or raise the limit"};
  }
  int& mine = watch_per_uid_[uid];
  if (mine >= watch_limits_.max_watch_streams_per_uid) {
    if (mine == 0) watch_per_uid_.erase(uid);
    return {grpc::StatusCode::RESOURCE_EXHAUSTED,
            "max_watch_streams_per_uid: uid " + std::to_string(uid) + " already has " +
                std::to_string(mine) + " Watch streams open (limit " +
                std::to_string(watch_limits_.max_watch_streams_per_uid) + ")"};
  }
  ++mine;
  ++watch_total_;
  return grpc::Status::OK;
}

void GovernorService::ReleaseWatch(uint32_t uid) {
  std::lock_guard<std::mutex> lock(watch_mu_);
  --watch_total_;
  auto it = watch_per_uid_.find(uid);
  if (it != watch_per_uid_.end() && --it->second <= 0) watch_per_uid_.erase(it);
}

grpc::Status GovernorService::Watch(grpc::ServerContext* ctx, const pb::WatchRequest* req,
                                    grpc::ServerWriter<pb::WatchResponse>* writer) {
  BGL_RESOLVE_CALLER();
  if (grpc::Status s = core_->ValidateWatch(*req); !s.ok()) return BoundErrorStatus(s);
  if (stopping_.load()) return {grpc::StatusCode::UNAVAILABLE, "governor: shutting down"};
  if (grpc::Status s = AcquireWatch(caller.uid); !s.ok()) return s;
  grpc::Status result = RunWatch(caller, ctx, req, writer);
  ReleaseWatch(caller.uid);
  return result;
}

grpc::Status GovernorService::RunWatch(const Caller& caller, grpc::ServerContext* ctx,
                                       const pb::WatchRequest* req,
                                       grpc::ServerWriter<pb::WatchResponse>* writer) {
  const auto interval =
      std::chrono::milliseconds(req->interval_ms() == 0 ? 1000 : req->interval_ms());
  for (int sent = 0; req->max_samples() == 0 || sent < req->max_samples(); ++sent) {
    if (ctx->IsCancelled() || stopping_.load()) break;
    pb::WatchResponse sample;
    core_->Sample(caller, &sample);
    if (!writer->Write(sample)) break;
    if (req->max_samples() != 0 && sent + 1 == req->max_samples()) break;
    // Sleep in short steps so cancellation and drain end the stream promptly.
    const auto until = std::chrono::steady_clock::now() + interval;
    while (std::chrono::steady_clock::now() < until && !ctx->IsCancelled() && !stopping_.load()) {
      std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(
          std::chrono::milliseconds(20), until - std::chrono::steady_clock::now()));
    }
  }
  if (stopping_.load()) return {grpc::StatusCode::UNAVAILABLE, "governor: shutting down"};
  return grpc::Status::OK;
}

}  // namespace bgl::gov
