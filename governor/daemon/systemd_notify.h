// Service-manager notifications (sd_notify): READY, STATUS, WATCHDOG, STOPPING. No-ops unless
// NOTIFY_SOCKET is set (or when built without libsystemd).
#pragma once

#include <chrono>
#include <string>

namespace bgl::gov {

void NotifySystemd(const std::string& state);
// The watchdog ping interval (half of WatchdogSec), or zero when no watchdog is expected.
std::chrono::microseconds WatchdogPingInterval();

}  // namespace bgl::gov
