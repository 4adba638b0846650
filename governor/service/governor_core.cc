#include "governor/service/governor_core.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>

#include "base/units.h"
#include "governor/common/convert.h"
#include "governor/planner/assignment.h"

namespace bgl::gov {
namespace {

namespace pb = bagualu::v1;
using grpc::StatusCode;

grpc::Status Invalid(std::string msg) { return {StatusCode::INVALID_ARGUMENT, std::move(msg)}; }
grpc::Status Exhausted(std::string msg) { return {StatusCode::RESOURCE_EXHAUSTED, std::move(msg)}; }

// Counts a plan in bagualu_plans_in_progress while the planner works on it (after the
// session's planner lock is taken).
class PlanInProgress {
 public:
  explicit PlanInProgress(Metrics* metrics) : metrics_(metrics) {
    if (metrics_ != nullptr) metrics_->OnPlanStarted();
  }
  ~PlanInProgress() {
    if (metrics_ != nullptr) metrics_->OnPlanEnded();
  }
  PlanInProgress(const PlanInProgress&) = delete;
  PlanInProgress& operator=(const PlanInProgress&) = delete;

 private:
  Metrics* metrics_;
};

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// 128 random bits in hex: session ids are not guessable (authorisation does not rely on it).
std::string NewSessionId() {
  static std::mutex mu;
  static std::mt19937_64 rng{std::random_device{}()};
  std::lock_guard<std::mutex> lock(mu);
  char buf[40];
  std::snprintf(buf, sizeof(buf), "s-%016llx%016llx", static_cast<unsigned long long>(rng()),
                static_cast<unsigned long long>(rng()));
  return buf;
}

// Prefixes a planner error about a gate field with "gate." so it names the request field.
grpc::Status GateError(const Status& s) {
  grpc::Status g = ToGrpcStatus(s);
  return {g.error_code(), "gate." + g.error_message()};
}

bool IsRejection(const grpc::Status& s) {
  return s.error_code() == StatusCode::INVALID_ARGUMENT ||
         s.error_code() == StatusCode::RESOURCE_EXHAUSTED;
}

grpc::Status CheckNonNegative(int64_t v, const char* field) {
  if (v < 0)
    return Invalid(std::string(field) + ": must be non-negative, got " + std::to_string(v));
  if (v > (int64_t{1} << 50)) {
    return Invalid(std::string(field) + ": out of range (> 2^50), got " + std::to_string(v));
  }
  return grpc::Status::OK;
}

// A report's InEffect: byte counts as any other, strategy names the planner's, counts bounded
// by what the session's micro-batches in flight can have.
grpc::Status CheckInEffect(const pb::InEffect& e, size_t operators) {
  if (e.micro_batches() < 0 || e.micro_batches() > (1 << 20)) {
    return Invalid("in_effect.micro_batches: must be in [0, 2^20], got " +
                   std::to_string(e.micro_batches()));
  }
  for (auto [v, field] : {std::pair{e.planned_bytes(), "in_effect.planned_bytes"},
                          {e.actual_bytes(), "in_effect.actual_bytes"},
                          {e.planned_host_bytes(), "in_effect.planned_host_bytes"},
                          {e.actual_host_bytes(), "in_effect.actual_host_bytes"}}) {
    if (auto s = CheckNonNegative(v, field); !s.ok()) return s;
  }
  const int64_t most = static_cast<int64_t>(operators) * e.micro_batches();
  for (const auto& [name, n] : e.strategy_counts()) {
    bool known = false;
    for (plan::Strategy st : plan::kAllStrategies) known |= name == plan::StrategyName(st);
    if (!known) {
      return Invalid("in_effect.strategy_counts: unknown strategy '" + name.substr(0, 64) +
                     "' (keep, recompute, offload, fp8)");
    }
    if (n < 0 || n > most) {
      return Invalid("in_effect.strategy_counts[" + name + "]: must be in [0, " +
                     std::to_string(most) + "] (operators x micro_batches), got " +
                     std::to_string(n));
    }
  }
  return grpc::Status::OK;
}

// What sessions must have in common to share warm-up plans: the user (a job id is the client's
// word: another uid naming the same job must not see which plans this one's sessions met, issue
// 45), the job and every registration field that shapes a mitigation-cache key's plan (the
// stage's model, its calibration, the options, the warm-up's bound) and the node's calibration.
// Not the GPU, pid, pipeline rank, capacity or host request: a key's plan does not depend on
// them (its budget and host limit are in the key).
std::string SharingKey(uint32_t uid, const pb::RegisterRequest& req,
                       const nlohmann::json* node_calibration) {
  std::string key = std::to_string(uid) + '\0' + req.job_id();
  key += '\0';
  key += std::to_string(req.model_json().size()) + ':' + req.model_json();
  const std::string cal = req.calibration().SerializeAsString();
  key += std::to_string(cal.size()) + ':' + cal;
  const std::string node = node_calibration != nullptr ? node_calibration->dump() : "";
  key += std::to_string(node.size()) + ':' + node;
  key += ' ' + std::to_string(req.budget_step_bytes()) + ' ' +
         std::to_string(req.disable_dual_batch()) + ' ' + std::to_string(req.disallow_offload()) +
         ' ' + std::to_string(req.disallow_fp8()) + ' ' +
         std::to_string(req.warm_up().spike_bound());
  return key;
}

}  // namespace

GovernorCore::GovernorCore(Metrics* metrics, RequestLimits limits, std::optional<NodeArbiter> node)
    : metrics_(metrics), limits_(limits), node_(std::move(node)) {}

void GovernorCore::ReleaseGrant(uint64_t node_id) {
  std::lock_guard<std::mutex> lock(node_mu_);
  if (node_) node_->Unregister(node_id);
}

std::vector<std::pair<std::string, int64_t>> GovernorCore::HostGrants() const {
  std::vector<std::pair<std::string, uint64_t>> ids;
  {
    std::shared_lock<std::shared_mutex> lock(mu_);
    for (const auto& [id, s] : sessions_) ids.emplace_back(id, s->node_id);
  }
  std::vector<std::pair<std::string, int64_t>> out;
  std::lock_guard<std::mutex> lock(node_mu_);
  if (!node_) return out;
  for (const auto& [id, node_id] : ids) out.emplace_back(id, node_->Grant(node_id));
  std::sort(out.begin(), out.end());
  return out;
}

void GovernorCore::FillNodeFields(const Session& s, pb::Session* out) const {
  std::lock_guard<std::mutex> lock(node_mu_);
  if (node_) {
    out->set_host_grant_bytes(node_->Grant(s.node_id));
    out->set_link(node_->SessionLink(s.node_id, s.info.gpu_index()));
  } else {
    out->set_link(NodeArbiter::OwnLink(s.info.gpu_index()));
  }
}

void GovernorCore::CancelPlans() { stopping_.store(true); }

void GovernorCore::SetLimits(const RequestLimits& limits) {
  std::unique_lock<std::shared_mutex> lock(mu_);
  limits_ = limits;
}

void GovernorCore::SetCalibration(std::optional<nlohmann::json> calibration) {
  std::unique_lock<std::shared_mutex> lock(mu_);
  calibration_ = std::move(calibration);
}

RequestLimits GovernorCore::limits() const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  return limits_;
}

