// bglctl plan: asks the daemon for one plan of a session, for debugging.
#include <google/protobuf/util/json_util.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>

#include "bagualu/v1/governor.grpc.pb.h"
#include "base/units.h"
#include "tools/bglctl/commands.h"
#include "tools/bglctl/governor_address.h"

namespace bgl::ctl {
namespace {

bagualu::v1::Phase ToPhase(const std::string& phase) {
  if (phase == "warmup") return bagualu::v1::PHASE_WARMUP;
  if (phase == "steady") return bagualu::v1::PHASE_STEADY;
  if (phase == "cooldown") return bagualu::v1::PHASE_COOLDOWN;
  return bagualu::v1::PHASE_UNSPECIFIED;
}

std::string Bytes(int64_t bytes) { return FormatBytes(static_cast<double>(bytes)); }

void PrintSummary(const bagualu::v1::Plan& plan, std::ostream& out) {
  std::map<std::string, int> counts;
  for (int s : plan.strategies()) {
    counts[bagualu::v1::Strategy_Name(static_cast<bagualu::v1::Strategy>(s))]++;
  }
  out << "phase          " << bagualu::v1::Phase_Name(plan.phase()) << "\n";
  out << "micro-batch    " << plan.micro_batch() << " (chunk " << plan.chunk() << ")\n";
  out << "load factor    " << plan.load_factor() << "\n";
  out << "budget         " << Bytes(plan.budget_bytes()) << "\n";
  out << "free           " << Bytes(plan.free_bytes()) << " (k = " << plan.k()
      << ", M0 = " << Bytes(plan.m0_bytes()) << ")\n";
  out << "predicted      " << Bytes(plan.predicted_bytes()) << " of "
      << Bytes(plan.keep_all_bytes()) << " keep-all; " << Bytes(plan.host_bytes())
      << " offloaded to host\n";
  out << "strategies    ";
  for (const auto& [name, n] : counts) out << " " << name << "=" << n;
  out << "\n";
  out << "overhead       " << FormatSeconds(plan.overhead_s()) << " (serial "
      << FormatSeconds(plan.serial_s()) << ", overlapped " << FormatSeconds(plan.overlapped_s())
      << ", " << plan.issue_order_size() << " issue items)\n";
  out << "flags         " << (plan.infeasible() ? " infeasible" : "")
      << (plan.fallback_full_recompute() ? " full-recompute" : "")
      << (plan.deferred() ? " deferred" : "") << (plan.cache_hit() ? " cache-hit" : " cache-miss")
      << "\n";
}

// Registers a throwaway session of `options.model_path`; its id, or "" after printing why not.
std::string RegisterProbe(const CtlContext& ctx, const CtlOptions& options,
                          bagualu::v1::Governor::Stub& stub) {
  std::ifstream file(options.model_path);
  std::stringstream text;
  text << file.rdbuf();
  if (!file.good() && !file.eof()) {
    *ctx.err << "bglctl: cannot read --model " << options.model_path << "\n";
    return "";
  }
  bagualu::v1::RegisterRequest request;
  request.set_gpu_uuid("bglctl-" + std::to_string(getpid()));
  request.set_gpu_index(options.gpu_index);
  request.set_pid(getpid());
  request.set_job_id("bglctl-plan");
  request.set_capacity_bytes(options.capacity_bytes);
  request.set_budget_step_bytes(options.budget_step_bytes);  // the daemon checks the range
  request.set_model_json(text.str());
  bagualu::v1::RegisterResponse response;
  auto call = ctx.NewCall();
  const grpc::Status status = stub.Register(call.get(), request, &response);
  if (!status.ok()) {
    *ctx.err << "bglctl: " << tools::DescribeRpcFailure(ctx.address, status) << "\n";
    return "";
  }
  return response.session_id();
}

void UnregisterProbe(const CtlContext& ctx, const std::string& session_id,
                     bagualu::v1::Governor::Stub& stub) {
  bagualu::v1::UnregisterRequest request;
  request.set_session_id(session_id);
  bagualu::v1::UnregisterResponse response;
  auto call = ctx.NewCall();
  (void)stub.Unregister(call.get(), request, &response);  // the daemon reaps it otherwise
}

int PlanSession(const CtlContext& ctx, const CtlOptions& options, const std::string& session_id,
                bagualu::v1::Governor::Stub& stub) {
  bagualu::v1::PlanRequest request;
  request.set_session_id(session_id);
  request.set_phase(ToPhase(options.phase));
  if (options.forward_micro_batch) request.set_forward_micro_batch(*options.forward_micro_batch);
  request.set_forward_chunk(options.forward_chunk);
  if (options.backward_micro_batch) {
    request.set_backward_micro_batch(*options.backward_micro_batch);
  }
  request.set_backward_chunk(options.backward_chunk);
  request.set_load_factor(options.load_factor);
  if (options.bytes_in_use) request.set_bytes_in_use(*options.bytes_in_use);
  bagualu::v1::PlanResponse response;
  auto call = ctx.NewCall();
  const grpc::Status status = stub.Plan(call.get(), request, &response);
  if (!status.ok()) {
    *ctx.err << "bglctl: " << tools::DescribeRpcFailure(ctx.address, status) << "\n";
    return 1;
  }
  if (options.json) {
    std::string json;
    google::protobuf::util::JsonPrintOptions print;
    print.add_whitespace = true;
    print.preserve_proto_field_names = true;
    (void)google::protobuf::util::MessageToJsonString(response.plan(), &json, print);
    *ctx.out << json;
  } else {
    PrintSummary(response.plan(), *ctx.out);
  }
  return 0;
}

}  // namespace

int RunPlan(const CtlContext& ctx, const CtlOptions& options) {
  auto stub = bagualu::v1::Governor::NewStub(ctx.channel);
  std::string session_id = options.session_id;
  const bool probe = session_id.empty();
  if (probe) {
    session_id = RegisterProbe(ctx, options, *stub);
    if (session_id.empty()) return 1;
  }
  const int status = PlanSession(ctx, options, session_id, *stub);
  if (probe) UnregisterProbe(ctx, session_id, *stub);
  return status;
}

}  // namespace bgl::ctl
