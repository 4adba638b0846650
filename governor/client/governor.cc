#include "governor/client/governor.h"

#include <unistd.h>

namespace bgl::gov {

void RegistrationToProto(const Registration& r, bagualu::v1::RegisterRequest* out) {
  out->set_gpu_uuid(r.gpu_uuid);
  out->set_gpu_index(r.gpu_index);
  out->set_pid(static_cast<int32_t>(::getpid()));
  out->set_job_id(r.job_id);
  out->set_pipeline_rank(r.pipeline_rank);
  out->set_capacity_bytes(r.capacity_bytes);
  out->set_model_json(r.model_json);
  *out->mutable_calibration() = r.calibration;
  out->set_disable_dual_batch(r.disable_dual_batch);
  out->set_budget_step_bytes(r.budget_step_bytes);
  out->set_host_request_bytes(r.host_request_bytes);
  out->set_disallow_offload(r.disallow_offload);
  out->set_disallow_fp8(r.disallow_fp8);
}

SessionInfo SessionInfoFromProto(const bagualu::v1::RegisterResponse& in) {
  SessionInfo s;
  s.session_id = in.session_id();
  s.activation_capacity_bytes = in.activation_capacity_bytes();
  s.m0_bytes = in.m0_bytes();
  s.micro_batches = in.micro_batches();
  s.chunks = in.chunks();
  s.layers_per_chunk = in.layers_per_chunk();
  s.operator_names.assign(in.operator_names().begin(), in.operator_names().end());
  s.schedule = in.schedule();
  s.host_grant_bytes = in.host_grant_bytes();
  return s;
}

}  // namespace bgl::gov
