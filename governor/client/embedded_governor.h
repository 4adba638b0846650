// EmbeddedGovernor: the Governor interface over in-process StagePlanners (one per session),
// with the daemon's validation (the same registration checks, governor/common/). Thread safe.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "governor/client/governor.h"

namespace bgl::gov {

class EmbeddedGovernor : public Governor {
 public:
  EmbeddedGovernor() = default;
  Result<SessionInfo> Register(const Registration& registration) override;
  Result<plan::Plan> Plan(const std::string& session_id,
                          const plan::SchedulePoint& point) override;
  Result<plan::Plan> PlanAfterGate(const std::string& session_id,
                                   const GateObservation& gate) override;
  Status Report(const std::string& session_id, const Consumption& consumption) override;
  Status Unregister(const std::string& session_id) override;

 private:
  struct Session {
    std::mutex mu;
    std::unique_ptr<plan::StagePlanner> planner;
  };
  std::shared_ptr<Session> Find(const std::string& id) const;

  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<Session>> sessions_;
  uint64_t next_id_ = 0;
};

}  // namespace bgl::gov
