// Governor: the one interface a training process plans through. Implementations:
//   EmbeddedGovernor  the planner in-process (no daemon),
//   RemoteGovernor    bgl-governord over its unix socket (short deadlines, reconnect, re-register).
// Remote with an embedded fallback is the training process's policy and lives in one place, the
// Python package (bagualu/planning/governor.py); docs/operations.md, "One fallback", says why,
// and "Failed calls" is the table both clients follow. These C++ clients serve the tests,
// benchmarks and tools.
// Session ids are opaque handles owned by the implementation that returned them. Every call
// returns a bgl::Status/Result whose message names the offending field on bad input.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bagualu/v1/governor.pb.h"
#include "base/status.h"
#include "governor/planner/planner.h"

namespace bgl::gov {

// What a worker registers: one pipeline stage on one GPU.
struct Registration {
  std::string gpu_uuid = "host-0";
  int gpu_index = 0;
  std::string job_id;
  int pipeline_rank = 0;
  int64_t capacity_bytes = 0;            // 0: the GPU profile's memory
  std::string model_json;                // a model document (docs/planner.md), layer_graph optional
  bagualu::v1::Calibration calibration;  // unset fields keep the profile's
  bool disable_dual_batch = false;
  int64_t budget_step_bytes = 0;   // plan-cache budget bucket; 0: the planner's 64 MiB
  int64_t host_request_bytes = 0;  // pinned host bytes asked of the node; 0: a fair share
  bool disallow_offload = false;   // plans never offload
  bool disallow_fp8 = false;       // plans never store in FP8
};

// What registration returns.
struct SessionInfo {
  std::string session_id;  // the handle to pass to the other calls
  int64_t activation_capacity_bytes = 0;
  int64_t m0_bytes = 0;
  int micro_batches = 0;
  int chunks = 0;
  int layers_per_chunk = 0;
  std::vector<std::string> operator_names;  // index i of Plan::strategies names operator i
  std::string schedule;                     // "1f1b" or "interleaved-1f1b"
  int64_t host_grant_bytes = 0;             // the node's grant at registration (0: none)
};

// The gate of `gate_layer` (within the chunk) of a forward ran and saw this load factor.
struct GateObservation {
  int micro_batch = 0;
  int chunk = 0;
  int gate_layer = 0;
  double observed_load_factor = 1.0;
};

// What a forward really retained, with optional allocator counters and snapshot.
struct Consumption {
  int micro_batch = 0;
  int chunk = 0;
  int64_t actual_bytes = 0;
  bool has_stats = false;
  bagualu::v1::AllocatorStats stats;
  std::string allocator_snapshot_json;  // optional (PyTorch memory-snapshot JSON)
};

// The planning interface; implementations are thread-safe (calls on one session serialise).
class Governor {
 public:
  virtual ~Governor() = default;
  virtual Result<SessionInfo> Register(const Registration& registration) = 0;
  virtual Result<plan::Plan> Plan(const std::string& session_id,
                                  const plan::SchedulePoint& point) = 0;
  virtual Result<plan::Plan> PlanAfterGate(const std::string& session_id,
                                           const GateObservation& gate) = 0;
  virtual Status Report(const std::string& session_id, const Consumption& consumption) = 0;
  virtual Status Unregister(const std::string& session_id) = 0;
};

// Conversions used by every implementation.
void RegistrationToProto(const Registration& r, bagualu::v1::RegisterRequest* out);
SessionInfo SessionInfoFromProto(const bagualu::v1::RegisterResponse& in);

}  // namespace bgl::gov