size_t GovernorCore::session_count() const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  return sessions_.size();
}

grpc::Status GovernorCore::Reject(const char* method, grpc::Status status) {
  if (metrics_ != nullptr && IsRejection(status)) metrics_->OnInvalidRequest(method);
  return status;
}

bool GovernorCore::Visible(const Caller& caller, const Session& s) const {
  return caller.admin || caller.uid == s.info.uid();
}

grpc::Status GovernorCore::Find(const Caller& caller, const std::string& id, bool read_only,
                                std::shared_ptr<Session>* out) const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  if (id.size() > limits_.max_string_bytes) {
    return Exhausted("session_id: " + FormatBytes(static_cast<double>(id.size()), true) +
                     " exceeds the limit of " +
                     FormatBytes(static_cast<double>(limits_.max_string_bytes), true));
  }
  if (id.empty()) return Invalid("session_id: required");
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return {StatusCode::NOT_FOUND, "session_id: unknown session"};
  const Session& s = *it->second;
  // Another uid's session: refused naming the id the caller sent (128 random bits it already
  // holds) and nothing else of the session: not its pid, uid, job or GPU.
  if (!Visible(caller, s)) {
    return {StatusCode::PERMISSION_DENIED,
            "session_id: '" + id + "' belongs to another user; only its owner may use it"};
  }
  if (!read_only) {
    const bool owner = caller.uid == s.info.uid() &&
                       (caller.pid < 0 || s.info.pid() <= 0 || caller.pid == s.info.pid());
    if (!owner) {
      return {StatusCode::PERMISSION_DENIED,
              "session_id: '" + id + "' belongs to " +
                  (caller.uid == s.info.uid() ? "" : "another user's ") + "process " +
                  std::to_string(s.info.pid()) + "; only that process may change it"};
    }
  }
  *out = it->second;
  return grpc::Status::OK;
}

