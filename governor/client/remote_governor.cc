#include "governor/client/remote_governor.h"

#include <grpcpp/generic/generic_stub.h>

#include <algorithm>
#include <cstdlib>
#include <random>
#include <set>

#include "governor/common/convert.h"

namespace bgl::gov {
namespace {

namespace pb = bagualu::v1;

constexpr int kMaxMessageBytes = 32 << 20;

Status Unavailable(std::string msg) { return {StatusCode::kUnavailable, std::move(msg)}; }

bool MarksDown(Failure f) { return f == Failure::kOutage || f == Failure::kQuota; }

}  // namespace

std::string GovernorAddressFromEnv() {
  const char* env = std::getenv("BGL_GOVERNOR");
  return env != nullptr && *env != '\0' ? env : kDefaultGovernorAddress;
}

std::shared_ptr<grpc::Channel> MakeGovernorChannel(const std::string& address,
                                                   std::chrono::milliseconds max_backoff) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 10);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 10);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, static_cast<int>(max_backoff.count()));
  // Each client keeps its own connection so one slow caller never queues behind another.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

RemoteGovernor::RemoteGovernor(RemoteOptions options) : options_(std::move(options)) {
  channel_ = MakeGovernorChannel(options_.address, options_.max_backoff);
  stub_ = pb::Governor::NewStub(channel_);
  if (options_.reconnect) reconnect_thread_ = std::thread([this] { ReconnectLoop(); });
}

RemoteGovernor::~RemoteGovernor() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (reconnect_thread_.joinable()) reconnect_thread_.join();
}

void RemoteGovernor::SetDeadline(grpc::ClientContext& ctx, std::chrono::microseconds d) const {
  ctx.set_deadline(std::chrono::system_clock::now() + d);
}

Result<SessionInfo> RemoteGovernor::Register(const Registration& registration) {
  pb::RegisterRequest req;
  RegistrationToProto(registration, &req);
  pb::RegisterResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(ctx, options_.register_deadline);
  grpc::Status s = stub_->Register(&ctx, req, &resp);
  if (!s.ok()) {
    // The caller holds no handle to retry: only an outage concerns the other sessions.
    if (ClassifyFailure(s) == Failure::kOutage) MarkDown();
    return FromGrpcStatus(s);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    sessions_[resp.session_id()] = Entry{registration, resp.session_id(), true};
  }
  SetConnected();
  return SessionInfoFromProto(resp);
}

std::string RemoteGovernor::RegisterWhenAvailable(const Registration& registration) {
  std::string handle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    handle = "pending-" + std::to_string(++next_pending_);
    sessions_[handle] = Entry{registration, "", false};
    wake_ = true;
  }
  cv_.notify_all();
  return handle;
}

std::string RemoteGovernor::DaemonSessionId(const std::string& handle) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sessions_.find(handle);
  return it == sessions_.end() ? std::string() : it->second.daemon_id;
}

Result<std::string> RemoteGovernor::Resolve(const std::string& handle) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sessions_.find(handle);
  if (it == sessions_.end()) return NotFound("session_id: unknown session '" + handle + "'");
  if (it->second.daemon_id.empty()) {
    return Unavailable("governor: session '" + handle + "' is not registered with the daemon yet");
  }
  return it->second.daemon_id;
}

bool RemoteGovernor::WaitReady(const std::string& handle, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, timeout, [&] {
    auto it = sessions_.find(handle);
    return stopping_ || (connected() && it != sessions_.end() && !it->second.daemon_id.empty());
  }) && !stopping_;
}

void RemoteGovernor::MarkDown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    connected_.store(false, std::memory_order_release);
    for (auto& [handle, entry] : sessions_) {
      if (!entry.daemon_id.empty()) stale_.push_back(entry.daemon_id);
      entry.daemon_id.clear();
    }
    wake_ = true;
  }
  cv_.notify_all();
}

void RemoteGovernor::SetConnected() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    connected_.store(true, std::memory_order_release);
  }
  cv_.notify_all();  // WaitReady
}

Status RemoteGovernor::OnFailure(const std::string& handle, const grpc::Status& s) {
  const Failure f = ClassifyFailure(s);
  if (MarksDown(f)) {
    MarkDown();
  } else if (f == Failure::kLostSession) {
    // The daemon restarted between two calls: register again now, in the background.
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = sessions_.find(handle);
      if (it != sessions_.end()) it->second.daemon_id.clear();
      wake_ = true;
    }
    cv_.notify_all();
  }
  return FailureStatus(f, s);
}

