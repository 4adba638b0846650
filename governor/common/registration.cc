#include "governor/common/registration.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include "base/units.h"
#include "governor/planner/hardware.h"
#include "governor/planner/model_config.h"

namespace bgl::gov {
namespace {

namespace pb = bagualu::v1;

Status Exhausted(std::string msg) { return {StatusCode::kResourceExhausted, std::move(msg)}; }

// Zero means "keep the profile's"; anything else must lie in the planner's range for `key`
// (hardware.h), so subnormals and absurd speeds never reach the cost model.
Status CheckSpeed(double v, const std::string& field, const char* key) {
  if (v == 0) return OkStatus();
  Status s = plan::CheckCalibrationValue(key, v, field);
  return s.ok() ? s : InvalidArgument(s.message() + " (or 0 to keep the profile's)");
}

Status CheckRoofline(const pb::Roofline& r, const std::string& field) {
  BGL_RETURN_IF_ERROR(
      CheckSpeed(r.launch_floor_us(), field + ".launch_floor_us", "launch_floor_us"));
  return CheckSpeed(r.peak_gbps(), field + ".peak_gbps", "peak_GBps");
}

void AddRoofline(const pb::Roofline& r, const char* name, nlohmann::json& doc) {
  nlohmann::json roof = nlohmann::json::object();
  if (r.launch_floor_us() != 0) roof["launch_floor_us"] = r.launch_floor_us();
  if (r.peak_gbps() != 0) roof["peak_GBps"] = r.peak_gbps();
  if (!roof.empty()) doc["rooflines"][name] = roof;
}

Status CheckModelBounds(const plan::ModelConfig& c, const ModelBounds& b,
                        const RequestLimits& limits) {
  auto check = [](int64_t v, int64_t max, const char* field) -> Status {
    if (v > max) {
      return InvalidArgument(std::string("model_json.") + field + ": " + std::to_string(v) +
                             " exceeds the daemon's limit " + std::to_string(max));
    }
    return OkStatus();
  };
  for (auto [v, field] : {std::pair{c.hidden, "hidden"},
                          {c.moe_hidden, "moe_hidden"},
                          {c.seq_len, "seq_len"},
                          {c.heads, "heads"},
                          {c.head_dim, "head_dim"},
                          {c.micro_batch_size, "micro_batch_size"},
                          {c.shared_expert_hidden, "shared_expert_hidden"},
                          {c.shared_experts, "shared_experts"},
                          {c.gpus, "gpus"},
                          {c.dp, "dp"},
                          {c.tp, "tp"},
                          {c.ep, "ep"},
                          {c.pp, "pp"},
                          {c.vp_layers, "vp"}}) {
    BGL_RETURN_IF_ERROR(check(v, b.max_dimension, field));
  }
  BGL_RETURN_IF_ERROR(check(c.experts, b.max_experts, "experts"));
  BGL_RETURN_IF_ERROR(check(c.micro_batches, b.max_micro_batches, "micro_batches"));
  BGL_RETURN_IF_ERROR(check(c.layers, b.max_dimension, "layers"));
  if (c.pp > 0 && c.layers % c.pp == 0) {
    const int64_t per_rank = c.layers / c.pp;
    const int64_t per_chunk = c.vp_layers > 0 ? c.vp_layers : per_rank;
    if (per_chunk > limits.max_layers_per_chunk) {
      return InvalidArgument("model_json.layers: " + std::to_string(per_chunk) +
                             " layers per chunk exceed the daemon's limit " +
                             std::to_string(limits.max_layers_per_chunk) +
                             " (max_layers_per_chunk)");
    }
    if (c.vp_layers > 0 && per_rank % c.vp_layers == 0) {
      BGL_RETURN_IF_ERROR(check(per_rank / c.vp_layers, b.max_micro_batches, "vp"));
    }
  }
  if (c.layer_graph && c.layer_graph->is_object()) {
    // Counted before the graph is built: a large graph makes every plan slow.
    const int64_t max_ops = limits.max_operators_per_layer;
    for (auto [key, max] : {std::pair{"operators", max_ops}, {"tensors", 4 * max_ops}}) {
      const auto it = c.layer_graph->find(key);
      if (it != c.layer_graph->end() && it->is_array() && static_cast<int64_t>(it->size()) > max) {
        return InvalidArgument(std::string("model_json.layer_graph.") + key + ": " +
                               std::to_string(it->size()) +
                               " per layer exceed the daemon's limit " + std::to_string(max) +
                               " (max_operators_per_layer" + (max == max_ops ? "" : " x 4") + ")");
      }
    }
  }
  if (c.MicroBatches() > b.max_micro_batches) {
    return InvalidArgument("model_json.micro_batches: " + std::to_string(c.MicroBatches()) +
                           " exceeds the daemon's limit " + std::to_string(b.max_micro_batches));
  }
  return OkStatus();
}

}  // namespace

Status CheckStringField(const std::string& value, const char* field, size_t max, bool required) {
  if (value.size() > max) {
    return Exhausted(std::string(field) + ": " +
                     FormatBytes(static_cast<double>(value.size()), true) +
                     " exceeds the limit of " + FormatBytes(static_cast<double>(max), true));
  }
  if (required && value.empty()) return InvalidArgument(std::string(field) + ": required");
  for (char ch : value) {
    if (ch < 0x20 || ch > 0x7e) {
      return InvalidArgument(std::string(field) + ": must be printable ASCII");
    }
  }
  return OkStatus();
}

Status ValidateRegisterRequest(const pb::RegisterRequest& req, const RequestLimits& limits) {
  BGL_RETURN_IF_ERROR(CheckStringField(req.gpu_uuid(), "gpu_uuid", limits.max_string_bytes, true));
  if (req.gpu_index() < 0 || req.gpu_index() >= 4096) {
    return InvalidArgument("gpu_index: must be in [0, 4096), got " +
                           std::to_string(req.gpu_index()));
  }
  if (req.pid() < 0) {
    return InvalidArgument("pid: must be non-negative, got " + std::to_string(req.pid()));
  }
  BGL_RETURN_IF_ERROR(CheckStringField(req.job_id(), "job_id", limits.max_string_bytes, false));
  if (req.pipeline_rank() < 0) {
    return InvalidArgument("pipeline_rank: must be non-negative, got " +
                           std::to_string(req.pipeline_rank()));
  }
  if (req.capacity_bytes() < 0 || req.capacity_bytes() > (int64_t{1} << 50)) {
    return InvalidArgument("capacity_bytes: must be in [0, 2^50] (0: the GPU's), got " +
                           std::to_string(req.capacity_bytes()));
  }
  // Rejected rather than clamped below 4 KiB: such a step makes nearly every budget its own
  // bucket, so the plan cache would stop working without the caller noticing.
  if (req.host_request_bytes() < 0 || req.host_request_bytes() > (int64_t{1} << 50)) {
    return InvalidArgument("host_request_bytes: must be in [0, 2^50] (0: a fair share), got " +
                           std::to_string(req.host_request_bytes()));
  }
  if (req.budget_step_bytes() != 0 && (req.budget_step_bytes() < kMinBudgetStepBytes ||
                                       req.budget_step_bytes() > (int64_t{1} << 50))) {
    return InvalidArgument("budget_step_bytes: must be 0 (the default, 64 MiB) or in [" +
                           std::to_string(kMinBudgetStepBytes) + ", 2^50], got " +
                           std::to_string(req.budget_step_bytes()));
  }
  if (req.has_warm_up()) {
    const double bound = req.warm_up().spike_bound();
    if (bound != 0 && (!std::isfinite(bound) || bound < 1 || bound > 64)) {
      return InvalidArgument(
          "warm_up.spike_bound: the highest load factor the warm-up plans for must be 0 (the "
          "default, 3.0) or in [1, 64], got " +
          std::to_string(bound));
    }
  }
  if (req.model_json().size() > limits.max_model_json_bytes) {
    return Exhausted(
        "model_json: " + FormatBytes(static_cast<double>(req.model_json().size()), true) +
        " exceeds the limit of " +
        FormatBytes(static_cast<double>(limits.max_model_json_bytes), true));
  }
  if (req.model_json().empty()) return InvalidArgument("model_json: required");
  // A linear scan before any parser or copy recurses over the document.
  BGL_RETURN_IF_ERROR(
      plan::CheckJsonNesting(req.model_json(), limits.max_json_depth, "model_json"));
  const pb::Calibration& cal = req.calibration();
  BGL_RETURN_IF_ERROR(CheckStringField(cal.gpu_profile(), "calibration.gpu_profile", 64, false));
  BGL_RETURN_IF_ERROR(CheckRoofline(cal.offload(), "calibration.offload"));
  BGL_RETURN_IF_ERROR(CheckRoofline(cal.reload(), "calibration.reload"));
  BGL_RETURN_IF_ERROR(CheckRoofline(cal.fp8_cast(), "calibration.fp8_cast"));
  BGL_RETURN_IF_ERROR(CheckSpeed(cal.peak_tflops(), "calibration.peak_tflops", "peak_tflops"));
  BGL_RETURN_IF_ERROR(
      CheckSpeed(cal.matmul_efficiency(), "calibration.matmul_efficiency", "matmul_efficiency"));
  BGL_RETURN_IF_ERROR(CheckSpeed(cal.hbm_gbps(), "calibration.hbm_gbps", "hbm_GBps"));
  BGL_RETURN_IF_ERROR(
      CheckSpeed(cal.memory_efficiency(), "calibration.memory_efficiency", "memory_efficiency"));
  BGL_RETURN_IF_ERROR(
      CheckSpeed(cal.kernel_launch_us(), "calibration.kernel_launch_us", "kernel_launch_us"));
  if (cal.has_copy_overlap()) {
    BGL_RETURN_IF_ERROR(plan::CheckCalibrationValue("copy_overlap", cal.copy_overlap(),
                                                    "calibration.copy_overlap"));
  }
  if (cal.has_copy_host_us()) {
    BGL_RETURN_IF_ERROR(plan::CheckCalibrationValue("copy_host_us", cal.copy_host_us(),
                                                    "calibration.copy_host_us"));
  }
  if (cal.has_rerun_host_us()) {
    BGL_RETURN_IF_ERROR(plan::CheckCalibrationValue("rerun_host_us", cal.rerun_host_us(),
                                                    "calibration.rerun_host_us"));
  }
  return OkStatus();
}

Result<std::unique_ptr<plan::StagePlanner>> CreatePlannerFromRequest(
    const pb::RegisterRequest& req, const RequestLimits& limits, const ModelBounds& bounds,
    const nlohmann::json* node_calibration) {
  BGL_RETURN_IF_ERROR(ValidateRegisterRequest(req, limits));
  nlohmann::json doc = nlohmann::json::parse(req.model_json(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return InvalidArgument("model_json: not valid JSON");
  if (!doc.is_object()) return InvalidArgument("model_json: must be a JSON object");
  Result<plan::ModelConfig> config = [&]() -> Result<plan::ModelConfig> {
    try {
      return plan::ModelConfigFromJson(doc, "model_json", limits.max_json_depth);
    } catch (const std::exception& e) {
      return InvalidArgument(std::string("model_json: ") + e.what());
    }
  }();
  if (!config.ok()) {
    const std::string& m = config.status().message();
    return InvalidArgument(m.rfind("model_json", 0) == 0 ? m : "model_json: " + m);
  }
  BGL_RETURN_IF_ERROR(CheckModelBounds(*config, bounds, limits));
  if (req.pipeline_rank() >= config->pp) {
    return InvalidArgument("pipeline_rank: " + std::to_string(req.pipeline_rank()) +
                           " is outside [0, pp=" + std::to_string(config->pp) + ")");
  }
  const pb::Calibration& cal = req.calibration();
  // The base profile: the session's, else the node's calibration file's, else the model's.
  const bool node_gpu = node_calibration != nullptr && node_calibration->contains("gpu") &&
                        (*node_calibration)["gpu"].is_string();
  const std::string base = !cal.gpu_profile().empty() ? cal.gpu_profile()
                           : node_gpu ? (*node_calibration)["gpu"].get<std::string>()
                                      : config->gpu;
  auto hw = plan::HardwareProfileByName(base);
  if (!hw.ok()) {
    const char* field = !cal.gpu_profile().empty() ? "calibration.gpu_profile"
                        : node_gpu                 ? "the daemon's calibration file: gpu"
                                                   : "model_json.gpu";
    return InvalidArgument(std::string(field) + ": " + hw.status().message());
  }
  plan::HardwareProfile profile = *hw;
  if (node_calibration != nullptr) {
    // The machine's measured rooflines (bgl-governord --calibration), checked at start.
    nlohmann::json node = *node_calibration;
    node.erase("gpu");
    if (Status s = plan::ApplyCalibration(node, profile); !s.ok()) {
      return InvalidArgument("the daemon's calibration file: " + s.message());
    }
  }
  nlohmann::json cdoc = nlohmann::json::object();
  AddRoofline(cal.offload(), "offload", cdoc);
  AddRoofline(cal.reload(), "reload", cdoc);
  AddRoofline(cal.fp8_cast(), "fp8_cast", cdoc);
  if (cal.peak_tflops() != 0) cdoc["peak_tflops"] = cal.peak_tflops();
  if (cal.matmul_efficiency() != 0) cdoc["matmul_efficiency"] = cal.matmul_efficiency();
  if (cal.hbm_gbps() != 0) cdoc["hbm_GBps"] = cal.hbm_gbps();
  if (cal.memory_efficiency() != 0) cdoc["memory_efficiency"] = cal.memory_efficiency();
  if (cal.kernel_launch_us() != 0) cdoc["kernel_launch_us"] = cal.kernel_launch_us();
  if (cal.has_copy_overlap()) cdoc["copy_overlap"] = cal.copy_overlap();
  if (cal.has_copy_host_us()) cdoc["copy_host_us"] = cal.copy_host_us();
  if (cal.has_rerun_host_us()) cdoc["rerun_host_us"] = cal.rerun_host_us();
  if (Status s = plan::ApplyCalibration(cdoc, profile); !s.ok()) {
    return InvalidArgument("calibration: " + s.message());
  }
  plan::PlannerOptions options;
  options.capacity_bytes = req.capacity_bytes();
  options.pipeline_rank = req.pipeline_rank();
  if (req.budget_step_bytes() != 0) options.budget_step_bytes = req.budget_step_bytes();
  options.issue_policy =
      req.disable_dual_batch() ? plan::IssuePolicy::kSerial : plan::IssuePolicy::kDualBatch;
  options.mitigation.allow_offload = !req.disallow_offload();
  options.mitigation.allow_fp8 = !req.disallow_fp8();
  if (req.has_warm_up()) {
    options.warm_up = true;
    if (req.warm_up().spike_bound() != 0) options.warm_spike_bound = req.warm_up().spike_bound();
  }
  try {
    auto planner = plan::StagePlanner::Create(*config, profile, options);
    if (!planner.ok()) {
      const Status& s = planner.status();
      // Capacity problems are the caller's capacity_bytes; everything else is the model's.
      const bool capacity = s.message().find("capacity") != std::string::npos;
      return Status(s.code() == StatusCode::kOk ? StatusCode::kInvalidArgument : s.code(),
                    (capacity ? "capacity_bytes: " : "model_json: ") + s.message());
    }
    return std::move(planner).value();
  } catch (const std::exception& e) {
    return InvalidArgument(std::string("model_json: ") + e.what());
  }
}

void FillRegisterResponse(const plan::StagePlanner& planner, pb::RegisterResponse* out) {
  const plan::ModelConfig& c = planner.config();
  out->set_activation_capacity_bytes(static_cast<int64_t>(planner.activation_capacity()));
  out->set_m0_bytes(static_cast<int64_t>(planner.m0()));
  out->set_micro_batches(static_cast<int32_t>(c.MicroBatches()));
  out->set_chunks(static_cast<int32_t>(c.Chunks()));
  out->set_layers_per_chunk(static_cast<int32_t>(c.LayersPerChunk()));
  out->clear_operator_names();
  for (const auto& op : planner.graph().ops) out->add_operator_names(op.name);
  out->set_schedule(c.Interleaved() ? "interleaved-1f1b" : "1f1b");
}

}  // namespace bgl::gov
