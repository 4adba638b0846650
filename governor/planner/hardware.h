// Hardware profiles: the speeds the cost model turns FLOPs and bytes into seconds with, and the
// rooflines of the three mitigation strategies (paper IV-B), overridable by calibration.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace bgl::plan {

// time(bytes) = max(launch floor, bytes / peak); the knee sits at S = floor * peak (paper Fig. 6).
struct Roofline {
  double launch_floor_s = 0;
  double peak_bytes_per_s = 1;

  double Time(double bytes) const;
  double KneeBytes() const { return launch_floor_s * peak_bytes_per_s; }
  // Bytes mitigated per second of overhead at this size: the y axis of the paper's Fig. 6.
  double Bandwidth(double bytes) const { return bytes / Time(bytes); }
};

// One GPU model as the planner sees it.
struct HardwareProfile {
  std::string name;
  double peak_flops = 0;           // dense BF16 FLOP/s
  double matmul_efficiency = 0.6;  // achieved fraction of peak on large GEMMs
  double hbm_bytes_per_s = 0;
  double memory_efficiency = 0.8;  // achieved fraction of HBM bandwidth on elementwise kernels
  int64_t memory_bytes = 0;
  double kernel_launch_s = 5e-6;
  double intra_node_bytes_per_s = 0;  // per GPU, NVLink-class
  double inter_node_bytes_per_s = 0;  // per GPU, network
  int gpus_per_node = 8;
  Roofline offload;   // device to pinned host (D2H copy engine)
  Roofline reload;    // pinned host to device (H2D copy engine)
  Roofline fp8_cast;  // cast or uncast, bytes of the source tensor
  // The fraction of a chunk's compute time that offload and reload copies can hide under: 1
  // where copy engines run beside the kernels (GPUs), 0 where copies are synchronous (the host
  // backend, unless its copy threads measurably overlap compute).
  double copy_overlap = 1.0;
  // The host backend's fixed costs on the training thread beside what the rooflines time
  // (docs/planner.md, "The host backend's per-tensor costs"): the saved-tensor hooks and the
  // Python side of offloading one tensor and of reloading it (each way: `copy_host_s`), and of
  // rerunning one operator (`rerun_host_s`). The calibration's optional copy_host_us and
  // rerun_host_us; 0 (nothing charged) unless given.
  double copy_host_s = 0;
  double rerun_host_s = 0;
  // Set where the rooflines are an emulated device link on the host backend (the calibration's
  // "emulated_link" section, docs/planner.md "An emulated device link"): what it stands for
  // ("H200 over PCIe Gen5"), and the factor from that GPU's compute time to this machine's.
  // The host backend's copies then take the offload/reload rooflines' time (enforcer).
  std::string emulated_link;
  double emulated_compute_scale = 0;

  // Seconds a rerun of an operator whose forward takes `forward_s` costs in backward.
  double RerunTime(double forward_s) const { return forward_s + rerun_host_s; }
  // Seconds the training thread pays for an offloaded tensor, its offload and its reload.
  double CopyHostTime() const { return 2 * copy_host_s; }
  // Seconds for a kernel doing `flops` and moving `bytes` (roofline of the op itself).
  double KernelTime(double flops, double bytes) const;
  // Seconds for an all-to-all moving `bytes` out of this GPU across `group` ranks.
  double AllToAllTime(double bytes, int64_t group) const;
  Status Validate() const;
};

// The sane range of one calibration value, in the calibration file's units (peak_tflops in
// TFLOP/s, *_GBps in GB/s, *_us in microseconds). Values outside it (subnormals, 1e300) would
// make every kernel time infinite or zero and the plan meaningless, so they are refused.
struct CalibrationRange {
  const char* key;  // as in the calibration file; rooflines' keys without the strategy prefix
  double min;
  double max;
};
// The range of `key` ("peak_tflops", "peak_GBps", "launch_floor_us", ...); null if unknown.
const CalibrationRange* FindCalibrationRange(std::string_view key);
// `value` against the range of `key`; the error names `field` and the range.
Status CheckCalibrationValue(std::string_view key, double value, const std::string& field);

// Built-in profiles: "h100", "h200", "paper" (the paper's 480 TFLOP/s, 64 GB GPU), "host" (the
// host backend: a CPU as the device, synchronous copies; calibrate it on the machine at hand).
Result<HardwareProfile> HardwareProfileByName(std::string_view name);
std::vector<std::string> HardwareProfileNames();

// Applies a calibration document (JSON object; see docs/planner.md) on top of `profile`.
// Unknown keys are errors, so a typo never silently keeps a default.
Status ApplyCalibration(const nlohmann::json& doc, HardwareProfile& profile);
Status ApplyCalibrationFile(const std::string& path, HardwareProfile& profile);
// The calibration document in `path`, checked on the profile it names (else h200): NotFound
// when the file cannot be read, InvalidArgument naming the file and the field when it is bad.
Result<nlohmann::json> ReadCalibrationFile(const std::string& path);

}  // namespace bgl::plan
