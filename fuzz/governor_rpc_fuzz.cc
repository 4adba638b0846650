// libFuzzer target: every RPC's request through the daemon's handlers (GovernorCore), parse then
// handle, as the gRPC adapter does: bytes -> ParseFromArray -> the handler. One input is a short
// call sequence on a fresh core (no state survives an input):
//   repeated { op: 1 byte, length: 2 bytes little-endian, that many bytes: the request's wire
//              encoding }
// op % 8 picks the RPC (Register, Plan, Report, Unregister, ListSessions, Snapshot, Watch's
// check and one sample, a second Register), op / 8 % 3 the caller (two users, one admin). A
// request whose session_id is at most one byte long gets the id of the session registered
// (byte % registered) instead, so Plan, Report and the rest reach a live session. Bytes that do
// not parse are skipped, as gRPC refuses them before the handler.
//
// Findings: a crash or sanitizer report; a refusal with no message (every error must say what
// was wrong); a status code other than the handlers' documented ones.
//
// Seeds (scripts/fuzz.sh): with BGL_FUZZ_WRITE_SEEDS=DIR and BGL_FUZZ_SEED_MODELS="a.json ...",
// the target writes a seed per model file (Register with that model, a first Plan, a Report, a
// ListSessions, a Snapshot, an Unregister) into DIR and exits before fuzzing.
#include <google/protobuf/stubs/logging.h>
#include <grpcpp/support/status.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "bagualu/v1/governor.pb.h"
#include "governor/service/governor_core.h"

