// governor_probe: a separate client process for the integration tests (another pid, and under
// setuid another uid). Modes:
//   register-exit ADDR MODEL_FILE          registers and exits without unregistering
//   intrude ADDR SESSION_ID MODEL_FILE     tries to read and change someone else's session
//   register-hold ADDR MODEL_FILE GPU      registers on GPU index GPU, then sleeps (to be killed)
//   watch ADDR N HOLD_MS                   opens N Watch streams, prints each one's status
//                                          (OK once its first sample arrived), holds them
//   own ADDR MODEL_FILE DONE_FILE          registers, plans and reports a snapshot; prints
//                                          "session=ID", waits for DONE_FILE (30 s at most),
//                                          then uses its session again and surveys the rest
//   intrude-all ADDR SESSION_ID MODEL_FILE calls every RPC on another user's session, surveys
//                                          what it sees, then registers and uses its own
// The last two print one line per call, "NAME=CODE MESSAGE" (CODE: grpc::StatusCode's number),
// and per survey "NAME=CODE others=N": rows of sessions of another uid than the probe's.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "governor/client/remote_governor.h"
#include "tests/integration/daemon_process.h"

using bgl::gov::RemoteGovernor;
using bgl::gov::RemoteOptions;

namespace {

const char* CodeName(const bgl::Status& s) {
  switch (s.code()) {
    case bgl::StatusCode::kOk:
      return "OK";
    case bgl::StatusCode::kNotFound:
      return "NOT_FOUND";
    case bgl::StatusCode::kFailedPrecondition:
      return "DENIED";
    case bgl::StatusCode::kInvalidArgument:
      return "INVALID_ARGUMENT";
    default:
      return "OTHER";
  }
}

bgl::gov::Registration TinyRegistration(const std::string& model_file) {
  bgl::gov::Registration reg;
  reg.gpu_uuid = "host-probe";
  reg.model_json = bgl::gov::testing::ReadFile(model_file);
  reg.capacity_bytes = int64_t{8} << 30;
  return reg;
}

namespace pb = bagualu::v1;

// One call with a 2 s deadline; prints "NAME=CODE MESSAGE".
template <typename Fn>
grpc::Status Call(const char* name, Fn&& fn) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  grpc::Status s = fn(ctx);
  std::printf("%s=%d %s\n", name, static_cast<int>(s.error_code()), s.error_message().c_str());
  std::fflush(stdout);
  return s;
}

// Registers the tiny model on "host-probe" through the raw stub (the daemon's own session id,
// not a client handle), plans its first forward and reports with an allocator snapshot.
std::string RegisterAndUse(pb::Governor::Stub& stub, const std::string& model_file) {
  pb::RegisterRequest reg;
  reg.set_gpu_uuid("host-probe");
  reg.set_job_id("probe-job");
  reg.set_model_json(bgl::gov::testing::ReadFile(model_file));
  reg.set_capacity_bytes(int64_t{8} << 30);
  pb::RegisterResponse registered;
  if (!Call("own_register", [&](grpc::ClientContext& c) {
         return stub.Register(&c, reg, &registered);
       }).ok()) {
    return "";
  }
  pb::PlanRequest plan;
  plan.set_session_id(registered.session_id());
  plan.set_forward_micro_batch(0);
  plan.set_load_factor(1.2);
  pb::PlanResponse planned;
  Call("own_plan", [&](grpc::ClientContext& c) { return stub.Plan(&c, plan, &planned); });
  pb::ReportRequest report;
  report.set_session_id(registered.session_id());
  report.set_actual_bytes(int64_t{1} << 20);
  report.set_allocator_snapshot_json("{\"segments\": []}");
  pb::ReportResponse reported;
  Call("own_report", [&](grpc::ClientContext& c) { return stub.Report(&c, report, &reported); });
  return registered.session_id();
}

