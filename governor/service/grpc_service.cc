#include "governor/service/grpc_service.h"

#include <algorithm>
#include <chrono>
#include <thread>

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
    caller->admin = creds->uid == 0 ||
                    (admin >= 0 && (creds->gid == static_cast<uint32_t>(admin) ||
                                    std::find(creds->groups.begin(), creds->groups.end(),
                                              static_cast<gid_t>(admin)) != creds->groups.end()));
    return true;
  }
  if (peer.rfind("fd:", 0) == 0) {
    *status = {grpc::StatusCode::UNAUTHENTICATED, "peer: no credentials for this connection"};
    return false;
  }
  // TCP: no peer credentials; the caller sees only sessions created over TCP.
  *caller = Caller{};
  return true;
}

#define BGL_RESOLVE_CALLER()                                \
  Caller caller;                                            \
  if (grpc::Status s; !Resolve(ctx, &caller, &s)) return s

grpc::Status GovernorService::Register(grpc::ServerContext* ctx, const pb::RegisterRequest* req,
                                       pb::RegisterResponse* resp) {
  BGL_RESOLVE_CALLER();
  return core_->Register(caller, *req, resp);
}

grpc::Status GovernorService::Plan(grpc::ServerContext* ctx, const pb::PlanRequest* req,
                                   pb::PlanResponse* resp) {
  BGL_RESOLVE_CALLER();
  return core_->Plan(caller, *req, resp);
}

grpc::Status GovernorService::Report(grpc::ServerContext* ctx, const pb::ReportRequest* req,
                                     pb::ReportResponse* resp) {
  BGL_RESOLVE_CALLER();
  return core_->Report(caller, *req, resp);
}

grpc::Status GovernorService::Unregister(grpc::ServerContext* ctx,
                                         const pb::UnregisterRequest* req,
                                         pb::UnregisterResponse* resp) {
  BGL_RESOLVE_CALLER();
  return core_->Unregister(caller, *req, resp);
}

grpc::Status GovernorService::ListSessions(grpc::ServerContext* ctx,
                                           const pb::ListSessionsRequest* req,
                                           pb::ListSessionsResponse* resp) {
  BGL_RESOLVE_CALLER();
  return core_->ListSessions(caller, *req, resp);
}

grpc::Status GovernorService::Snapshot(grpc::ServerContext* ctx, const pb::SnapshotRequest* req,
                                       pb::SnapshotResponse* resp) {
  BGL_RESOLVE_CALLER();
  return core_->Snapshot(caller, *req, resp);
}

grpc::Status GovernorService::Watch(grpc::ServerContext* ctx, const pb::WatchRequest* req,
                                    grpc::ServerWriter<pb::WatchResponse>* writer) {
  BGL_RESOLVE_CALLER();
  if (grpc::Status s = core_->ValidateWatch(*req); !s.ok()) return s;
  const auto interval = std::chrono::milliseconds(req->interval_ms() == 0 ? 1000
                                                                          : req->interval_ms());
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