grpc::Status GovernorCore::Register(const Caller& caller, const pb::RegisterRequest& req,
                                    pb::RegisterResponse* resp) {
  const RequestLimits limits = this->limits();
  // Cheap checks (sizes, quotas) first, so oversized or abusive requests cost nothing.
  if (Status s = ValidateRegisterRequest(req, limits); !s.ok()) {
    return Reject("Register", ToGrpcStatus(s));
  }
  // The session this one replaces (the caller's own): it leaves as this one arrives.
  std::shared_ptr<Session> replaced;
  if (!req.replaces_session_id().empty()) {
    grpc::Status found = Find(caller, req.replaces_session_id(), false, &replaced);
    if (found.error_code() == grpc::StatusCode::NOT_FOUND) {
      replaced.reset();  // ended or reaped already: a plain registration
    } else if (!found.ok()) {
      return Reject("Register",
                    grpc::Status(found.error_code(), "replaces_" + found.error_message()));
    }
  }
  {
    std::shared_lock<std::shared_mutex> lock(mu_);
    const int leaving = replaced ? 1 : 0;
    if (static_cast<int>(sessions_.size()) - leaving >= limits.max_sessions) {
      return Reject("Register", Exhausted("sessions: the daemon's limit of " +
                                          std::to_string(limits.max_sessions) + " is reached"));
    }
    int mine = -leaving;
    for (const auto& [id, s] : sessions_) mine += s->info.uid() == caller.uid ? 1 : 0;
    if (mine >= limits.max_sessions_per_uid) {
      return Reject("Register",
                    Exhausted("sessions: uid " + std::to_string(caller.uid) + " already has " +
                              std::to_string(mine) + " sessions (limit " +
                              std::to_string(limits.max_sessions_per_uid) + ")"));
    }
  }
  std::optional<nlohmann::json> calibration;
  {
    std::shared_lock<std::shared_mutex> lock(mu_);
    calibration = calibration_;
  }
  auto planner = CreatePlannerFromRequest(req, limits, {}, calibration ? &*calibration : nullptr);
  if (!planner.ok()) return Reject("Register", ToGrpcStatus(planner.status()));
  if (req.has_warm_up() && !req.job_id().empty()) {
    // The job's other sessions of the same stage share this one's warm-up, and it theirs.
    const std::string key = SharingKey(caller.uid, req, calibration ? &*calibration : nullptr);
    std::shared_ptr<plan::SharedPlans> shared;
    {
      std::unique_lock<std::shared_mutex> lock(mu_);
      for (auto it = shared_plans_.begin(); it != shared_plans_.end();) {
        it = it->second.expired() ? shared_plans_.erase(it) : std::next(it);
      }
      std::weak_ptr<plan::SharedPlans>& slot = shared_plans_[key];
      shared = slot.lock();
      if (!shared) {
        shared = std::make_shared<plan::SharedPlans>((*planner)->options().cache_entries);
        slot = shared;
      }
    }
    (*planner)->ShareWarmPlans(std::move(shared));
  }

  auto session = std::make_shared<Session>();
  const std::string id = NewSessionId();
  pb::Session& info = session->info;
  info.set_session_id(id);
  info.set_pid(caller.pid >= 0 ? caller.pid : req.pid());
  info.set_uid(caller.uid);
  info.set_user(caller.user);
  info.set_job_id(req.job_id());
  info.set_gpu_uuid(req.gpu_uuid());
  info.set_gpu_index(req.gpu_index());
  info.set_pipeline_rank(req.pipeline_rank());
  info.set_model((*planner)->config().name);
  info.set_capacity_bytes(req.capacity_bytes());
  info.set_created_unix_ms(NowUnixMs());
  session->capacity_bytes =
      req.capacity_bytes() > 0 ? req.capacity_bytes() : (*planner)->hardware().memory_bytes;
  session->host_request_bytes = req.host_request_bytes();
  session->planner = std::move(planner).value();
  int64_t grant = 0;
  {
    // The node's grant last: every check that can refuse the session has passed.
    std::lock_guard<std::mutex> lock(node_mu_);
    session->node_id = next_node_id_++;
    if (node_) {
      // A replaced session leaves the arbitration under the same lock: no other session's
      // grant is read between the two (they would have grown for a moment). The process's
      // pinned pool is the same one: its use carries over.
      const int64_t used = replaced ? node_->Used(replaced->node_id) : 0;
      if (replaced) node_->Unregister(replaced->node_id);
      auto granted = node_->Register(session->node_id, req.gpu_index(), req.host_request_bytes());
      if (!granted.ok()) {
        if (replaced) {  // the old session keeps its place
          (void)node_->Register(replaced->node_id, replaced->info.gpu_index(),
                                replaced->host_request_bytes);
          node_->SetUsed(replaced->node_id, used);
        }
        return Reject("Register", ToGrpcStatus(granted.status()));
      }
      if (used > 0) {
        node_->SetUsed(session->node_id, used);
        granted = node_->Grant(session->node_id);
      }
      grant = *granted;
    }
  }
  FillRegisterResponse(*session->planner, resp);
  resp->set_session_id(id);
  resp->set_host_grant_bytes(grant);
  // Without a caller pid (TCP) the pid is informational only: such sessions are never reaped.
  if (caller.pid < 0) info.set_pid(0);
  size_t count = 0;
  {
    std::unique_lock<std::shared_mutex> lock(mu_);
    sessions_.emplace(id, std::move(session));
    if (replaced) sessions_.erase(req.replaces_session_id());
    count = sessions_.size();
  }
  if (metrics_ != nullptr) {
    metrics_->OnRegister();
    metrics_->SetSessions(count);
  }
  return grpc::Status::OK;
}

