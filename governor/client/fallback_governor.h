// FallbackGovernor: plans through the daemon (RemoteGovernor) and, whenever the daemon is
// absent, down or later than the deadline, through an in-process EmbeddedGovernor instead, so
// training never waits on the daemon longer than the deadline. Says so once on stderr.
// Reports go to both so the embedded planner stays close to the daemon's state.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "governor/client/embedded_governor.h"
#include "governor/client/remote_governor.h"

namespace bgl::gov {

class FallbackGovernor : public Governor {
 public:
  explicit FallbackGovernor(RemoteOptions options = {});
  Result<SessionInfo> Register(const Registration& registration) override;
  Result<plan::Plan> Plan(const std::string& session_id,
                          const plan::SchedulePoint& point) override;
  Result<plan::Plan> PlanAfterGate(const std::string& session_id,
                                   const GateObservation& gate) override;
  Status Report(const std::string& session_id, const Consumption& consumption) override;
  Status Unregister(const std::string& session_id) override;

  RemoteGovernor& remote() { return remote_; }
  // Plans answered in-process because the daemon was absent or late.
  uint64_t fallback_plans() const { return fallback_plans_.load(); }
  uint64_t remote_plans() const { return remote_plans_.load(); }

 private:
  struct Pair {
    std::string remote;    // RemoteGovernor handle
    std::string embedded;  // EmbeddedGovernor handle
  };
  Result<Pair> Find(const std::string& id) const;
  void NoteFallback(const Status& why);

  RemoteGovernor remote_;
  EmbeddedGovernor embedded_;
  mutable std::mutex mu_;
  std::map<std::string, Pair> sessions_;  // our handle (= the embedded one) -> both handles
  std::atomic<bool> logged_{false};
  std::atomic<uint64_t> fallback_plans_{0};
  std::atomic<uint64_t> remote_plans_{0};
};

}  // namespace bgl::gov
