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

namespace pb = bagualu::v1;
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

  // Another uid: AnotherUserCannotReadChangeOrEndASessionThroughAnyRpc.
}

// The value of `key=` in a probe's output: the rest of that line ("" when absent).
std::string Line(const std::string& out, const std::string& key) {
  const std::string text = "\n" + out;
  const size_t at = text.find("\n" + key + "=");
  if (at == std::string::npos) return "";
  const size_t from = at + key.size() + 2;
  return text.substr(from, text.find('\n', from) - from);
}

// Issue 45 item 4: a second uid cannot read, change or end another uid's session through any
// RPC of the Governor service (Register, Plan with and without a gate, Report, Unregister,
// ListSessions, Watch, Snapshot by id and of all), each refusal PERMISSION_DENIED naming the
// session id and nothing else of it; the owner keeps using it; root reads it but cannot change
// it. Two unprivileged uids: the owner (nobody, 65534) and the intruder (bgl-test-other).
TEST(GovernorDaemon, AnotherUserCannotReadChangeOrEndASessionThroughAnyRpc) {
  if (geteuid() != 0) {
    GTEST_SKIP() << "needs root: the test runs its two clients under two other uids (setuid)";
  }
  (void)std::system("id bgl-test-other >/dev/null 2>&1 || useradd -M -r bgl-test-other");
  const struct passwd* other = getpwnam("bgl-test-other");
  ASSERT_NE(other, nullptr) << "useradd bgl-test-other failed";
  const int intruder_uid = static_cast<int>(other->pw_uid);
  const int intruder_gid = static_cast<int>(other->pw_gid);
  constexpr int kOwnerUid = 65534;
  DaemonProcess daemon({"--socket-mode", "0666"});
  ASSERT_TRUE(daemon.Start());
  RemoteGovernor root(Options(daemon));
  auto root_session = root.Register(TinyRegistration());  // a third user's (root's) session
  ASSERT_TRUE(root_session.ok());
  const std::string model = std::string(BGL_MODELS_DIR) + "/tiny-moe.json";
  const std::string done = daemon.dir() + "/intruder-done";

  std::string owner_out;
  int owner_rc = -1;
  std::thread owner([&] {
    owner_rc = testing::RunProgram({BGL_PROBE, "own", daemon.address(), model, done}, &owner_out,
                                   kOwnerUid, kOwnerUid);
  });
  // Root (privileged reader) finds the owner's session and its reported snapshot.
  std::string victim;
  const bool found = WaitFor([&] {
    auto snaps = root.Snapshot("");
    auto list = root.ListSessions();
    if (!snaps.ok() || !list.ok()) return false;
    for (const auto& s : list->sessions()) {
      if (s.uid() != static_cast<uint32_t>(kOwnerUid)) continue;
      for (const auto& snap : snaps->snapshots()) {
        if (snap.session_id() == s.session_id()) victim = s.session_id();
      }
    }
    return !victim.empty();
  });
  if (!found) {
    std::ofstream(done).put('\n');
    owner.join();
  }
  ASSERT_TRUE(found) << owner_out;

  std::string out;
  const int rc = testing::RunProgram({BGL_PROBE, "intrude-all", daemon.address(), victim, model},
                                     &out, intruder_uid, intruder_gid);
  // Root may read the owner's session but not change or end it (only its process may).
  auto snap = root.Snapshot(victim);
  pb::PlanRequest plan;
  plan.set_session_id(victim);
  plan.set_forward_micro_batch(2);
  plan.set_load_factor(1.2);
  pb::PlanResponse planned;
  grpc::ClientContext ctx;
  const grpc::Status root_plan = root.stub().Plan(&ctx, plan, &planned);
  std::ofstream(done).put('\n');
  owner.join();
  ASSERT_EQ(rc, 0) << out;
  ASSERT_EQ(owner_rc, 0) << owner_out;

  // Every call on the owner's session: PERMISSION_DENIED naming it, nothing else of it.
  for (const char* call : {"plan", "plan_gate", "report", "snapshot", "unregister"}) {
    const std::string line = Line(out, call);
    EXPECT_EQ(line.rfind("7 ", 0), 0u) << call << ": " << line;
    EXPECT_NE(line.find("session_id: '" + victim + "' belongs to another user"), std::string::npos)
        << call << ": " << line;
    EXPECT_EQ(line.find("65534"), std::string::npos) << call << ": " << line;
    EXPECT_EQ(line.find("probe-job"), std::string::npos) << call << ": " << line;
    EXPECT_EQ(line.find("nobody"), std::string::npos) << call << ": " << line;
  }
  EXPECT_EQ(Line(out, "snapshot_rows"), "0") << out;
  EXPECT_EQ(Line(out, "unregister_unknown").rfind("5 ", 0), 0u) << out;  // NOT_FOUND
  // Its surveys (before and after registering its own session) show none of the other users'
  // sessions, snapshots, GPUs or grants; its own session works.
  EXPECT_NE(out.find("list=0 others=0 mine=0\nwatch=0 others=0 mine=0 gpus=0\n"
                     "snapshot_all=0 others=0"),
            std::string::npos)
      << out;
  EXPECT_EQ(Line(out, "own_register").rfind("0 ", 0), 0u) << out;
  EXPECT_EQ(Line(out, "own_plan").rfind("0 ", 0), 0u) << out;
  EXPECT_EQ(Line(out, "own_report").rfind("0 ", 0), 0u) << out;
  EXPECT_NE(out.find("list=0 others=0 mine=1\nwatch=0 others=0 mine=1 gpus=1\n"
                     "snapshot_all=0 others=0"),
            std::string::npos)
      << out;
  EXPECT_EQ(Line(out, "own_unregister").rfind("0 ", 0), 0u) << out;

  // The owner's session is whole: its plans, its snapshot (not the forged one), its end; it
  // too sees only its own session (not root's).
  EXPECT_EQ(Line(owner_out, "after_plan").rfind("0 ", 0), 0u) << owner_out;
  EXPECT_EQ(Line(owner_out, "after_snapshot").rfind("0 ", 0), 0u) << owner_out;
  EXPECT_EQ(Line(owner_out, "after_snapshot_json"), "{\"segments\": []}") << owner_out;
  EXPECT_NE(owner_out.find("list=0 others=0 mine=1\nwatch=0 others=0 mine=1 gpus=1"),
            std::string::npos)
      << owner_out;
  EXPECT_EQ(Line(owner_out, "after_unregister").rfind("0 ", 0), 0u) << owner_out;

  // Root read it (privileged reader) but could not plan on it.
  ASSERT_TRUE(snap.ok());
  ASSERT_EQ(snap->snapshots_size(), 1);
  EXPECT_EQ(snap->snapshots(0).allocator_snapshot_json(), "{\"segments\": []}");
  EXPECT_EQ(root_plan.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_NE(root_plan.error_message().find("another user's process"), std::string::npos)
      << root_plan.error_message();
  EXPECT_TRUE(root.Plan(root_session->session_id, Forward(0)).ok());
}

// The daemon's own uid (the service user, as which bglctl and bgl-top run) reads every user's
// sessions, as root and the admin group do, but changes or ends none of them.
TEST(GovernorDaemon, TheDaemonsOwnUidReadsEverySessionAndChangesNone) {
  if (geteuid() != 0) {
    GTEST_SKIP() << "needs root: the daemon and its two clients run under other uids (setuid)";
  }
  (void)std::system("id bgl-test-other >/dev/null 2>&1 || useradd -M -r bgl-test-other");
  const struct passwd* other = getpwnam("bgl-test-other");
  ASSERT_NE(other, nullptr) << "useradd bgl-test-other failed";
  constexpr int kDaemonUid = 65534;
  DaemonProcess daemon({"--socket-mode", "0666"});
  daemon.RunAs(kDaemonUid, kDaemonUid);
  ASSERT_TRUE(daemon.Start());
  const std::string model = std::string(BGL_MODELS_DIR) + "/tiny-moe.json";
  const std::string done = daemon.dir() + "/reader-done";
  std::string owner_out;
  std::thread owner([&] {
    testing::RunProgram({BGL_PROBE, "own", daemon.address(), model, done}, &owner_out,
                        static_cast<int>(other->pw_uid), static_cast<int>(other->pw_gid));
  });
  RemoteGovernor root(Options(daemon));
  std::string victim;
  const bool found = WaitFor([&] {
    auto list = root.ListSessions();
    if (list.ok() && list->sessions_size() == 1) victim = list->sessions(0).session_id();
    return !victim.empty();
  });
  std::string out;
  if (found) {
    testing::RunProgram({BGL_PROBE, "intrude-all", daemon.address(), victim, model}, &out,
                        kDaemonUid, kDaemonUid);
  }
  std::ofstream(done).put('\n');
  owner.join();
  ASSERT_TRUE(found) << owner_out;
  EXPECT_NE(out.find("list=0 others=1 mine=0\nwatch=0 others=1 mine=0 gpus=1\n"), std::string::npos)
      << out;
  EXPECT_EQ(Line(out, "snapshot").rfind("0 ", 0), 0u) << out;
  EXPECT_EQ(Line(out, "snapshot_rows"), "1") << out;
  for (const char* call : {"plan", "plan_gate", "report", "unregister"}) {
    const std::string line = Line(out, call);
    EXPECT_EQ(line.rfind("7 ", 0), 0u) << call << ": " << line;
    EXPECT_NE(line.find("belongs to another user's process"), std::string::npos) << line;
  }
  EXPECT_EQ(Line(owner_out, "after_plan").rfind("0 ", 0), 0u) << owner_out;
  EXPECT_EQ(Line(owner_out, "after_unregister").rfind("0 ", 0), 0u) << owner_out;
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
