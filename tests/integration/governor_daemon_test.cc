// End-to-end tests of bgl-governord: the real daemon binary on a temporary socket, driven by the
// real clients (and by a separate probe process, under another uid when running as root).
#include <gtest/gtest.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <thread>

#include "governor/client/remote_governor.h"
#include "tests/integration/daemon_process.h"

namespace bgl::gov {
namespace {

using testing::DaemonProcess;
using testing::TinyModelJson;

Registration TinyRegistration() {
  Registration reg;
  reg.gpu_uuid = "host-0";
  reg.job_id = "test-job";
  reg.model_json = TinyModelJson();
  reg.capacity_bytes = int64_t{8} << 30;
  return reg;
}

RemoteOptions Options(const DaemonProcess& d) {
  RemoteOptions o;
  o.address = d.address();
  o.deadline = std::chrono::milliseconds(500);  // generous: sanitizer builds are slow
  return o;
}

plan::SchedulePoint Forward(int mb) {
  plan::SchedulePoint p;
  p.forward_micro_batch = mb;
  p.load_factor = 1.2;
  return p;
}

bool WaitFor(const std::function<bool()>& cond, int ms = 5000) {
  for (int i = 0; i < ms / 10; ++i) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return cond();
}

TEST(GovernorDaemon, SocketModeAndRoundTrips) {
  DaemonProcess daemon;
  ASSERT_TRUE(daemon.Start()) << testing::ReadFile(daemon.dir() + "/daemon.log");
  struct stat st {};
  ASSERT_EQ(stat((daemon.dir() + "/governor.sock").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660u);

  RemoteGovernor gov(Options(daemon));
  EXPECT_TRUE(gov.Health().ok());
  auto info = gov.Register(TinyRegistration());
  ASSERT_TRUE(info.ok()) << info.status().message();
  EXPECT_EQ(info->micro_batches, 8);
  EXPECT_FALSE(info->operator_names.empty());

  auto plan = gov.Plan(info->session_id, Forward(0));
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  EXPECT_EQ(plan->micro_batch, 0);
  EXPECT_EQ(plan->strategies.size(), info->operator_names.size());
  EXPECT_FALSE(plan->issue_order.empty());

  Consumption used;
  used.micro_batch = 0;
  used.actual_bytes = plan->predicted_bytes;
  used.has_stats = true;
  used.stats.set_allocated_bytes(123456);
  used.stats.set_ooms_avoided(2);
  used.allocator_snapshot_json = R"({"segments": [], "device_traces": []})";
  ASSERT_TRUE(gov.Report(info->session_id, used).ok());

  auto list = gov.ListSessions();
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->sessions_size(), 1);
  EXPECT_EQ(list->sessions(0).pid(), getpid());
  EXPECT_EQ(list->sessions(0).uid(), getuid());
  EXPECT_EQ(list->sessions(0).job_id(), "test-job");

  bagualu::v1::WatchRequest watch;
  watch.set_interval_ms(10);
  watch.set_max_samples(3);
  int samples = 0;
  ASSERT_TRUE(gov.Watch(watch,
                        [&](const bagualu::v1::WatchResponse& r) {
                          ++samples;
                          EXPECT_EQ(r.gpus_size(), 1);
                          if (r.gpus_size() == 1) {
                            EXPECT_EQ(r.gpus(0).in_use_bytes(), 123456);
                            EXPECT_EQ(r.gpus(0).ooms_avoided(), 2);
                            EXPECT_EQ(r.gpus(0).processes(0).plans(), 1u);
                          }
                          return true;
                        })
                  .ok());
  EXPECT_EQ(samples, 3);

  auto snap = gov.Snapshot("");
  ASSERT_TRUE(snap.ok());
  ASSERT_EQ(snap->snapshots_size(), 1);
  EXPECT_NE(snap->snapshots(0).allocator_snapshot_json().find("segments"), std::string::npos);

  // A bad request names its field and leaves the session working.
  plan::SchedulePoint bad = Forward(99);
  auto rejected = gov.Plan(info->session_id, bad);
  ASSERT_FALSE(rejected.ok());
  EXPECT_EQ(rejected.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(rejected.status().message().find("forward_micro_batch"), std::string::npos);
  Registration huge = TinyRegistration();
  huge.model_json.assign(size_t{5} << 20, ' ');
  auto too_big = gov.Register(huge);
  ASSERT_FALSE(too_big.ok());
  EXPECT_EQ(too_big.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(too_big.status().message().find("model_json"), std::string::npos);
  EXPECT_TRUE(gov.Plan(info->session_id, Forward(1)).ok());

  ASSERT_TRUE(gov.Unregister(info->session_id).ok());
  EXPECT_EQ(gov.ListSessions()->sessions_size(), 0);
  EXPECT_EQ(daemon.Stop(), 0);
}

TEST(GovernorDaemon, ManyClientsAtOnce) {
  DaemonProcess daemon;
  ASSERT_TRUE(daemon.Start());
  constexpr int kClients = 6;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      RemoteGovernor gov(Options(daemon));
      Registration reg = TinyRegistration();
      reg.gpu_uuid = "host-" + std::to_string(c % 2);
      reg.gpu_index = c % 2;
      auto info = gov.Register(reg);
      if (!info.ok()) {
        failures++;
        return;
      }
      for (int it = 0; it < 20; ++it) {
        for (int mb = 0; mb < 4; ++mb) {
          if (!gov.Plan(info->session_id, Forward(mb)).ok()) failures++;
        }
      }
      if (!gov.Unregister(info->session_id).ok()) failures++;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  RemoteGovernor gov(Options(daemon));
  EXPECT_EQ(gov.ListSessions()->sessions_size(), 0);
}

TEST(GovernorDaemon, OtherProcessesCannotTouchASession) {
  const bool root = geteuid() == 0;
  DaemonProcess daemon({"--socket-mode", "0666"});
  ASSERT_TRUE(daemon.Start());
  RemoteGovernor gov(Options(daemon));
  auto info = gov.Register(TinyRegistration());
  ASSERT_TRUE(info.ok());
  const std::string model = std::string(BGL_MODELS_DIR) + "/tiny-moe.json";

  // Same uid, another process: may read, may not change.
  std::string out;
  ASSERT_EQ(
      testing::RunProgram({BGL_PROBE, "intrude", daemon.address(), info->session_id, model}, &out),
      0)
      << out;
  EXPECT_NE(out.find("seen=1"), std::string::npos) << out;
  EXPECT_NE(out.find("plan=7"), std::string::npos) << out;  // PERMISSION_DENIED
  EXPECT_NE(out.find("report=7"), std::string::npos) << out;
  EXPECT_NE(out.find("unregister=7"), std::string::npos) << out;
  EXPECT_TRUE(gov.Plan(info->session_id, Forward(0)).ok());

  if (!root) GTEST_SKIP() << "the second-uid half needs root (to create a user and setuid)";
  (void)std::system("id bgl-test-other >/dev/null 2>&1 || useradd -M -r bgl-test-other");
  struct passwd* pw = getpwnam("bgl-test-other");
  ASSERT_NE(pw, nullptr);
  out.clear();
  ASSERT_EQ(testing::RunProgram({BGL_PROBE, "intrude", daemon.address(), info->session_id, model},
                                &out, static_cast<int>(pw->pw_uid), static_cast<int>(pw->pw_gid)),
            0)
      << out;
  EXPECT_NE(out.find("list=OK seen=0"), std::string::npos) << out;
  EXPECT_NE(out.find("plan=5"), std::string::npos) << out;  // NOT_FOUND: existence not disclosed
  EXPECT_NE(out.find("report=5"), std::string::npos) << out;
  EXPECT_NE(out.find("snapshot=5"), std::string::npos) << out;
  EXPECT_NE(out.find("unregister=5"), std::string::npos) << out;
  EXPECT_NE(out.find("own_register=OK"), std::string::npos) << out;
  // The first session is untouched; root (admin) sees the other user's session too.
  EXPECT_TRUE(gov.Plan(info->session_id, Forward(1)).ok());
  auto list = gov.ListSessions();
  ASSERT_TRUE(list.ok());
  bool other_seen = false;
  for (const auto& s : list->sessions()) other_seen |= s.uid() == pw->pw_uid;
  // The other user's probe exited, so its session may already be reaped: both are fine, but
  // the victim session must still be there.
  bool victim = false;
  for (const auto& s : list->sessions()) victim |= s.session_id() == info->session_id;
  EXPECT_TRUE(victim);
  (void)other_seen;
}

// While the daemon is gone the remote client fails fast (the caller, the Python package, plans
// in-process then); after a restart its background thread registers the session again under the
// same handle.
TEST(GovernorDaemon, KilledDaemonFailsFastAndTheSessionIsReRegistered) {
  DaemonProcess daemon;
  ASSERT_TRUE(daemon.Start());
  RemoteOptions options = Options(daemon);
  options.deadline = std::chrono::milliseconds(20);
  options.register_deadline = std::chrono::milliseconds(2000);
  options.max_backoff = std::chrono::milliseconds(100);
  RemoteGovernor gov(options);
  auto info = gov.Register(TinyRegistration());
  ASSERT_TRUE(info.ok());
  ASSERT_TRUE(WaitFor([&] { return gov.Plan(info->session_id, Forward(0)).ok(); }));

  daemon.Kill();
  // Failing fast, by what happens rather than by the clock: a call that reaches the dead
  // daemon's socket is refused (UNAVAILABLE; a 20 ms deadline may run out first on a loaded
  // machine, but then the next call is refused), which marks the daemon down; from then on
  // every call is answered in the client without an RPC ("reconnecting") until the background
  // thread gets the daemon back.
  int sent = 0;
  bool refused = false;
  for (int i = 0; i < 50; ++i) {
    auto plan = gov.Plan(info->session_id, Forward(i % 8));
    ASSERT_FALSE(plan.ok());
    const StatusCode code = plan.status().code();
    if (plan.status().message().find("daemon unavailable (reconnecting)") != std::string::npos) {
      EXPECT_EQ(code, StatusCode::kUnavailable);
      continue;
    }
    ++sent;
    EXPECT_FALSE(refused) << "call " << i << " went to the daemon after it was refused: "
                          << plan.status().message();
    EXPECT_EQ(code, StatusCode::kUnavailable) << plan.status().message();
    refused |= plan.status().message().find("Deadline Exceeded") == std::string::npos;
  }
  std::printf("daemon dead: %d of 50 calls sent, the rest answered in the client\n", sent);
  EXPECT_TRUE(refused) << "no call was refused by the dead daemon's socket";
  EXPECT_FALSE(gov.connected());

  ASSERT_TRUE(daemon.Start());  // same socket: the stale one is removed
  ASSERT_TRUE(WaitFor([&] { return gov.reregistrations() >= 1; }));
  ASSERT_TRUE(WaitFor([&] { return gov.Plan(info->session_id, Forward(1)).ok(); }));
  RemoteGovernor reader(Options(daemon));
  auto list = reader.ListSessions();
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->sessions_size(), 1);
}

TEST(GovernorDaemon, AbsentDaemonNeverBlocksAndIsAdoptedLater) {
  DaemonProcess daemon;  // not started yet
  RemoteOptions options = Options(daemon);
  options.deadline = std::chrono::milliseconds(20);
  options.max_backoff = std::chrono::milliseconds(100);
  RemoteGovernor gov(options);
  const std::string handle = gov.RegisterWhenAvailable(TinyRegistration());
  EXPECT_FALSE(gov.Plan(handle, Forward(0)).ok());
  ASSERT_TRUE(daemon.Start());
  ASSERT_TRUE(WaitFor([&] { return gov.Plan(handle, Forward(1)).ok(); }));
  EXPECT_FALSE(gov.DaemonSessionId(handle).empty());
}

TEST(GovernorDaemon, SighupReloadsLimits) {
  char tmpl[] = "/tmp/bgl-gov-cfg-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const std::string config = dir + "/governor.yaml";
  std::ofstream(config) << "max_sessions_per_uid: 1\nlog_level: debug\n";
  DaemonProcess daemon({"--config", config});
  ASSERT_TRUE(daemon.Start()) << testing::ReadFile(daemon.dir() + "/daemon.log");
  RemoteGovernor gov(Options(daemon));
  ASSERT_TRUE(gov.Register(TinyRegistration()).ok());
  auto second = gov.Register(TinyRegistration());
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(second.status().message().find("sessions"), std::string::npos);

  std::ofstream(config) << "max_sessions_per_uid: 3\n";
  daemon.Signal(SIGHUP);
  EXPECT_TRUE(WaitFor([&] { return gov.Register(TinyRegistration()).ok(); }))
      << testing::ReadFile(daemon.dir() + "/daemon.log");
  // A broken file is refused and the daemon keeps serving with the old settings.
  std::ofstream(config) << "max_sessions_per_uid: [oops\n";
  daemon.Signal(SIGHUP);
  // Serving after the refused reload, not before it: wait for the refusal in the log.
  EXPECT_TRUE(WaitFor(
      [&] {
        return testing::ReadFile(daemon.dir() + "/daemon.log").find("reload failed") !=
               std::string::npos;
      },
      30000))
      << testing::ReadFile(daemon.dir() + "/daemon.log");
  EXPECT_TRUE(gov.Health().ok());
  // The old limit (3) still holds: a fourth session is refused.
  EXPECT_TRUE(gov.Register(TinyRegistration()).ok());
  EXPECT_FALSE(gov.Register(TinyRegistration()).ok());
  EXPECT_EQ(daemon.Stop(), 0);
  (void)std::system(("rm -rf '" + dir + "'").c_str());
}

TEST(GovernorDaemon, ReapsSessionsOfExitedProcesses) {
  DaemonProcess daemon({"--reap-interval-ms", "50"});
  ASSERT_TRUE(daemon.Start());
  std::string out;
  ASSERT_EQ(testing::RunProgram({BGL_PROBE, "register-exit", daemon.address(),
                                 std::string(BGL_MODELS_DIR) + "/tiny-moe.json"},
                                &out),
            0)
      << out;
  ASSERT_NE(out.find("session=s-"), std::string::npos) << out;
  RemoteGovernor gov(Options(daemon));
  auto mine = gov.Register(TinyRegistration());
  ASSERT_TRUE(mine.ok());
  EXPECT_TRUE(WaitFor([&] {
    auto list = gov.ListSessions();
    return list.ok() && list->sessions_size() == 1;
  }));
  EXPECT_EQ(gov.ListSessions()->sessions(0).session_id(), mine->session_id);
}

TEST(GovernorDaemon, RefusesASecondDaemonOnALiveSocket) {
  DaemonProcess daemon;
  ASSERT_TRUE(daemon.Start());
  std::string out;
  EXPECT_EQ(testing::RunProgram(
                {BGL_GOVERNORD, "--listen", daemon.address(), "--metrics-port", "0"}, &out),
            1);
  RemoteGovernor gov(Options(daemon));
  EXPECT_TRUE(gov.Health().ok());
}

}  // namespace
}  // namespace bgl::gov
