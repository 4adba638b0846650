// governor_probe: a separate client process for the integration tests (another pid, and under
// setuid another uid). Modes:
//   register-exit ADDR MODEL_FILE          registers and exits without unregistering
//   intrude ADDR SESSION_ID MODEL_FILE     tries to read and change someone else's session
//   register-hold ADDR MODEL_FILE GPU      registers on GPU index GPU, then sleeps (to be killed)
//   watch ADDR N HOLD_MS                   opens N Watch streams, prints each one's status
//                                          (OK once its first sample arrived), holds them
#include <cstdio>
#include <cstdlib>
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