Result<plan::Plan> RemoteGovernor::Plan(const std::string& session_id,
                                        const plan::SchedulePoint& point) {
  if (!connected()) return Unavailable("governor: daemon unavailable (reconnecting)");
  auto id = Resolve(session_id);
  if (!id.ok()) return id.status();
  pb::PlanRequest req;
  req.set_session_id(*id);
  PointToProto(point, &req);
  pb::PlanResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(ctx, options_.deadline);
  grpc::Status s = stub_->Plan(&ctx, req, &resp);
  if (!s.ok()) return OnFailure(session_id, s);
  return PlanFromProto(resp.plan());
}

Result<plan::Plan> RemoteGovernor::PlanAfterGate(const std::string& session_id,
                                                 const GateObservation& gate) {
  if (!connected()) return Unavailable("governor: daemon unavailable (reconnecting)");
  auto id = Resolve(session_id);
  if (!id.ok()) return id.status();
  pb::PlanRequest req;
  req.set_session_id(*id);
  pb::GateObservation* g = req.mutable_gate();
  g->set_micro_batch(gate.micro_batch);
  g->set_chunk(gate.chunk);
  g->set_gate_layer(gate.gate_layer);
  g->set_observed_load_factor(gate.observed_load_factor);
  pb::PlanResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(ctx, options_.deadline);
  grpc::Status s = stub_->Plan(&ctx, req, &resp);
  if (!s.ok()) return OnFailure(session_id, s);
  return PlanFromProto(resp.plan());
}

Status RemoteGovernor::Report(const std::string& session_id, const Consumption& c) {
  if (!connected()) return Unavailable("governor: daemon unavailable (reconnecting)");
  auto id = Resolve(session_id);
  if (!id.ok()) return id.status();
  pb::ReportRequest req;
  req.set_session_id(*id);
  req.set_micro_batch(c.micro_batch);
  req.set_chunk(c.chunk);
  req.set_actual_bytes(c.actual_bytes);
  if (c.has_stats) *req.mutable_stats() = c.stats;
  req.set_allocator_snapshot_json(c.allocator_snapshot_json);
  pb::ReportResponse resp;
  grpc::ClientContext ctx;
  // A snapshot can be megabytes: give it the registration deadline.
  SetDeadline(ctx, c.allocator_snapshot_json.empty()
                       ? options_.deadline
                       : std::chrono::microseconds(options_.register_deadline));
  grpc::Status s = stub_->Report(&ctx, req, &resp);
  if (!s.ok()) return OnFailure(session_id, s);
  return OkStatus();
}

Status RemoteGovernor::Unregister(const std::string& session_id) {
  std::string daemon_id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) {
      return NotFound("session_id: unknown session '" + session_id + "'");
    }
    daemon_id = it->second.daemon_id;
    sessions_.erase(it);
  }
  if (daemon_id.empty() || !connected()) return OkStatus();
  pb::UnregisterRequest req;
  req.set_session_id(daemon_id);
  pb::UnregisterResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(ctx, options_.deadline);
  // Any failure is ignored, as the Python client does at close: the daemon forgot the session
  // already (restart), or reaps it when this process exits.
  (void)stub_->Unregister(&ctx, req, &resp);
  return OkStatus();
}

bool RemoteGovernor::RegisterEntry(const std::string& handle) {
  pb::RegisterRequest req;
  bool was_registered = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sessions_.find(handle);
    if (it == sessions_.end()) return true;
    RegistrationToProto(it->second.registration, &req);
    was_registered = it->second.registered_once;
  }
  pb::RegisterResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(ctx, options_.register_deadline);
  grpc::Status s = stub_->Register(&ctx, req, &resp);
  if (!s.ok()) {
    // Refused, or over a daemon limit: a retry would meet the same, so this session stays
    // with the caller's embedded planner. Anything else is retried after the backoff.
    return !RetryRegistration(ClassifyFailure(s));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sessions_.find(handle);
    if (it == sessions_.end()) {
      stale_.push_back(resp.session_id());  // unregistered meanwhile: end it below
      return true;
    }
    it->second.daemon_id = resp.session_id();
    it->second.registered_once = true;
    if (was_registered) reregistrations_.fetch_add(1);
  }
  cv_.notify_all();  // WaitReady
  return true;
}

std::chrono::milliseconds RemoteGovernor::Jittered(std::chrono::milliseconds nominal) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const double f = 1.0 - std::clamp(options_.backoff_jitter, 0.0, 0.99) * u(rng);
  return std::chrono::milliseconds(static_cast<int64_t>(static_cast<double>(nominal.count()) * f));
}

void RemoteGovernor::EndStaleSessions() {
  std::vector<std::string> stale;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stale.swap(stale_);
  }
  for (const std::string& id : stale) {
    pb::UnregisterRequest req;
    req.set_session_id(id);
    pb::UnregisterResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(ctx, options_.deadline);
    (void)stub_->Unregister(&ctx, req, &resp);  // NOT_FOUND after a restart: nothing to end
  }
}