grpc::Status GovernorCore::Plan(const Caller& caller, const pb::PlanRequest& req,
                                pb::PlanResponse* resp) {
  const auto start = std::chrono::steady_clock::now();
  std::shared_ptr<Session> session;
  if (grpc::Status s = Find(caller, req.session_id(), false, &session); !s.ok()) {
    return Reject("Plan", s);
  }
  Result<plan::Plan> result = Status();
  std::optional<int64_t> bytes_in_use;
  // The node's limits for this plan: the session's grant and its link's bandwidth share.
  int64_t grant = -1;
  double share = 1.0;
  {
    std::lock_guard<std::mutex> lock(node_mu_);
    if (node_) {
      grant = node_->Grant(session->node_id);
      share =
          node_->PlanShare(session->node_id, session->planner->hardware().offload.peak_bytes_per_s);
    }
  }
  plan::PlannerCacheStats stats;
  const int plan_timeout_ms = limits().plan_timeout_ms;
  if (req.has_gate()) {
    const pb::GateObservation& g = req.gate();
    if (g.micro_batch() < 0) return Reject("Plan", Invalid("gate.micro_batch: must be >= 0"));
    if (g.chunk() < 0) return Reject("Plan", Invalid("gate.chunk: must be >= 0"));
    if (g.gate_layer() < 0) return Reject("Plan", Invalid("gate.gate_layer: must be >= 0"));
    const double r = g.observed_load_factor();
    if (!std::isfinite(r) || r <= 0 || r > 64) {
      return Reject("Plan", Invalid("gate.observed_load_factor: must be in (0, 64], got " +
                                    std::to_string(r)));
    }
    std::lock_guard<std::mutex> lock(session->planner_mu);
    const PlanInProgress in_progress(metrics_);
    const plan::Deadline deadline(plan_timeout_ms, &stopping_);
    result =
        session->planner->PlanAfterGate(g.micro_batch(), g.chunk(), g.gate_layer(), r, deadline);
    if (!result.ok()) {
      // The deadline's refusals name plan_timeout_ms, not a gate field.
      const bgl::StatusCode code = result.status().code();
      const bool deadline_ended =
          code == bgl::StatusCode::kResourceExhausted || code == bgl::StatusCode::kUnavailable;
      return Reject("Plan",
                    deadline_ended ? ToGrpcStatus(result.status()) : GateError(result.status()));
    }
    stats = session->planner->cache_stats();
  } else {
    auto point = PointFromProto(req);
    if (!point.ok()) return Reject("Plan", ToGrpcStatus(point.status()));
    if (point->bytes_in_use >= 0) bytes_in_use = point->bytes_in_use;
    point->host_limit_bytes = grant;
    point->bandwidth_share = share;
    // The planner's lock only: Watch and the housekeeping thread read the figures under `mu`.
    std::lock_guard<std::mutex> lock(session->planner_mu);
    const PlanInProgress in_progress(metrics_);
    result = session->planner->PlanPoint(*point, plan::Deadline(plan_timeout_ms, &stopping_));
    if (!result.ok()) return Reject("Plan", ToGrpcStatus(result.status()));
    stats = session->planner->cache_stats();
  }
  // The planner's options are immutable after registration: read without its lock.
  const bool warm_up = session->planner->options().warm_up;
  if (warm_up) WarmUpStatsToProto(stats, resp->mutable_warm_up());
  const plan::Plan& p = *result;
  bool offloading = p.host_bytes > 0;
  for (const plan::IssueItem& item : p.issue_order) {
    offloading |= plan::IsHostCopy(item.resource);
  }
  {
    std::lock_guard<std::mutex> lock(node_mu_);
    if (node_) node_->SetOffloading(session->node_id, offloading);
  }
  resp->set_host_grant_bytes(std::max<int64_t>(grant, 0));
  resp->set_bandwidth_share(share);
  {
    std::lock_guard<std::mutex> lock(session->mu);
    session->plans++;
    session->plan_cache = stats.mitigation;
    if (warm_up) session->warm_up = resp->warm_up();
    session->budget_bytes = p.budget_bytes;
    session->load_factor = p.load_factor;
    if (bytes_in_use) session->in_use_bytes = *bytes_in_use;
    if (!session->host_used_reported) session->host_used_bytes = p.host_bytes;
    session->bandwidth_share = share;
    session->offloading = offloading;
    session->peak_bytes = std::max(session->peak_bytes, session->in_use_bytes);
    session->strategy_counts.clear();
    for (plan::Strategy s : p.strategies) session->strategy_counts[plan::StrategyName(s)]++;
    PlanToProto(p, &session->planner->graph(), resp->mutable_plan());
  }
  if (metrics_ != nullptr) {
    metrics_->OnPlan(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
        p.cache_hit);
  }
  return grpc::Status::OK;
}

