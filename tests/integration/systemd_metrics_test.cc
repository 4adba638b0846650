// bgl-governord as systemd and Prometheus see it: the sd_notify protocol over a fake
// NOTIFY_SOCKET (READY, STATUS, watchdog pings, STOPPING on SIGTERM) and the metrics endpoint
// scraped over HTTP.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "governor/client/remote_governor.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/heavy_model.h"

namespace bgl::gov {
namespace {

using testing::DaemonProcess;

// A datagram socket standing in for systemd's notification socket.
class FakeNotifySocket {
 public:
  explicit FakeNotifySocket(const std::string& path) : path_(path) {
    fd_ = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    path.copy(addr.sun_path, sizeof(addr.sun_path) - 1);
    unlink(path.c_str());
    ok_ = fd_ >= 0 && bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  }
  ~FakeNotifySocket() {
    if (fd_ >= 0) close(fd_);
    unlink(path_.c_str());
  }
  bool ok() const { return ok_; }

  // Discards the messages already queued (sent before this call).
  void Drain() {
    char buf[4096];
    while (recv(fd_, buf, sizeof(buf), MSG_DONTWAIT) > 0) {
    }
  }

  // Every message received within `ms` until one contains `needle`; empty if none did.
  std::vector<std::string> ReceiveUntil(const std::string& needle, int ms) {
    std::vector<std::string> got;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    while (std::chrono::steady_clock::now() < deadline) {
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, 50) <= 0) continue;
      char buf[4096];
      const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
      if (n <= 0) continue;
      got.emplace_back(buf, static_cast<std::size_t>(n));
      if (got.back().find(needle) != std::string::npos) return got;
    }
    return {};
  }

 private:
  std::string path_;
  int fd_ = -1;
  bool ok_ = false;
};

