// Registration: checks a RegisterRequest field by field and builds the session's StagePlanner
// from it. Shared by the daemon and the client's embedded planner, so both accept exactly the
// same registrations and name the same fields in their errors.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>

#include "bagualu/v1/governor.pb.h"
#include "base/status.h"
#include "governor/planner/planner.h"

namespace bgl::gov {

// Limits on requests, set from the daemon's configuration (docs/operations.md). Exceeding a size
// or count is RESOURCE_EXHAUSTED; a model nested too deep, or with more operators or layers than
// allowed, is INVALID_ARGUMENT naming the field. A plain value: copied under GovernorCore's lock.
struct RequestLimits {
  size_t max_model_json_bytes = size_t{4} << 20;
  size_t max_snapshot_json_bytes = size_t{16} << 20;
  size_t max_string_bytes = 256;  // gpu_uuid, job_id, session ids
  int max_sessions_per_uid = 64;
  int max_sessions = 4096;
  int max_json_depth = plan::kDefaultMaxJsonDepth;  // arrays/objects, scanned before parsing
  int max_operators_per_layer = 256;                // layer_graph operators (tensors: 4x)
  int max_layers_per_chunk = 16;                    // layers one planner holds
  int plan_timeout_ms = 2000;                       // one Plan call's planning time
};

// Upper bounds on model fields that keep one session's planner small (the planner itself only
// checks consistency). Violations are INVALID_ARGUMENT naming "model_json.<field>".
struct ModelBounds {
  int64_t max_micro_batches = 1024;
  int64_t max_dimension = int64_t{1} << 20;  // hidden, moe_hidden, seq_len, heads...
  int64_t max_experts = 1 << 16;
};

// The smallest RegisterRequest.budget_step_bytes the daemon accepts (0 keeps the default).
inline constexpr int64_t kMinBudgetStepBytes = 4096;

// Checks every field of `req` that does not need the model parsed.
Status ValidateRegisterRequest(const bagualu::v1::RegisterRequest& req,
                               const RequestLimits& limits);

// Parses the model, applies the calibrations (the node's, `node_calibration` when not null:
// the daemon's --calibration file, then the request's) and creates the planner. Errors name
// the field ("model_json: ...", "calibration.offload.peak_gbps: ...").
Result<std::unique_ptr<plan::StagePlanner>> CreatePlannerFromRequest(
    const bagualu::v1::RegisterRequest& req, const RequestLimits& limits,
    const ModelBounds& bounds = {}, const nlohmann::json* node_calibration = nullptr);

// Fills everything but session_id from the planner.
void FillRegisterResponse(const plan::StagePlanner& planner, bagualu::v1::RegisterResponse* out);

// Checks a string field: length (RESOURCE_EXHAUSTED past `max`) and printable ASCII.
Status CheckStringField(const std::string& value, const char* field, size_t max, bool required);

}  // namespace bgl::gov