grpc::Status GovernorCore::Report(const Caller& caller, const pb::ReportRequest& req,
                                  pb::ReportResponse*) {
  std::shared_ptr<Session> session;
  if (grpc::Status s = Find(caller, req.session_id(), false, &session); !s.ok()) {
    return Reject("Report", s);
  }
  const RequestLimits limits = this->limits();
  if (req.allocator_snapshot_json().size() > limits.max_snapshot_json_bytes) {
    return Reject(
        "Report",
        Exhausted("allocator_snapshot_json: " +
                  FormatBytes(static_cast<double>(req.allocator_snapshot_json().size()), true) +
                  " exceeds the limit of " +
                  FormatBytes(static_cast<double>(limits.max_snapshot_json_bytes), true)));
  }
  if (req.micro_batch() < 0) return Reject("Report", Invalid("micro_batch: must be >= 0"));
  if (req.chunk() < 0) return Reject("Report", Invalid("chunk: must be >= 0"));
  if (auto s = CheckNonNegative(req.actual_bytes(), "actual_bytes"); !s.ok()) {
    return Reject("Report", s);
  }
  const pb::AllocatorStats& st = req.stats();
  for (auto [v, field] : {std::pair{st.allocated_bytes(), "stats.allocated_bytes"},
                          {st.reserved_bytes(), "stats.reserved_bytes"},
                          {st.peak_allocated_bytes(), "stats.peak_allocated_bytes"},
                          {st.oom_count(), "stats.oom_count"},
                          {st.ooms_avoided(), "stats.ooms_avoided"},
                          {st.host_used_bytes(), "stats.host_used_bytes"}}) {
    if (auto s = CheckNonNegative(v, field); !s.ok()) return Reject("Report", s);
  }
  if (!std::isfinite(st.fragmentation()) || st.fragmentation() < 0 || st.fragmentation() > 1) {
    return Reject("Report", Invalid("stats.fragmentation: must be in [0, 1], got " +
                                    std::to_string(st.fragmentation())));
  }
  if (!req.allocator_snapshot_json().empty() &&
      !nlohmann::json::accept(req.allocator_snapshot_json())) {
    return Reject("Report", Invalid("allocator_snapshot_json: not valid JSON"));
  }
  if (req.has_in_effect()) {
    const size_t operators = session->planner->graph().ops.size();
    if (auto s = CheckInEffect(req.in_effect(), operators); !s.ok()) return Reject("Report", s);
  }
  int64_t ooms_delta = 0;
  int64_t host_used = -1;  // pinned bytes the process holds now, when it reports them
  double planner_used = 0;
  {
    std::lock_guard<std::mutex> lock(session->planner_mu);
    Status s = session->planner->Report(req.micro_batch(), req.chunk(), req.actual_bytes());
    if (!s.ok()) return Reject("Report", ToGrpcStatus(s));
    planner_used = session->planner->used_bytes();
  }
  {
    std::lock_guard<std::mutex> lock(session->mu);
    if (req.has_stats()) {
      ooms_delta = st.ooms_avoided() - session->ooms_avoided;
      session->in_use_bytes = st.allocated_bytes();
      session->reserved_bytes = st.reserved_bytes();
      session->peak_bytes =
          std::max({session->peak_bytes, st.peak_allocated_bytes(), st.allocated_bytes()});
      session->ooms_avoided = st.ooms_avoided();
      session->oom_count = st.oom_count();
      if (st.host_used_bytes() > 0 || session->host_used_reported) {
        session->host_used_bytes = st.host_used_bytes();
        session->host_used_reported = true;
        host_used = st.host_used_bytes();
      }
    } else {
      session->in_use_bytes = static_cast<int64_t>(planner_used);
      session->peak_bytes = std::max(session->peak_bytes, session->in_use_bytes);
    }
    if (req.has_in_effect()) {
      session->in_effect = req.in_effect();
    }
    if (!req.allocator_snapshot_json().empty()) {
      session->snapshot_json = req.allocator_snapshot_json();
      session->snapshot_unix_ms = NowUnixMs();
    }
  }
  if (host_used >= 0) {
    // Use above a shrunk grant still counts against the node: the others' grants follow it.
    std::lock_guard<std::mutex> lock(node_mu_);
    if (node_) node_->SetUsed(session->node_id, host_used);
  }
  if (metrics_ != nullptr && ooms_delta > 0) metrics_->OnOomsAvoided(ooms_delta);
  return grpc::Status::OK;
}

