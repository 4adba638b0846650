#include "governor/daemon/systemd_notify.h"

#ifdef BGL_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#endif

namespace bgl::gov {

void NotifySystemd(const std::string& state) {
#ifdef BGL_HAVE_SYSTEMD
  sd_notify(0, state.c_str());
#else
  (void)state;
#endif
}

std::chrono::microseconds WatchdogPingInterval() {
#ifdef BGL_HAVE_SYSTEMD
  uint64_t usec = 0;
  if (sd_watchdog_enabled(0, &usec) > 0 && usec > 0) return std::chrono::microseconds(usec / 2);
#endif
  return std::chrono::microseconds(0);
}

}  // namespace bgl::gov