// What the caller sees of the node: ListSessions, one Watch sample, Snapshot of every visible
// session. Each line counts the rows of another uid's sessions (the snapshot's by id: `theirs`).
void Survey(pb::Governor::Stub& stub, const std::string& theirs) {
  const uint32_t me = getuid();
  pb::ListSessionsResponse list;
  grpc::Status s = [&] {
    grpc::ClientContext ctx;
    return stub.ListSessions(&ctx, pb::ListSessionsRequest(), &list);
  }();
  int others = 0, mine = 0;
  for (const auto& session : list.sessions()) (session.uid() == me ? mine : others) += 1;
  std::printf("list=%d others=%d mine=%d\n", static_cast<int>(s.error_code()), others, mine);
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    pb::WatchRequest req;
    req.set_interval_ms(10);
    req.set_max_samples(1);
    auto reader = stub.Watch(&ctx, req);
    pb::WatchResponse sample;
    others = mine = 0;
    int gpus = 0;
    while (reader->Read(&sample)) {
      for (const auto& gpu : sample.gpus()) {
        gpus += 1;
        for (const auto& row : gpu.processes()) (row.session().uid() == me ? mine : others) += 1;
      }
    }
    s = reader->Finish();
    std::printf("watch=%d others=%d mine=%d gpus=%d\n", static_cast<int>(s.error_code()), others,
                mine, gpus);
  }
  pb::SnapshotResponse snaps;
  s = [&] {
    grpc::ClientContext ctx;
    return stub.Snapshot(&ctx, pb::SnapshotRequest(), &snaps);
  }();
  others = 0;
  for (const auto& snap : snaps.snapshots()) others += snap.session_id() == theirs ? 1 : 0;
  std::printf("snapshot_all=%d others=%d\n", static_cast<int>(s.error_code()), others);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) return 2;
  const std::string mode = argv[1];
  RemoteOptions options;
  options.address = argv[2];
  options.reconnect = false;
  options.deadline = std::chrono::milliseconds(2000);
  RemoteGovernor gov(options);
  if (mode == "register-exit") {
    auto info = gov.Register(TinyRegistration(argv[3]));
    if (!info.ok()) {
      std::printf("register=%s %s\n", CodeName(info.status()), info.status().message().c_str());
      return 1;
    }
    std::printf("session=%s\n", info->session_id.c_str());
    return 0;
  }
  if (mode == "register-hold" && argc >= 5) {
    bgl::gov::Registration reg = TinyRegistration(argv[3]);
    reg.gpu_index = std::atoi(argv[4]);
    reg.gpu_uuid = std::string("host-") + argv[4];
    auto info = gov.Register(reg);
    if (!info.ok()) {
      std::printf("register=%s %s\n", CodeName(info.status()), info.status().message().c_str());
      return 1;
    }
    std::printf("session=%s grant=%lld\n", info->session_id.c_str(),
                static_cast<long long>(info->host_grant_bytes));
    std::fflush(stdout);
    std::this_thread::sleep_for(std::chrono::seconds(120));
    return 0;
  }
  if (mode == "watch" && argc >= 5) {
    const int n = std::atoi(argv[3]);
    std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
    std::vector<std::unique_ptr<grpc::ClientReader<bagualu::v1::WatchResponse>>> readers;
    for (int i = 0; i < n; ++i) {
      contexts.push_back(std::make_unique<grpc::ClientContext>());
      bagualu::v1::WatchRequest req;
      req.set_interval_ms(50);
      readers.push_back(gov.stub().Watch(contexts.back().get(), req));
      bagualu::v1::WatchResponse first;
      if (readers.back()->Read(&first)) {
        std::printf("watch=OK\n");
      } else {
        grpc::Status s = readers.back()->Finish();
        std::printf("watch=%d %s\n", static_cast<int>(s.error_code()), s.error_message().c_str());
        readers.pop_back();
        contexts.pop_back();
      }
      std::fflush(stdout);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(argv[4])));
    for (auto& c : contexts) c->TryCancel();
    for (auto& r : readers) r->Finish();
    return 0;
  }
  if (mode == "own" && argc >= 5) {
    const std::string id = RegisterAndUse(gov.stub(), argv[3]);
    if (id.empty()) return 1;
    std::printf("session=%s\n", id.c_str());
    std::fflush(stdout);
    for (int i = 0; i < 3000 && !std::filesystem::exists(argv[4]); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    // After the intruder: the session is whole and still this process's to use.
    pb::PlanRequest plan;
    plan.set_session_id(id);
    plan.set_forward_micro_batch(1);
    plan.set_load_factor(1.2);
    pb::PlanResponse planned;
    Call("after_plan", [&](grpc::ClientContext& c) { return gov.stub().Plan(&c, plan, &planned); });
    pb::SnapshotRequest snap;
    snap.set_session_id(id);
    pb::SnapshotResponse snapped;
    Call("after_snapshot",
         [&](grpc::ClientContext& c) { return gov.stub().Snapshot(&c, snap, &snapped); });
    std::printf("after_snapshot_json=%s\n",
                snapped.snapshots_size() == 1
                    ? snapped.snapshots(0).allocator_snapshot_json().c_str()
                    : "(none)");
    Survey(gov.stub(), "");
    pb::UnregisterRequest end;
    end.set_session_id(id);
    pb::UnregisterResponse ended;
    Call("after_unregister",
         [&](grpc::ClientContext& c) { return gov.stub().Unregister(&c, end, &ended); });
    return 0;
  }
  if (mode == "intrude-all" && argc >= 5) {
    const std::string victim = argv[3];
    pb::Governor::Stub& stub = gov.stub();
    Survey(stub, victim);
    pb::PlanRequest plan;
    plan.set_session_id(victim);
    plan.set_forward_micro_batch(1);
    plan.set_load_factor(1.2);
    pb::PlanResponse planned;
    Call("plan", [&](grpc::ClientContext& c) { return stub.Plan(&c, plan, &planned); });
    pb::PlanRequest gate;
    gate.set_session_id(victim);
    gate.mutable_gate()->set_observed_load_factor(2.0);
    Call("plan_gate", [&](grpc::ClientContext& c) { return stub.Plan(&c, gate, &planned); });
    pb::ReportRequest report;
    report.set_session_id(victim);
    report.set_actual_bytes(1);
    report.set_allocator_snapshot_json("{\"forged\": true}");
    pb::ReportResponse reported;
    Call("report", [&](grpc::ClientContext& c) { return stub.Report(&c, report, &reported); });
    pb::SnapshotRequest snap;
    snap.set_session_id(victim);
    pb::SnapshotResponse snapped;
    Call("snapshot", [&](grpc::ClientContext& c) { return stub.Snapshot(&c, snap, &snapped); });
    std::printf("snapshot_rows=%d\n", snapped.snapshots_size());
    pb::UnregisterRequest end;
    end.set_session_id(victim);
    pb::UnregisterResponse ended;
    Call("unregister", [&](grpc::ClientContext& c) { return stub.Unregister(&c, end, &ended); });
    // A made-up id is unknown (NOT_FOUND), not someone else's.
    end.set_session_id("0123456789abcdef0123456789abcdef");
    Call("unregister_unknown",
         [&](grpc::ClientContext& c) { return stub.Unregister(&c, end, &ended); });
    // Its own session works as usual, and surveys show it alone.
    const std::string own = RegisterAndUse(stub, argv[4]);
    Survey(stub, victim);
    pb::UnregisterRequest own_end;
    own_end.set_session_id(own);
    Call("own_unregister",
         [&](grpc::ClientContext& c) { return stub.Unregister(&c, own_end, &ended); });
    return 0;
  }
  if (mode == "intrude" && argc >= 5) {
    const std::string victim = argv[3];
    // Talk to the daemon with the raw stub: the handle is someone else's daemon id.
    auto list = gov.ListSessions();
    int seen = 0;
    if (list.ok()) {
      for (const auto& s : list->sessions()) seen += s.session_id() == victim ? 1 : 0;
    }
    std::printf("list=%s seen=%d\n", CodeName(list.ok() ? bgl::OkStatus() : list.status()), seen);
    auto call = [&](const char* name, auto&& fn) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
      grpc::Status s = fn(ctx);
      std::printf("%s=%d\n", name, static_cast<int>(s.error_code()));
    };
    call("plan", [&](grpc::ClientContext& ctx) {
      bagualu::v1::PlanRequest req;
      req.set_session_id(victim);
      req.set_forward_micro_batch(1);
      bagualu::v1::PlanResponse resp;
      return gov.stub().Plan(&ctx, req, &resp);
    });
    call("report", [&](grpc::ClientContext& ctx) {
      bagualu::v1::ReportRequest req;
      req.set_session_id(victim);
      bagualu::v1::ReportResponse resp;
      return gov.stub().Report(&ctx, req, &resp);
    });
    call("snapshot", [&](grpc::ClientContext& ctx) {
      bagualu::v1::SnapshotRequest req;
      req.set_session_id(victim);
      bagualu::v1::SnapshotResponse resp;
      return gov.stub().Snapshot(&ctx, req, &resp);
    });
    call("unregister", [&](grpc::ClientContext& ctx) {
      bagualu::v1::UnregisterRequest req;
      req.set_session_id(victim);
      bagualu::v1::UnregisterResponse resp;
      return gov.stub().Unregister(&ctx, req, &resp);
    });
    auto own = gov.Register(TinyRegistration(argv[4]));
    std::printf("own_register=%s\n", CodeName(own.ok() ? bgl::OkStatus() : own.status()));
    return 0;
  }
  return 2;
}