grpc::Status GovernorCore::Unregister(const Caller& caller, const pb::UnregisterRequest& req,
                                      pb::UnregisterResponse*) {
  std::shared_ptr<Session> session;
  // Only the owning process ends a session; a dead one's session is reaped.
  if (grpc::Status s = Find(caller, req.session_id(), false, &session); !s.ok()) {
    return Reject("Unregister", s);
  }
  size_t count = 0;
  {
    std::unique_lock<std::shared_mutex> lock(mu_);
    sessions_.erase(req.session_id());
    count = sessions_.size();
  }
  ReleaseGrant(session->node_id);  // the others rebalance
  if (metrics_ != nullptr) metrics_->SetSessions(count);
  return grpc::Status::OK;
}

grpc::Status GovernorCore::ListSessions(const Caller& caller, const pb::ListSessionsRequest&,
                                        pb::ListSessionsResponse* resp) {
  std::map<std::string, std::shared_ptr<Session>> sorted;
  {
    std::shared_lock<std::shared_mutex> lock(mu_);
    for (const auto& [id, s] : sessions_) {
      if (Visible(caller, *s)) sorted.emplace(id, s);
    }
  }
  for (const auto& [id, s] : sorted) {
    pb::Session* out = resp->add_sessions();
    *out = s->info;
    FillNodeFields(*s, out);
    std::lock_guard<std::mutex> lock(s->mu);
    out->set_host_used_bytes(s->host_used_bytes);
    if (s->warm_up) *out->mutable_warm_up() = *s->warm_up;
  }
  return grpc::Status::OK;
}

