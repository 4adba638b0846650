#include "governor/client/fallback_governor.h"

#include <cstdio>

namespace bgl::gov {
namespace {

// Errors that mean "the request is wrong", which the embedded planner would repeat.
bool CallerError(const Status& s) { return s.code() == StatusCode::kInvalidArgument; }

}  // namespace

FallbackGovernor::FallbackGovernor(RemoteOptions options) : remote_(std::move(options)) {}

void FallbackGovernor::NoteFallback(const Status& why) {
  if (!logged_.exchange(true)) {
    std::fprintf(stderr,
                 "bagualu: governor daemon at %s is unavailable or late (%s); planning "
                 "in-process until it answers again\n",
                 remote_.options().address.c_str(), why.message().c_str());
  }
}

Result<SessionInfo> FallbackGovernor::Register(const Registration& registration) {
  auto embedded = embedded_.Register(registration);
  if (!embedded.ok()) return embedded.status();
  Pair pair;
  pair.embedded = embedded->session_id;
  if (remote_.connected()) {
    auto remote = remote_.Register(registration);
    if (remote.ok()) {
      pair.remote = remote->session_id;
    } else {
      NoteFallback(remote.status());
      // Absent or late: keep trying in the background. Refused (limits): stay embedded.
      if (remote.status().code() == StatusCode::kUnavailable) {
        pair.remote = remote_.RegisterWhenAvailable(registration);
      }
    }
  } else {
    NoteFallback(Status(StatusCode::kUnavailable, "not connected"));
    pair.remote = remote_.RegisterWhenAvailable(registration);
  }
  std::lock_guard<std::mutex> lock(mu_);
  sessions_[pair.embedded] = pair;
  return embedded;
}

Result<FallbackGovernor::Pair> FallbackGovernor::Find(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return NotFound("session_id: unknown session '" + id + "'");
  return it->second;
}

Result<plan::Plan> FallbackGovernor::Plan(const std::string& session_id,
                                          const plan::SchedulePoint& point) {
  auto pair = Find(session_id);
  if (!pair.ok()) return pair.status();
  if (!pair->remote.empty()) {
    auto plan = remote_.Plan(pair->remote, point);
    if (plan.ok() || CallerError(plan.status())) {
      if (plan.ok()) remote_plans_.fetch_add(1, std::memory_order_relaxed);
      return plan;
    }
    NoteFallback(plan.status());
  }
  fallback_plans_.fetch_add(1, std::memory_order_relaxed);
  return embedded_.Plan(pair->embedded, point);
}

Result<plan::Plan> FallbackGovernor::PlanAfterGate(const std::string& session_id,
                                                   const GateObservation& gate) {
  auto pair = Find(session_id);
  if (!pair.ok()) return pair.status();
  if (!pair->remote.empty()) {
    auto plan = remote_.PlanAfterGate(pair->remote, gate);
    if (plan.ok() || CallerError(plan.status())) {
      if (plan.ok()) remote_plans_.fetch_add(1, std::memory_order_relaxed);
      return plan;
    }
    NoteFallback(plan.status());
  }
  fallback_plans_.fetch_add(1, std::memory_order_relaxed);
  return embedded_.PlanAfterGate(pair->embedded, gate);
}

Status FallbackGovernor::Report(const std::string& session_id, const Consumption& consumption) {
  auto pair = Find(session_id);
  if (!pair.ok()) return pair.status();
  Status remote = OkStatus();
  if (!pair->remote.empty()) remote = remote_.Report(pair->remote, consumption);
  // The embedded planner only knows the forwards it planned itself: NOT_FOUND is expected.
  Status embedded = embedded_.Report(pair->embedded, consumption);
  if (CallerError(remote)) return remote;
  if (CallerError(embedded)) return embedded;
  return OkStatus();
}

Status FallbackGovernor::Unregister(const std::string& session_id) {
  auto pair = Find(session_id);
  if (!pair.ok()) return pair.status();
  {
    std::lock_guard<std::mutex> lock(mu_);
    sessions_.erase(session_id);
  }
  if (!pair->remote.empty()) (void)remote_.Unregister(pair->remote);
  return embedded_.Unregister(pair->embedded);
}

}  // namespace bgl::gov
