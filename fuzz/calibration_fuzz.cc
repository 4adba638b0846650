// libFuzzer target: calibration files (bgl-plan --calibration, the daemon's calibration file,
// bgl-calibrate's output). ReadCalibrationFile checks the document on the profile it names (else
// h200); ApplyCalibrationFile applies it over another built-in profile (h100), as a caller that
// keeps its own base does. An error Status is a clean refusal.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>  // ReadCalibrationFile returns a json (hardware.h declares it)

#include "fuzz/fuzz_util.h"
#include "governor/planner/hardware.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bgl::fuzz::ScratchRemover remover(bgl::fuzz::ScratchPath(".json"));
  bgl::fuzz::WriteInput(remover.path, data, size);
  auto doc = bgl::plan::ReadCalibrationFile(remover.path);
  (void)doc.ok();
  auto profile = bgl::plan::HardwareProfileByName("h100");
  if (!profile.ok()) __builtin_trap();  // a built-in profile must exist
  const bgl::Status applied = bgl::plan::ApplyCalibrationFile(remover.path, *profile);
  if (!applied.ok() && applied.message().empty()) __builtin_trap();  // a refusal says why
  return 0;
}