grpc::Status GovernorCore::Snapshot(const Caller& caller, const pb::SnapshotRequest& req,
                                    pb::SnapshotResponse* resp) {
  std::vector<std::shared_ptr<Session>> chosen;
  if (!req.session_id().empty()) {
    std::shared_ptr<Session> session;
    if (grpc::Status s = Find(caller, req.session_id(), true, &session); !s.ok()) {
      return Reject("Snapshot", s);
    }
    chosen.push_back(std::move(session));
  } else {
    std::shared_lock<std::shared_mutex> lock(mu_);
    for (const auto& [id, s] : sessions_) {
      if (Visible(caller, *s)) chosen.push_back(s);
    }
  }
  for (const auto& s : chosen) {
    std::lock_guard<std::mutex> lock(s->mu);
    if (s->snapshot_json.empty() && req.session_id().empty()) continue;
    pb::SessionSnapshot* out = resp->add_snapshots();
    out->set_session_id(s->info.session_id());
    out->set_allocator_snapshot_json(s->snapshot_json);
    out->set_reported_unix_ms(s->snapshot_unix_ms);
  }
  return grpc::Status::OK;
}

grpc::Status GovernorCore::ValidateWatch(const pb::WatchRequest& req) const {
  if (req.interval_ms() != 0 && (req.interval_ms() < 10 || req.interval_ms() > 3600000)) {
    return Invalid("interval_ms: must be 0 (1000) or in [10, 3600000], got " +
                   std::to_string(req.interval_ms()));
  }
  if (req.max_samples() < 0) {
    return Invalid("max_samples: must be >= 0, got " + std::to_string(req.max_samples()));
  }
  return grpc::Status::OK;
}

void GovernorCore::Sample(const Caller& caller, pb::WatchResponse* resp) {
  resp->set_unix_ms(NowUnixMs());
  std::vector<std::shared_ptr<Session>> visible;
  {
    std::shared_lock<std::shared_mutex> lock(mu_);
    for (const auto& [id, s] : sessions_) {
      if (Visible(caller, *s)) visible.push_back(s);
    }
  }
  std::sort(visible.begin(), visible.end(), [](const auto& a, const auto& b) {
    return a->info.gpu_index() != b->info.gpu_index() ? a->info.gpu_index() < b->info.gpu_index()
                                                      : a->info.pid() < b->info.pid();
  });
  std::vector<NodeLink> configured;  // the node's links, copied so no other lock is held
  {
    std::lock_guard<std::mutex> lock(node_mu_);
    if (node_) {
      resp->set_host_budget_bytes(node_->config().host_budget_bytes);
      configured = node_->config().links;
    }
  }
  std::map<int, pb::LinkState> links;
  std::map<std::string, pb::GpuState*> gpus;
  for (const auto& s : visible) {
    pb::GpuState*& gpu = gpus[s->info.gpu_uuid()];
    if (gpu == nullptr) {
      gpu = resp->add_gpus();
      gpu->set_gpu_uuid(s->info.gpu_uuid());
      gpu->set_gpu_index(s->info.gpu_index());
    }
    pb::ProcessRow* row = gpu->add_processes();
    *row->mutable_session() = s->info;
    FillNodeFields(*s, row->mutable_session());  // before s->mu: one lock at a time
    std::lock_guard<std::mutex> lock(s->mu);
    row->set_in_use_bytes(s->in_use_bytes);
    row->set_peak_bytes(s->peak_bytes);
    row->set_reserved_bytes(s->reserved_bytes);
    row->set_budget_bytes(s->budget_bytes);
    row->set_load_factor(s->load_factor);
    for (const auto& [name, n] : s->strategy_counts) {
      (*row->mutable_strategy_counts())[name] = n;
      (*gpu->mutable_strategy_counts())[name] += n;
    }
    row->set_ooms_avoided(s->ooms_avoided);
    row->set_oom_count(s->oom_count);
    row->set_plans(s->plans);
    const int64_t grant = row->session().host_grant_bytes();
    const int link = row->session().link();
    row->set_bandwidth_share(s->bandwidth_share);
    row->set_offloading(s->offloading);
    if (s->in_effect) *row->mutable_in_effect() = *s->in_effect;
    if (s->warm_up) *row->mutable_warm_up() = *s->warm_up;
    row->mutable_session()->set_host_used_bytes(s->host_used_bytes);
    pb::LinkState& l = links[link];
    if (l.sessions() == 0) {
      l.set_link(link);
      if (link >= 0 && link < static_cast<int>(configured.size())) {
        for (int gpu : configured[link].gpus) l.add_gpus(gpu);
      } else {
        l.add_gpus(NodeArbiter::GpuOfOwnLink(link));
      }
    }
    l.set_sessions(l.sessions() + 1);
    l.set_offloading_sessions(l.offloading_sessions() + (s->offloading ? 1 : 0));
    l.set_host_grant_bytes(l.host_grant_bytes() + grant);
    l.set_host_used_bytes(l.host_used_bytes() + s->host_used_bytes);
    const plan::CacheCounters& cache = s->plan_cache;
    gpu->set_capacity_bytes(std::max(gpu->capacity_bytes(), s->capacity_bytes));
    gpu->set_in_use_bytes(gpu->in_use_bytes() + s->in_use_bytes);
    gpu->set_reserved_bytes(gpu->reserved_bytes() + s->reserved_bytes);
    gpu->set_budget_bytes(gpu->budget_bytes() + s->budget_bytes);
    gpu->set_load_factor(std::max(gpu->load_factor(), s->load_factor));
    gpu->set_plan_cache_hits(gpu->plan_cache_hits() + cache.hits);
    gpu->set_plan_cache_misses(gpu->plan_cache_misses() + cache.misses);
    gpu->set_ooms_avoided(gpu->ooms_avoided() + s->ooms_avoided);
  }
  for (auto& [link, state] : links) *resp->add_links() = std::move(state);
}

