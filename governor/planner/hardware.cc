#include "governor/planner/hardware.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "governor/planner/json_limits.h"

namespace bgl::plan {

double Roofline::Time(double bytes) const {
  return std::max(launch_floor_s, bytes / peak_bytes_per_s);
}

double HardwareProfile::KernelTime(double flops, double bytes) const {
  const double compute = flops / (peak_flops * matmul_efficiency);
  const double memory = bytes / (hbm_bytes_per_s * memory_efficiency);
  return std::max({kernel_launch_s, compute, memory});
}

double HardwareProfile::AllToAllTime(double bytes, int64_t group) const {
  if (group <= 1 || bytes <= 0) return 0;
  const double leaving = bytes * static_cast<double>(group - 1) / static_cast<double>(group);
  const double bandwidth = group <= gpus_per_node ? intra_node_bytes_per_s : inter_node_bytes_per_s;
  return kernel_launch_s * 2 + leaving / bandwidth;
}

namespace {

constexpr double kGB = 1e9;
constexpr double kGiB = 1024.0 * 1024 * 1024;

constexpr CalibrationRange kCalibrationRanges[] = {
    {"peak_tflops", 0.001, 1e6},
    {"matmul_efficiency", 0.01, 1},
    {"memory_efficiency", 0.01, 1},
    {"hbm_GBps", 1, 1e6},
    {"memory_GiB", 1.0 / 1024, 1e6},
    {"kernel_launch_us", 0.001, 1e6},
    {"intra_node_GBps", 0.01, 1e6},
    {"inter_node_GBps", 0.01, 1e6},
    {"gpus_per_node", 1, 65536},
    {"launch_floor_us", 0.001, 1e6},
    {"peak_GBps", 1e-5, 1e6},  // an emulated PCIe link on a CPU: about 1 MB/s
    {"copy_overlap", 0, 1},
    // The host backend's fixed costs per copied tensor (each way) and per rerun operator.
    {"copy_host_us", 0, 1e6},
    {"rerun_host_us", 0, 1e6},
    // An emulated link's compute factor (this machine's FLOP rate over the GPU's).
    {"compute_scale", 1e-9, 1},
};

std::string Number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

}  // namespace

const CalibrationRange* FindCalibrationRange(std::string_view key) {
  for (const auto& r : kCalibrationRanges) {
    if (key == r.key) return &r;
  }
  return nullptr;
}

Status CheckCalibrationValue(std::string_view key, double value, const std::string& field) {
  const CalibrationRange* r = FindCalibrationRange(key);
  if (r == nullptr) return InvalidArgument(field + ": unknown calibration key");
  if (!std::isfinite(value) || value < r->min || value > r->max) {
    return InvalidArgument(field + ": must be in [" + Number(r->min) + ", " + Number(r->max) +
                           "], got " + Number(value));
  }
  return OkStatus();
}

Status HardwareProfile::Validate() const {
  const std::string where = "hardware profile '" + name + "': ";
  auto check = [&](const char* key, double v, const std::string& field) -> Status {
    Status s = CheckCalibrationValue(key, v, field);
    return s.ok() ? s : InvalidArgument(where + s.message());
  };
  BGL_RETURN_IF_ERROR(check("peak_tflops", peak_flops / 1e12, "peak_tflops"));
  BGL_RETURN_IF_ERROR(check("matmul_efficiency", matmul_efficiency, "matmul_efficiency"));
  BGL_RETURN_IF_ERROR(check("hbm_GBps", hbm_bytes_per_s / kGB, "hbm_GBps"));
  BGL_RETURN_IF_ERROR(check("memory_efficiency", memory_efficiency, "memory_efficiency"));
  BGL_RETURN_IF_ERROR(check("memory_GiB", static_cast<double>(memory_bytes) / kGiB, "memory_GiB"));
  BGL_RETURN_IF_ERROR(check("kernel_launch_us", kernel_launch_s * 1e6, "kernel_launch_us"));
  BGL_RETURN_IF_ERROR(check("intra_node_GBps", intra_node_bytes_per_s / kGB, "intra_node_GBps"));
  BGL_RETURN_IF_ERROR(check("inter_node_GBps", inter_node_bytes_per_s / kGB, "inter_node_GBps"));
  BGL_RETURN_IF_ERROR(check("gpus_per_node", gpus_per_node, "gpus_per_node"));
  BGL_RETURN_IF_ERROR(check("copy_overlap", copy_overlap, "copy_overlap"));
  BGL_RETURN_IF_ERROR(check("copy_host_us", copy_host_s * 1e6, "copy_host_us"));
  BGL_RETURN_IF_ERROR(check("rerun_host_us", rerun_host_s * 1e6, "rerun_host_us"));
  for (auto [roof, label] :
       {std::pair{&offload, "offload"}, {&reload, "reload"}, {&fp8_cast, "fp8_cast"}}) {
    const std::string prefix = std::string("rooflines.") + label + ".";
    BGL_RETURN_IF_ERROR(
        check("launch_floor_us", roof->launch_floor_s * 1e6, prefix + "launch_floor_us"));
    BGL_RETURN_IF_ERROR(check("peak_GBps", roof->peak_bytes_per_s / kGB, prefix + "peak_GBps"));
  }
  return OkStatus();
}

namespace {

HardwareProfile Hopper(std::string name, double hbm_gbps, double memory_gib) {
  HardwareProfile p;
  p.name = std::move(name);
  p.peak_flops = 989e12;
  p.hbm_bytes_per_s = hbm_gbps * kGB;
  p.memory_bytes = static_cast<int64_t>(memory_gib * kGiB);
  p.intra_node_bytes_per_s = 450 * kGB;  // NVLink 4, one direction
  p.inter_node_bytes_per_s = 50 * kGB;   // one 400 Gb/s NIC per GPU
  p.offload = {10e-6, 50 * kGB};         // PCIe Gen5 x16, pinned
  p.reload = {10e-6, 50 * kGB};
  // A cast reads 2 bytes and writes 1 per element: ~2/3 of achieved HBM bandwidth in source bytes.
  p.fp8_cast = {6e-6, hbm_gbps * kGB * 0.8 * 2.0 / 3.0};
  return p;
}

}  // namespace

Result<HardwareProfile> HardwareProfileByName(std::string_view name) {
  if (name == "h100") return Hopper("h100", 3350, 80);
  if (name == "h200") return Hopper("h200", 4800, 141e9 / kGiB);
  if (name == "paper") {
    // The paper's GPU (VI-A): 480 TFLOP/s BF16, 64 GB, 400 GB/s intra-node, 4x400 Gb/s per node.
    HardwareProfile p;
    p.name = "paper";
    p.peak_flops = 480e12;
    p.hbm_bytes_per_s = 1800 * kGB;
    p.memory_bytes = static_cast<int64_t>(64 * kGB);
    p.intra_node_bytes_per_s = 400 * kGB;
    p.inter_node_bytes_per_s = 4 * 400e9 / 8 / 8;  // node NICs shared by 8 GPUs
    p.offload = {10e-6, 32 * kGB};
    p.reload = {10e-6, 32 * kGB};
    p.fp8_cast = {6e-6, 1800 * kGB * 0.8 * 2.0 / 3.0};
    return p;
  }
  if (name == "host") {
    // The host backend (a CPU as the device, PyTorch on CPU): a few cores' worth of compute,
    // memcpy-speed copies that do not overlap compute. Placeholders of the right order for a
    // small server; bagualu measures the machine at hand and overrides them (calibration).
    HardwareProfile p;
    p.name = "host";
    p.peak_flops = 0.2e12;
    p.matmul_efficiency = 1;
    p.hbm_bytes_per_s = 20 * kGB;
    p.memory_efficiency = 1;
    p.memory_bytes = static_cast<int64_t>(64 * kGiB);
    p.kernel_launch_s = 2e-6;
    p.intra_node_bytes_per_s = 10 * kGB;
    p.inter_node_bytes_per_s = 1 * kGB;
    p.offload = {5e-6, 10 * kGB};
    p.reload = {5e-6, 10 * kGB};
    p.fp8_cast = {5e-6, 1 * kGB};
    p.copy_overlap = 0;
    return p;
  }
  std::string known;
  for (const auto& n : HardwareProfileNames()) known += (known.empty() ? "" : ", ") + n;
  return InvalidArgument("gpu: unknown hardware profile '" + std::string(name) +
                         "' (known: " + known + ")");
}

std::vector<std::string> HardwareProfileNames() { return {"h100", "h200", "paper", "host"}; }

namespace {

// `key` names the field in errors; its last component picks the range.
Status ReadNumber(const nlohmann::json& doc, const std::string& key, double& out) {
  if (!doc.is_number()) {
    return InvalidArgument("calibration: '" + key + "' must be a number, got a " +
                           std::string(doc.type_name()));
  }
  out = doc.get<double>();
  const std::string base = key.substr(key.rfind('.') == std::string::npos ? 0 : key.rfind('.') + 1);
  if (FindCalibrationRange(base) == nullptr) {
    return InvalidArgument("calibration: unknown key '" + key + "'");
  }
  return CheckCalibrationValue(base, out, "calibration: '" + key + "'");
}

Status ReadRoofline(const nlohmann::json& doc, const std::string& key, Roofline& roofline) {
  if (!doc.is_object()) return InvalidArgument("calibration: '" + key + "' must be an object");
  for (const auto& [field, value] : doc.items()) {
    double v = 0;
    BGL_RETURN_IF_ERROR(ReadNumber(value, key + "." + field, v));
    if (field == "launch_floor_us")
      roofline.launch_floor_s = v * 1e-6;
    else if (field == "peak_GBps")
      roofline.peak_bytes_per_s = v * kGB;
    else
      return InvalidArgument("calibration: unknown key '" + key + "." + field + "'");
  }
  return OkStatus();
}

// "emulated_link": {"stands_for": "H200 over PCIe Gen5", "compute_scale": 2.1e-4}.
Status ReadEmulatedLink(const nlohmann::json& value, HardwareProfile& p) {
  if (!value.is_object()) {
    return InvalidArgument(
        "calibration: 'emulated_link' must be an object with 'stands_for' "
        "and 'compute_scale'");
  }
  bool named = false, scaled = false;
  for (const auto& [field, v] : value.items()) {
    const std::string name = "emulated_link." + field;
    if (field == "stands_for") {
      if (!v.is_string() || v.get<std::string>().empty() || v.get<std::string>().size() > 200) {
        return InvalidArgument("calibration: '" + name + "' must be a string of 1-200 bytes");
      }
      p.emulated_link = v.get<std::string>();
      named = true;
    } else if (field == "compute_scale") {
      BGL_RETURN_IF_ERROR(ReadNumber(v, name, p.emulated_compute_scale));
      scaled = true;
    } else {
      return InvalidArgument("calibration: unknown key '" + name + "'");
    }
  }
  if (!named || !scaled) {
    return InvalidArgument(std::string("calibration: 'emulated_link' lacks '") +
                           (named ? "compute_scale" : "stands_for") + "'");
  }
  return OkStatus();
}

}  // namespace

Status ApplyCalibration(const nlohmann::json& doc, HardwareProfile& p) {
  if (!doc.is_object()) return InvalidArgument("calibration: top level must be a JSON object");
  // "gpu" picks the base profile; every other key overrides a field of it.
  if (doc.contains("gpu")) {
    if (!doc["gpu"].is_string()) return InvalidArgument("calibration: 'gpu' must be a string");
    auto base = HardwareProfileByName(doc["gpu"].get<std::string>());
    if (!base.ok()) return base.status();
    p = *base;
  }
  for (const auto& [key, value] : doc.items()) {
    double v = 0;
    if (key == "gpu") {
      continue;
    } else if (key == "rooflines") {
      if (!value.is_object()) return InvalidArgument("calibration: 'rooflines' must be an object");
      for (const auto& [strategy, roof] : value.items()) {
        const std::string name = "rooflines." + strategy;
        if (strategy == "offload")
          BGL_RETURN_IF_ERROR(ReadRoofline(roof, name, p.offload));
        else if (strategy == "reload")
          BGL_RETURN_IF_ERROR(ReadRoofline(roof, name, p.reload));
        else if (strategy == "fp8_cast")
          BGL_RETURN_IF_ERROR(ReadRoofline(roof, name, p.fp8_cast));
        else
          return InvalidArgument("calibration: unknown strategy '" + name + "'");
      }
    } else if (key == "peak_tflops") {
      BGL_RETURN_IF_ERROR(ReadNumber(value, key, v));
      p.peak_flops = v * 1e12;
    } else if (key == "matmul_efficiency") {
      BGL_RETURN_IF_ERROR(ReadNumber(value, key, p.matmul_efficiency));
    } else if (key == "memory_efficiency") {
      BGL_RETURN_IF_ERROR(ReadNumber(value, key, p.memory_efficiency));
    } else if (key == "hbm_GBps") {
      BGL_RETURN_IF_ERROR(ReadNumber(value, key, v));
      p.hbm_bytes_per_s = v * kGB;
    } else if (key == "memory_GiB") {
      BGL_RETURN_IF_ERROR(ReadNumber(value, key, v));
      p.memory_bytes = static_cast<int64_t>(v * kGiB);
    } else if (key == "kernel_launch_us") {
      BGL_RETURN_IF_ERROR(ReadNumber(value, key, v));
      p.kernel_launch_s = v * 1e-6;
    } else if (key == "intra_node_GBps") {
      BGL_RETURN_IF_ERROR(ReadNumber(value, key, v));
      p.intra_node_bytes_per_s = v * kGB;
    } else if (key == "inter_node_GBps") {
      BGL_RETURN_IF_ERROR(ReadNumber(value, key, v));
      p.inter_node_bytes_per_s = v * kGB;
    } else if (key == "gpus_per_node") {
      BGL_RETURN_IF_ERROR(ReadNumber(value, key, v));
      p.gpus_per_node = static_cast<int>(v);
    } else if (key == "copy_overlap") {
      BGL_RETURN_IF_ERROR(ReadNumber(value, key, p.copy_overlap));
    } else if (key == "copy_host_us") {
      BGL_RETURN_IF_ERROR(ReadNumber(value, key, v));
      p.copy_host_s = v * 1e-6;
    } else if (key == "rerun_host_us") {
      BGL_RETURN_IF_ERROR(ReadNumber(value, key, v));
      p.rerun_host_s = v * 1e-6;
    } else if (key == "emulated_link") {
      BGL_RETURN_IF_ERROR(ReadEmulatedLink(value, p));
    } else if (key == "comment" || key == "source") {
      // Free-text provenance, kept by tools that write calibration files.
    } else {
      return InvalidArgument("calibration: unknown key '" + key + "'");
    }
  }
  return p.Validate();
}

namespace {

Result<nlohmann::json> ParseCalibrationFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return NotFound("calibration: cannot open '" + path + "'");
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string text = buffer.str();
  // Checked before parsing: errors never print a deeply nested value.
  BGL_RETURN_IF_ERROR(CheckJsonNesting(text, kDefaultMaxJsonDepth, "calibration: " + path));
  nlohmann::json doc = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return InvalidArgument("calibration: '" + path + "' is not valid JSON");
  return doc;
}

}  // namespace

Status ApplyCalibrationFile(const std::string& path, HardwareProfile& profile) {
  auto doc = ParseCalibrationFile(path);
  if (!doc.ok()) return doc.status();
  Status s = ApplyCalibration(*doc, profile);
  if (!s.ok()) return {s.code(), path + ": " + s.message()};
  return OkStatus();
}

Result<nlohmann::json> ReadCalibrationFile(const std::string& path) {
  auto doc = ParseCalibrationFile(path);
  if (!doc.ok()) return doc.status();
  auto base = HardwareProfileByName("h200");
  Status s = ApplyCalibration(*doc, *base);
  if (!s.ok()) return Status(s.code(), path + ": " + s.message());
  return doc;
}

}  // namespace bgl::plan