// Sets environment variables for the daemon the test starts, and restores them.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (had_) {
      setenv(name_, old_.c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

// Waits until the daemon's planner is working on a plan, by its bagualu_plans_in_progress
// gauge (the bound only keeps a broken daemon from hanging the test). Keeps reading `notify`
// meanwhile: a full notification queue would block the daemon's sd_notify.
bool WaitForRunningPlan(const DaemonProcess& daemon, FakeNotifySocket* notify) {
  for (int i = 0; i < 600; ++i) {
    if (testing::MetricValue(daemon.ScrapeMetrics(), "bagualu_plans_in_progress") >= 1) {
      return true;
    }
    if (notify != nullptr) {
      notify->ReceiveUntil("never sent", 100);
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  return false;
}

TEST(GovernorSystemd, NotifiesReadyStatusWatchdogAndStopping) {
#ifndef BGL_HAVE_SYSTEMD
  GTEST_SKIP() << "bgl-governord was built without libsystemd";
#endif
  DaemonProcess daemon;
  FakeNotifySocket notify(daemon.dir() + "/notify.sock");
  ASSERT_TRUE(notify.ok());
  ScopedEnv socket_env("NOTIFY_SOCKET", daemon.dir() + "/notify.sock");
  ScopedEnv watchdog_env("WATCHDOG_USEC", "200000");  // a ping at least every 100 ms
  ASSERT_TRUE(daemon.Start());
  auto ready = notify.ReceiveUntil("READY=1", 5000);
  ASSERT_FALSE(ready.empty()) << "no READY=1 on NOTIFY_SOCKET";
  auto pings = notify.ReceiveUntil("WATCHDOG=1", 3000);
  EXPECT_FALSE(pings.empty()) << "no watchdog ping with WATCHDOG_USEC set";
  auto status = notify.ReceiveUntil("STATUS=serving", 3000);
  EXPECT_FALSE(status.empty()) << "no STATUS line";
  daemon.Signal(SIGTERM);
  auto stopping = notify.ReceiveUntil("STOPPING=1", 5000);
  EXPECT_FALSE(stopping.empty()) << "no STOPPING=1 after SIGTERM";
  EXPECT_EQ(daemon.Stop(), 0);
}

TEST(GovernorSystemd, WatchdogPingsContinueWhileAPlanRuns) {
#ifndef BGL_HAVE_SYSTEMD
  GTEST_SKIP() << "bgl-governord was built without libsystemd";
#endif
  // Issue 12 item 2: the housekeeping thread that pings the watchdog used to sample the sessions
  // under the lock a plan holds, so a long plan starved systemd's watchdog. The plan here runs
  // for minutes and only the drain ends it, so everything seen between its start (the daemon's
  // plans-in-progress gauge) and SIGTERM happened while it ran.
  DaemonProcess daemon({"--plan-timeout-ms", "600000"});
  FakeNotifySocket notify(daemon.dir() + "/notify.sock");
  ASSERT_TRUE(notify.ok());
  ScopedEnv socket_env("NOTIFY_SOCKET", daemon.dir() + "/notify.sock");
  ScopedEnv watchdog_env("WATCHDOG_USEC", "200000");  // a ping at least every 100 ms
  ASSERT_TRUE(daemon.StartWithMetrics()) << testing::ReadFile(daemon.dir() + "/daemon.log");
  ASSERT_FALSE(notify.ReceiveUntil("READY=1", 5000).empty());
  RemoteOptions options;
  options.address = daemon.address();
  options.deadline = std::chrono::seconds(120);
  RemoteGovernor gov(options);
  Registration heavy;
  heavy.model_json = testing::HeavyModelJson();
  heavy.capacity_bytes = int64_t{1} << 30;
  auto info = gov.Register(heavy);
  ASSERT_TRUE(info.ok()) << info.status().message();
  Result<plan::Plan> planned = Status();
  std::thread client([&] {
    plan::SchedulePoint point;
    point.forward_micro_batch = 0;
    planned = gov.Plan(info->session_id, point);
  });
  const bool running = WaitForRunningPlan(daemon, &notify);
  notify.Drain();  // what follows was sent after the plan started
  // A whole housekeeping round inside the plan: the publish (its STATUS line comes after the
  // sample and the gauges), then a watchdog ping after it. The bounds only end a hung test.
  const bool published = running && !notify.ReceiveUntil("STATUS=serving", 30000).empty();
  const bool pinged = published && !notify.ReceiveUntil("WATCHDOG=1", 30000).empty();
  const double in_progress =
      testing::MetricValue(daemon.ScrapeMetrics(), "bagualu_plans_in_progress");
  daemon.Signal(SIGTERM);
  const bool stopping = !notify.ReceiveUntil("STOPPING=1", 30000).empty();
  EXPECT_EQ(daemon.StopWithin(30000), 0) << testing::ReadFile(daemon.dir() + "/daemon.log");
  client.join();
  ASSERT_TRUE(running) << "the plan never started";
  EXPECT_TRUE(published) << "no publish (STATUS line) while a plan ran";
  EXPECT_TRUE(pinged) << "no watchdog ping after the publish while a plan ran";
  EXPECT_EQ(in_progress, 1) << "the plan ended before the check; the test proves nothing";
  EXPECT_TRUE(stopping) << "no STOPPING=1 after SIGTERM";
  EXPECT_FALSE(planned.ok()) << "the plan finished on its own instead of by the drain";
}

TEST(GovernorMetrics, ScrapedOverHttpWithSessionCounts) {
  DaemonProcess daemon;
  ASSERT_TRUE(daemon.StartWithMetrics()) << testing::ReadFile(daemon.dir() + "/daemon.log");
  const int port = daemon.metrics_port();
  RemoteOptions o;
  o.address = daemon.address();
  o.deadline = std::chrono::milliseconds(500);
  RemoteGovernor gov(o);
  Registration reg;
  reg.gpu_uuid = "host-0";
  reg.job_id = "metrics-test";
  reg.model_json = testing::TinyModelJson();
  reg.capacity_bytes = int64_t{8} << 30;
  auto info = gov.Register(reg);
  ASSERT_TRUE(info.ok()) << info.status().message();
  // The housekeeper publishes once a second (the bound only ends a hung test).
  std::string body;
  for (int i = 0; i < 300; ++i) {
    body = testing::HttpGet(port, "/metrics");
    if (body.find("bagualu_sessions 1") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_NE(body.find("200 OK"), std::string::npos) << body.substr(0, 300);
  EXPECT_NE(body.find("bagualu_sessions 1"), std::string::npos) << body.substr(0, 2000);
  EXPECT_NE(body.find("bagualu_"), std::string::npos);
  EXPECT_EQ(daemon.Stop(), 0);
}

}  // namespace
}  // namespace bgl::gov