void RemoteGovernor::ReconnectLoop() {
  std::chrono::milliseconds backoff = options_.min_backoff;
  std::set<std::string> rejected;  // handles the daemon refused; not retried
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto needs_work = [&] {
        if (!connected() || !stale_.empty()) return true;
        for (const auto& [handle, entry] : sessions_) {
          if (entry.daemon_id.empty() && !rejected.count(handle)) return true;
        }
        return false;
      };
      if (!needs_work()) {
        cv_.wait(lock, [&] { return stopping_ || wake_; });
        wake_ = false;
        if (stopping_) return;
        continue;
      }
      if (stopping_) return;
    }
    if (!connected()) {
      // A daemon that failed is retried after the backoff delay, with one cheap call first.
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (cv_.wait_for(lock, Jittered(backoff), [&] { return stopping_; })) return;
      }
      pb::ListSessionsRequest req;
      pb::ListSessionsResponse resp;
      grpc::ClientContext ctx;
      ctx.set_wait_for_ready(true);
      SetDeadline(ctx, options_.probe_deadline);
      if (!stub_->ListSessions(&ctx, req, &resp).ok()) {
        backoff = std::min(backoff * 2, options_.max_backoff);
        continue;
      }
    }
    std::vector<std::string> pending;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [handle, entry] : sessions_) {
        if (entry.daemon_id.empty() && !rejected.count(handle)) pending.push_back(handle);
      }
    }
    bool ok = true;
    for (size_t i = 0; ok && i < pending.size(); ++i) {
      if (!RegisterEntry(pending[i])) {
        ok = false;
      } else if (DaemonSessionId(pending[i]).empty()) {
        rejected.insert(pending[i]);
      }
    }
    if (!ok) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        connected_.store(false, std::memory_order_release);
      }
      backoff = std::min(backoff * 2, options_.max_backoff);
      continue;
    }
    EndStaleSessions();  // after the new registrations: the model is never without a session
    backoff = options_.min_backoff;
    SetConnected();
  }
}

Status RemoteGovernor::Health(std::chrono::milliseconds deadline) {
  grpc::GenericStub generic(channel_);
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  SetDeadline(ctx, deadline);
  grpc::Slice empty("");
  grpc::ByteBuffer request(&empty, 1);  // HealthCheckRequest{service: ""}
  auto call = generic.PrepareUnaryCall(&ctx, "/grpc.health.v1.Health/Check", request, &cq);
  call->StartCall();
  grpc::ByteBuffer response;
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  cq.Next(&tag, &ok);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  if (!status.ok()) return FromGrpcStatus(status);
  grpc::Slice slice;
  if (!response.DumpToSingleSlice(&slice).ok()) return Status(StatusCode::kInternal, "health");
  // HealthCheckResponse{status: SERVING (1)} encodes as field 1 varint 1.
  const std::string bytes(reinterpret_cast<const char*>(slice.begin()), slice.size());
  if (bytes != std::string("\x08\x01", 2)) return Unavailable("governor: not serving");
  return OkStatus();
}

Result<pb::ListSessionsResponse> RemoteGovernor::ListSessions(std::chrono::milliseconds deadline) {
  pb::ListSessionsResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(ctx, deadline);
  grpc::Status s = stub_->ListSessions(&ctx, pb::ListSessionsRequest(), &resp);
  if (!s.ok()) return FromGrpcStatus(s);
  return resp;
}

Result<pb::SnapshotResponse> RemoteGovernor::Snapshot(const std::string& session_id,
                                                      std::chrono::milliseconds deadline) {
  pb::SnapshotRequest req;
  req.set_session_id(session_id);
  pb::SnapshotResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(ctx, deadline);
  grpc::Status s = stub_->Snapshot(&ctx, req, &resp);
  if (!s.ok()) return FromGrpcStatus(s);
  return resp;
}

Status RemoteGovernor::Watch(const pb::WatchRequest& request,
                             const std::function<bool(const pb::WatchResponse&)>& on_sample) {
  grpc::ClientContext ctx;
  auto reader = stub_->Watch(&ctx, request);
  pb::WatchResponse sample;
  bool cancelled = false;
  while (reader->Read(&sample)) {
    if (!on_sample(sample)) {
      cancelled = true;
      ctx.TryCancel();
      break;
    }
  }
  grpc::Status s = reader->Finish();
  if (cancelled || s.ok()) return OkStatus();
  return FromGrpcStatus(s);
}

}  // namespace bgl::gov