int GovernorCore::Reap(const std::function<bool(int32_t pid)>& alive) {
  std::vector<std::pair<std::string, int32_t>> candidates;
  {
    std::shared_lock<std::shared_mutex> lock(mu_);
    for (const auto& [id, s] : sessions_) {
      if (s->info.pid() > 0) candidates.emplace_back(id, s->info.pid());
    }
  }
  std::vector<std::string> dead;
  for (const auto& [id, pid] : candidates) {
    if (!alive(pid)) dead.push_back(id);
  }
  if (dead.empty()) return 0;
  size_t count = 0;
  std::vector<uint64_t> released;
  {
    std::unique_lock<std::shared_mutex> lock(mu_);
    for (const auto& id : dead) {
      auto it = sessions_.find(id);
      if (it == sessions_.end()) continue;
      released.push_back(it->second->node_id);
      sessions_.erase(it);
    }
    count = sessions_.size();
  }
  for (uint64_t node_id : released) ReleaseGrant(node_id);  // the others rebalance
  if (metrics_ != nullptr) {
    metrics_->OnReaped(static_cast<int>(dead.size()));
    metrics_->SetSessions(count);
  }
  return static_cast<int>(dead.size());
}

void GovernorCore::PublishMetrics() {
  if (metrics_ == nullptr) return;
  Caller all;
  all.admin = true;
  pb::WatchResponse sample;
  Sample(all, &sample);
  for (const pb::GpuState& g : sample.gpus()) {
    metrics_->SetGpu(
        g.gpu_index(), g.gpu_uuid(),
        GpuFigures{g.capacity_bytes(), g.in_use_bytes(), g.reserved_bytes(), g.budget_bytes()});
  }
  std::vector<SessionHostFigures> hosts;
  for (const pb::GpuState& g : sample.gpus()) {
    for (const pb::ProcessRow& row : g.processes()) {
      hosts.push_back({row.session().session_id(), g.gpu_index(), row.session().job_id(),
                       row.session().link(), row.session().host_grant_bytes(),
                       row.session().host_used_bytes()});
    }
  }
  std::vector<std::pair<int, int>> links;
  for (const pb::LinkState& l : sample.links()) {
    links.emplace_back(l.link(), l.offloading_sessions());
  }
  metrics_->SetNode(hosts, links);
  WarmUpFigures warm;
  for (const pb::GpuState& g : sample.gpus()) {
    for (const pb::ProcessRow& row : g.processes()) {
      if (!row.has_warm_up()) continue;
      warm.keys += row.warm_up().keys();
      warm.hits += row.warm_up().hits();
      warm.shared_hits += row.warm_up().shared_hits();
      warm.cpu_s += row.warm_up().cpu_s();
    }
  }
  metrics_->SetWarmUp(warm);
  metrics_->SetSessions(session_count());
}

}  // namespace bgl::gov