namespace {

namespace pb = bagualu::v1;
using bgl::gov::Caller;
using bgl::gov::GovernorCore;

constexpr int kMaxCalls = 16;

const Caller kCallers[] = {
    {1000, 101, false, "alice"}, {2000, 202, false, "bob"}, {0, 1, true, "root"}};

void Check(const grpc::Status& s) {
  if (s.ok()) return;
  if (s.error_message().empty()) {
    std::fprintf(stderr, "governor_rpc_fuzz: status %d with no message\n", s.error_code());
    __builtin_trap();
  }
  switch (s.error_code()) {
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::NOT_FOUND:
    case grpc::StatusCode::PERMISSION_DENIED:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
    case grpc::StatusCode::UNAVAILABLE:
      return;
    default:
      std::fprintf(stderr, "governor_rpc_fuzz: unexpected status %d: %s\n", s.error_code(),
                   s.error_message().c_str());
      __builtin_trap();
  }
}

// The id of a registered session for a short session_id, else the request's own.
template <typename Req>
void PickSession(Req* req, const std::vector<std::string>& ids) {
  if (req->session_id().size() > 1 || ids.empty()) return;
  const size_t k =
      req->session_id().empty() ? 0 : static_cast<unsigned char>(req->session_id()[0]) % ids.size();
  req->set_session_id(ids[k]);
}

template <typename Req>
bool Parse(const uint8_t* data, size_t size, Req* req) {
  return req->ParseFromArray(data, static_cast<int>(size));
}

void Call(GovernorCore& core, uint8_t op, const uint8_t* data, size_t size,
          std::vector<std::string>* ids) {
  const Caller& caller = kCallers[(op / 8) % 3];
  switch (op % 8) {
    case 0:
    case 7: {
      pb::RegisterRequest req;
      pb::RegisterResponse resp;
      if (!Parse(data, size, &req)) return;
      const grpc::Status s = core.Register(caller, req, &resp);
      Check(s);
      if (s.ok()) ids->push_back(resp.session_id());
      return;
    }
    case 1: {
      pb::PlanRequest req;
      pb::PlanResponse resp;
      if (!Parse(data, size, &req)) return;
      PickSession(&req, *ids);
      Check(core.Plan(caller, req, &resp));
      return;
    }
    case 2: {
      pb::ReportRequest req;
      pb::ReportResponse resp;
      if (!Parse(data, size, &req)) return;
      PickSession(&req, *ids);
      Check(core.Report(caller, req, &resp));
      return;
    }
    case 3: {
      pb::UnregisterRequest req;
      pb::UnregisterResponse resp;
      if (!Parse(data, size, &req)) return;
      PickSession(&req, *ids);
      Check(core.Unregister(caller, req, &resp));
      return;
    }
    case 4: {
      pb::ListSessionsRequest req;
      pb::ListSessionsResponse resp;
      if (!Parse(data, size, &req)) return;
      Check(core.ListSessions(caller, req, &resp));
      return;
    }
    case 5: {
      pb::SnapshotRequest req;
      pb::SnapshotResponse resp;
      if (!Parse(data, size, &req)) return;
      PickSession(&req, *ids);
      Check(core.Snapshot(caller, req, &resp));
      return;
    }
    default: {
      pb::WatchRequest req;
      if (!Parse(data, size, &req)) return;
      const grpc::Status s = core.ValidateWatch(req);
      Check(s);
      if (s.ok()) {
        pb::WatchResponse resp;
        core.Sample(caller, &resp);
      }
      return;
    }
  }
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void Append(std::string* out, uint8_t op, const google::protobuf::MessageLite& msg) {
  const std::string wire = msg.SerializeAsString();
  if (wire.size() > 0xffff) return;
  out->push_back(static_cast<char>(op));
  out->push_back(static_cast<char>(wire.size() & 0xff));
  out->push_back(static_cast<char>(wire.size() >> 8));
  out->append(wire);
}

// BGL_FUZZ_WRITE_SEEDS: one seed per model file, then exit.
void WriteSeeds(const char* dir, const char* models) {
  std::istringstream list(models == nullptr ? "" : models);
  std::string path;
  int n = 0;
  while (list >> path) {
    pb::RegisterRequest reg;
    reg.set_gpu_uuid("host-0");
    reg.set_capacity_bytes(int64_t{8} << 30);
    reg.set_model_json(ReadFile(path));
    std::string seed;
    Append(&seed, 0, reg);
    pb::PlanRequest plan;
    plan.set_session_id("");
    plan.set_forward_micro_batch(0);
    plan.set_load_factor(1.0);
    Append(&seed, 1, plan);
    pb::ReportRequest report;
    report.set_actual_bytes(int64_t{1} << 20);
    Append(&seed, 2, report);
    Append(&seed, 4, pb::ListSessionsRequest());
    Append(&seed, 5, pb::SnapshotRequest());
    pb::WatchRequest watch;
    watch.set_max_samples(1);
    Append(&seed, 6, watch);
    Append(&seed, 3, pb::UnregisterRequest());
    const std::string name = std::string(dir) + "/seed-" + std::to_string(n++);
    std::ofstream(name, std::ios::binary) << seed;
  }
  std::fprintf(stderr, "governor_rpc_fuzz: wrote %d seeds to %s\n", n, dir);
  std::exit(0);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // protobuf logs every string field that is not UTF-8 before ParseFromArray refuses it.
  google::protobuf::SetLogHandler(
      [](google::protobuf::LogLevel, const char*, int, const std::string&) {});
  if (const char* dir = std::getenv("BGL_FUZZ_WRITE_SEEDS"); dir != nullptr && *dir) {
    WriteSeeds(dir, std::getenv("BGL_FUZZ_SEED_MODELS"));
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  bgl::gov::RequestLimits limits;
  limits.plan_timeout_ms = 500;  // a slow plan ends in DEADLINE_EXCEEDED, not a fuzz timeout
  GovernorCore core(nullptr, limits);
  std::vector<std::string> ids;
  size_t at = 0;
  for (int calls = 0; calls < kMaxCalls && at + 3 <= size; ++calls) {
    const uint8_t op = data[at];
    size_t len = data[at + 1] | (static_cast<size_t>(data[at + 2]) << 8);
    at += 3;
    if (len > size - at) len = size - at;
    Call(core, op, data + at, len, &ids);
    at += len;
  }
  return 0;
}
