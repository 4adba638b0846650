#include "governor/client/embedded_governor.h"

#include "governor/common/registration.h"

namespace bgl::gov {

Result<SessionInfo> EmbeddedGovernor::Register(const Registration& registration) {
  bagualu::v1::RegisterRequest req;
  RegistrationToProto(registration, &req);
  auto planner = CreatePlannerFromRequest(req, RequestLimits{});
  if (!planner.ok()) return planner.status();
  bagualu::v1::RegisterResponse resp;
  FillRegisterResponse(**planner, &resp);
  auto session = std::make_shared<Session>();
  session->planner = std::move(planner).value();
  std::lock_guard<std::mutex> lock(mu_);
  resp.set_session_id("embedded-" + std::to_string(++next_id_));
  sessions_.emplace(resp.session_id(), std::move(session));
  return SessionInfoFromProto(resp);
}

std::shared_ptr<EmbeddedGovernor::Session> EmbeddedGovernor::Find(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sessions_.find(id);
  return it == sessions_.end() ? nullptr : it->second;
}

Result<plan::Plan> EmbeddedGovernor::Plan(const std::string& session_id,
                                          const plan::SchedulePoint& point) {
  auto session = Find(session_id);
  if (!session) return NotFound("session_id: unknown session '" + session_id + "'");
  std::lock_guard<std::mutex> lock(session->mu);
  // The daemon's default plan-time limit: a plan the daemon refused as too slow must not stall
  // the training process instead.
  return session->planner->PlanPoint(point,
                                     plan::Deadline(RequestLimits{}.plan_timeout_ms, nullptr));
}

Result<plan::Plan> EmbeddedGovernor::PlanAfterGate(const std::string& session_id,
                                                   const GateObservation& gate) {
  auto session = Find(session_id);
  if (!session) return NotFound("session_id: unknown session '" + session_id + "'");
  std::lock_guard<std::mutex> lock(session->mu);
  return session->planner->PlanAfterGate(gate.micro_batch, gate.chunk, gate.gate_layer,
                                         gate.observed_load_factor,
                                         plan::Deadline(RequestLimits{}.plan_timeout_ms, nullptr));
}

Status EmbeddedGovernor::Report(const std::string& session_id, const Consumption& c) {
  auto session = Find(session_id);
  if (!session) return NotFound("session_id: unknown session '" + session_id + "'");
  std::lock_guard<std::mutex> lock(session->mu);
  return session->planner->Report(c.micro_batch, c.chunk, c.actual_bytes);
}

Status EmbeddedGovernor::Unregister(const std::string& session_id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (sessions_.erase(session_id) == 0) {
    return NotFound("session_id: unknown session '" + session_id + "'");
  }
  return OkStatus();
}

}  // namespace bgl::gov
