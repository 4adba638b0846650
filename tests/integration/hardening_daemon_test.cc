// The daemon under abuse that needs the real binary: Watch streams limited per uid and in
// total (each holds a server thread) and a drain that does not hang on open streams; errors that
// quote megabytes of request content arrive as INVALID_ARGUMENT naming the field; an empty
// configuration file on SIGHUP is refused.
#include <gtest/gtest.h>
#include <pwd.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "governor/client/remote_governor.h"
#include "tests/integration/daemon_process.h"

namespace bgl::gov {
namespace {

namespace pb = bagualu::v1;
using testing::DaemonProcess;

bool WaitFor(const std::function<bool()>& cond, int ms = 10000) {
  for (int i = 0; i < ms / 10; ++i) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return cond();
}

RemoteOptions Options(const DaemonProcess& d) {
  RemoteOptions o;
  o.address = d.address();
  o.deadline = std::chrono::milliseconds(2000);
  o.reconnect = false;
  return o;
}

// One open Watch stream (its first sample received, or refused).
struct Stream {
  std::unique_ptr<grpc::ClientContext> ctx = std::make_unique<grpc::ClientContext>();
  std::unique_ptr<grpc::ClientReader<pb::WatchResponse>> reader;
  grpc::Status status;  // set when refused
  bool open = false;
};

Stream OpenWatch(RemoteGovernor& gov, int interval_ms = 50) {
  Stream s;
  pb::WatchRequest req;
  req.set_interval_ms(interval_ms);
  s.reader = gov.stub().Watch(s.ctx.get(), req);
  pb::WatchResponse first;
  s.open = s.reader->Read(&first);
  if (!s.open) s.status = s.reader->Finish();
  return s;
}

void Close(Stream& s) {
  if (!s.open) return;
  s.ctx->TryCancel();
  s.reader->Finish();
  s.open = false;
}

TEST(HardeningDaemon, WatchStreamsAreLimitedPerUidAndInTotal) {
  DaemonProcess daemon(
      {"--max-watch-streams", "3", "--max-watch-streams-per-uid", "2", "--socket-mode", "0666"});
  ASSERT_TRUE(daemon.Start()) << testing::ReadFile(daemon.dir() + "/daemon.log");
  RemoteGovernor gov(Options(daemon));
  const int threads_idle = daemon.Threads();
  std::vector<Stream> mine;
  for (int i = 0; i < 2; ++i) {
    mine.push_back(OpenWatch(gov));
    ASSERT_TRUE(mine.back().open) << mine.back().status.error_message();
  }
  Stream third = OpenWatch(gov);
  ASSERT_FALSE(third.open);
  EXPECT_EQ(third.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(third.status.error_message().rfind("max_watch_streams_per_uid: ", 0), 0u)
      << third.status.error_message();

  if (geteuid() == 0) {
    // Another uid gets the one slot left of the total, and no more.
    const passwd* nobody = getpwnam("nobody");
    ASSERT_NE(nobody, nullptr);
    std::string out;
    ASSERT_EQ(
        testing::RunProgram({BGL_PROBE, "watch", daemon.address(), "2", "0"}, &out,
                            static_cast<int>(nobody->pw_uid), static_cast<int>(nobody->pw_gid)),
        0)
        << out;
    EXPECT_NE(out.find("watch=OK\n"), std::string::npos) << out;
    EXPECT_NE(out.find("watch=8 max_watch_streams: "), std::string::npos) << out;  // 8: EXHAUSTED
  }

  // Many more attempts are refused at once and do not pile up threads in the daemon.
  std::vector<Stream> refused;
  for (int i = 0; i < 200; ++i) {
    refused.push_back(OpenWatch(gov));
    ASSERT_FALSE(refused.back().open);
  }
  const int threads_refused = daemon.Threads();
  std::printf("daemon threads: %d idle, %d with 2 streams open and 200 refused\n", threads_idle,
              threads_refused);
  EXPECT_LT(threads_refused, threads_idle + 40);
  // Other callers are served meanwhile.
  EXPECT_TRUE(gov.Health().ok());
  EXPECT_TRUE(gov.ListSessions().ok());

  // A closed stream frees its slot.
  Close(mine[0]);
  EXPECT_TRUE(WaitFor([&] {
    Stream again = OpenWatch(gov);
    const bool ok = again.open;
    Close(again);
    return ok;
  }));
  for (auto& s : mine) Close(s);
}

TEST(HardeningDaemon, DrainEndsOpenWatchStreamsEvenUnread) {
  DaemonProcess daemon({"--max-watch-streams", "64", "--max-watch-streams-per-uid", "64"});
  ASSERT_TRUE(daemon.Start()) << testing::ReadFile(daemon.dir() + "/daemon.log");
  RemoteGovernor gov(Options(daemon));
  // Streams that are read, and streams never read after their first sample (their samples
  // fill the flow-control window and the daemon's writes block).
  std::vector<Stream> streams;
  for (int i = 0; i < 40; ++i) {
    streams.push_back(OpenWatch(gov, 10));
    ASSERT_TRUE(streams.back().open) << i << ": " << streams.back().status.error_message();
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  // The drain deadline is 1 s (DaemonProcess); 30 s means it hung.
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(daemon.StopWithin(30000), 0) << testing::ReadFile(daemon.dir() + "/daemon.log");
  std::printf("stop with 40 open streams took %.2f s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  for (auto& s : streams) {
    s.ctx->TryCancel();
    pb::WatchResponse r;
    while (s.reader->Read(&r)) {
    }
    s.reader->Finish();
  }
}

TEST(HardeningDaemon, HugeQuotedValuesInErrorsAreCutAndTheFieldNamed) {
  DaemonProcess daemon;
  ASSERT_TRUE(daemon.Start()) << testing::ReadFile(daemon.dir() + "/daemon.log");
  RemoteGovernor gov(Options(daemon));
  std::string model = testing::TinyModelJson();
  const size_t brace = model.find('{');
  ASSERT_NE(brace, std::string::npos);
  for (size_t key_bytes : {size_t{100}, size_t{20000}, size_t{1} << 20}) {
    pb::RegisterRequest req;
    req.set_gpu_uuid("host-0");
    req.set_capacity_bytes(int64_t{8} << 30);
    req.set_model_json(model.substr(0, brace + 1) + "\"" + std::string(key_bytes, 'k') + "\": 1, " +
                       model.substr(brace + 1));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    pb::RegisterResponse resp;
    grpc::Status s = gov.stub().Register(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << key_bytes << ": " << s.error_message().substr(0, 200);
    EXPECT_EQ(s.error_message().rfind("model_json", 0), 0u) << s.error_message().substr(0, 200);
    EXPECT_LE(s.error_message().size(), 1024u) << s.error_message().substr(0, 200);
  }
  EXPECT_TRUE(gov.Health().ok());
  EXPECT_EQ(daemon.Stop(), 0);
}

TEST(HardeningDaemon, EmptyConfigOnSighupIsRefused) {
  char tmpl[] = "/tmp/bgl-gov-cfg-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const std::string config = dir + "/governor.yaml";
  std::ofstream(config) << "max_sessions_per_uid: 1\n";
  DaemonProcess daemon({"--config", config});
  ASSERT_TRUE(daemon.Start()) << testing::ReadFile(daemon.dir() + "/daemon.log");
  RemoteGovernor gov(Options(daemon));
  Registration reg;
  reg.gpu_uuid = "host-0";
  reg.model_json = testing::TinyModelJson();
  reg.capacity_bytes = int64_t{8} << 30;
  ASSERT_TRUE(gov.Register(reg).ok());
  const std::string log = daemon.dir() + "/daemon.log";
  int refusals = 0;
  for (const char* text : {"", "# only a comment\n\n"}) {
    std::ofstream(config, std::ios::trunc) << text;
    daemon.Signal(SIGHUP);
    ++refusals;
    ASSERT_TRUE(WaitFor([&] {
      const std::string l = testing::ReadFile(log);
      size_t n = 0;
      for (size_t at = l.find("is empty"); at != std::string::npos;
           at = l.find("is empty", at + 1)) {
        ++n;
      }
      return static_cast<int>(n) >= refusals;
    })) << testing::ReadFile(log);
    // The old limit (1 session per uid) still holds.
    auto second = gov.Register(reg);
    ASSERT_FALSE(second.ok());
    EXPECT_EQ(second.status().code(), StatusCode::kResourceExhausted) << second.status().message();
  }
  EXPECT_TRUE(gov.Health().ok());
  EXPECT_EQ(daemon.Stop(), 0);
  // At start an empty file is refused too (exit 2), with the same message.
  std::string out;
  EXPECT_EQ(testing::RunProgram({BGL_GOVERNORD, "--config", config, "--listen",
                                 "unix://" + dir + "/g.sock", "--metrics-port", "0"},
                                &out),
            2);
  (void)std::system(("rm -rf '" + dir + "'").c_str());
}

}  // namespace
}  // namespace bgl::gov
