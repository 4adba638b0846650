// EmulatedLinkOps: DeviceOps over the host backend's whose offload and reload copies take the
// time a device's copy link would take for their bytes (docs/planner.md, "An emulated device
// link"). The bytes really move; then the copy's stream waits, without spinning, until the
// link's time for those bytes has passed since the copy started (the roofline's time, as the
// planner's cost model has it: the launch floor or bytes over the peak rate). A stream per
// direction (the enforcer's copy threads) is then a copy engine busy exactly as long as that
// link would be, so copies overlap compute only where the issue order put them ahead of it.
// The rates are a calibration's offload and reload rooflines (the planner plans with the same
// ones); the direction is read from the pinned host memory this object handed out. FP8 casts,
// device-to-device copies and everything else are the upstream's, at their own cost.
#pragma once

#include <memory>

#include "enforcer/device_ops.h"
#include "governor/planner/hardware.h"

namespace bgl::enf {

// Time for an emulated link. Thread safe.
class LinkClock {
 public:
  virtual ~LinkClock() = default;
  virtual double now_s() = 0;
  // Returns once now_s() >= t (a real clock sleeps; a simulated one may jump).
  virtual void sleep_until_s(double t) = 0;
};

// The steady clock, sleeping (not spinning) until the time has come.
LinkClock& steady_link_clock();

// The copy times of the emulated link, per direction.
struct LinkTimes {
  plan::Roofline offload;  // device to pinned host
  plan::Roofline reload;   // pinned host to device
};

// Wraps `upstream` (the host backend's ops); `clock` null: steady_link_clock(). The clock must
// outlive the ops.
std::unique_ptr<DeviceOps> make_emulated_link_ops(std::unique_ptr<DeviceOps> upstream,
                                                  const LinkTimes& times,
                                                  LinkClock* clock = nullptr);

}  // namespace bgl::enf
