// bgl-top and bglctl against the real bgl-governord: the daemon starts on a temporary socket
// with the shipped sample config, two sessions register through the gRPC stub (tiny-moe, 2 GiB)
// and report usage, then the tools' outputs are checked. Also: both tools fail clearly (exit 1,
// naming the address) once the daemon is gone.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bagualu/v1/governor.grpc.pb.h"
#include "tools/bgl-top/watch_feed.h"
#include "tools/bglctl/governor_address.h"

namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

std::string ReadAll(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Runs a shell command, returning its exit status and combined output.
int RunShell(const std::string& command, std::string* output) {
  output->clear();
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return -1;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) output->append(buf, n);
  const int status = pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

int CountLinesWith(const std::string& text, const std::string& needle) {
  int count = 0;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) count += line.find(needle) != std::string::npos;
  return count;
}

// The daemon on a temporary socket, started from deploy/config/governord.yaml with the
// settings that need root or a fixed port overridden.
class Daemon {
 public:
  Daemon() {
    char tmpl[] = "/tmp/bgltools.XXXXXX";
    dir_ = mkdtemp(tmpl);
    address_ = "unix://" + dir_ + "/governor.sock";
  }
  ~Daemon() {
    Stop();
    std::string ignored;
    RunShell("rm -rf '" + dir_ + "'", &ignored);
  }

  bool Start() {
    const std::string log = dir_ + "/daemon.log";
    pid_ = fork();
    if (pid_ == 0) {
      const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(fd, 1);
      dup2(fd, 2);
      unsetenv("NOTIFY_SOCKET");
      execl(BGL_GOVERNORD, BGL_GOVERNORD, "--config", BGL_SAMPLE_CONFIG, "--listen",
            address_.c_str(), "--metrics-port", "0", "--socket-group", "", "--admin-group", "",
            static_cast<char*>(nullptr));
      _exit(127);
    }
    // Wait for the socket file, then for an answer (bounded by attempts, not a timing
    // assertion). Dialling before the socket exists would put the channel into reconnect
    // backoff.
    const std::string path = dir_ + "/governor.sock";
    for (int attempt = 0; attempt < 600; ++attempt) {
      struct stat st {};
      if (stat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) break;
      if (waitpid(pid_, nullptr, WNOHANG) == pid_) {
        pid_ = -1;
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    auto stub = bagualu::v1::Governor::NewStub(channel());
    for (int attempt = 0; attempt < 10; ++attempt) {
      grpc::ClientContext ctx;
      ctx.set_wait_for_ready(true);
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
      bagualu::v1::ListSessionsResponse resp;
      if (stub->ListSessions(&ctx, {}, &resp).ok()) return true;
      if (waitpid(pid_, nullptr, WNOHANG) == pid_) {
        pid_ = -1;
        return false;
      }
    }
    return false;
  }

  void Stop() {
    if (pid_ <= 0) return;
    kill(pid_, SIGTERM);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  std::shared_ptr<grpc::Channel> channel() const {
    return grpc::CreateChannel(address_, grpc::InsecureChannelCredentials());
  }
  const std::string& address() const { return address_; }
  std::string log() const { return ReadAll(dir_ + "/daemon.log"); }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::string address_;
  pid_t pid_ = -1;
};

class ToolsAgainstDaemon : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(daemon_.Start()) << daemon_.log();
    stub_ = bagualu::v1::Governor::NewStub(daemon_.channel());
    const std::string model = ReadAll(std::string(BGL_MODELS_DIR) + "/tiny-moe.json");
    ASSERT_FALSE(model.empty());
    for (int i = 0; i < 2; ++i) {
      bagualu::v1::RegisterRequest req;
      req.set_gpu_uuid("GPU-test-" + std::to_string(i));
      req.set_gpu_index(i);
      req.set_pid(getpid());
      req.set_job_id(i == 0 ? "job-alpha" : "job-beta");
      req.set_pipeline_rank(i);
      req.set_capacity_bytes(2 * kGiB);
      req.set_model_json(model);
      bagualu::v1::RegisterResponse resp;
      grpc::ClientContext ctx;
      const grpc::Status st = stub_->Register(&ctx, req, &resp);
      ASSERT_TRUE(st.ok()) << st.error_message();
      sessions_.push_back(resp.session_id());
    }
    for (int i = 0; i < 2; ++i) {
      bagualu::v1::PlanRequest plan;
      plan.set_session_id(sessions_[i]);
      plan.set_phase(bagualu::v1::PHASE_WARMUP);
      plan.set_forward_micro_batch(0);
      plan.set_load_factor(i == 0 ? 1.0 : 2.6);
      bagualu::v1::PlanResponse plan_resp;
      grpc::ClientContext plan_ctx;
      const grpc::Status plan_st = stub_->Plan(&plan_ctx, plan, &plan_resp);
      ASSERT_TRUE(plan_st.ok()) << plan_st.error_message();

      bagualu::v1::ReportRequest report;
      report.set_session_id(sessions_[i]);
      report.set_micro_batch(0);
      report.set_actual_bytes((i + 1) * 256 * (int64_t{1} << 20));
      report.mutable_stats()->set_allocated_bytes((i + 1) * 300 * (int64_t{1} << 20));
      report.mutable_stats()->set_reserved_bytes((i + 1) * 400 * (int64_t{1} << 20));
      report.mutable_stats()->set_peak_allocated_bytes((i + 1) * 350 * (int64_t{1} << 20));
      report.mutable_stats()->set_ooms_avoided(i + 1);
      if (i == 0) report.set_allocator_snapshot_json(R"({"segments": [], "device_traces": []})");
      bagualu::v1::ReportResponse report_resp;
      grpc::ClientContext report_ctx;
      const grpc::Status report_st = stub_->Report(&report_ctx, report, &report_resp);
      ASSERT_TRUE(report_st.ok()) << report_st.error_message();
    }
  }

  std::string Top(const std::string& flags) const {
    return std::string(BGL_TOP) + " --governor " + daemon_.address() + " " + flags;
  }
  std::string Ctl(const std::string& flags) const {
    return std::string(BGL_CTL) + " --governor " + daemon_.address() + " " + flags;
  }

  Daemon daemon_;
  std::unique_ptr<bagualu::v1::Governor::Stub> stub_;
  std::vector<std::string> sessions_;
};

TEST_F(ToolsAgainstDaemon, TopOnceShowsTwoGpuBarsAndTwoProcessRows) {
  std::string out;
  ASSERT_EQ(RunShell(Top("--once --width 120"), &out), 0) << out;
  const std::string pid = " " + std::to_string(getpid()) + " ";
  EXPECT_EQ(CountLinesWith(out, pid), 2) << out;
  EXPECT_EQ(CountLinesWith(out, "job-alpha"), 1) << out;
  EXPECT_EQ(CountLinesWith(out, "job-beta"), 1) << out;
  EXPECT_EQ(CountLinesWith(out, " mem  ["), 2) << out;
  EXPECT_EQ(CountLinesWith(out, " hist ["), 2) << out;
  EXPECT_NE(out.find("GPU 0 GPU-test-0"), std::string::npos) << out;
  EXPECT_NE(out.find("GPU 1 GPU-test-1"), std::string::npos) << out;
  EXPECT_NE(out.find("capacity 2.00 GiB"), std::string::npos) << out;
  EXPECT_NE(out.find("2 GPUs, 2 processes"), std::string::npos) << out;
  EXPECT_NE(out.find(daemon_.address()), std::string::npos) << out;
  // Sorted by memory: the second session (more bytes in use) comes first.
  EXPECT_LT(out.find("job-beta"), out.find("job-alpha")) << out;
  ASSERT_EQ(RunShell(Top("--once --width 120 --sort job"), &out), 0) << out;
  EXPECT_LT(out.find("job-alpha"), out.find("job-beta")) << out;
}

TEST_F(ToolsAgainstDaemon, TopJsonCarriesTheFrame) {
  std::string out;
  ASSERT_EQ(RunShell(Top("--json --sort pid"), &out), 0) << out;
  const auto json = nlohmann::json::parse(out, nullptr, false);
  ASSERT_FALSE(json.is_discarded()) << out;
  ASSERT_EQ(json["gpus"].size(), 2u) << out;
  ASSERT_EQ(json["processes"].size(), 2u) << out;
  for (const auto& gpu : json["gpus"]) EXPECT_EQ(gpu["capacity_bytes"], 2 * kGiB) << out;
  for (const auto& p : json["processes"]) {
    EXPECT_EQ(p["pid"], getpid());
    EXPECT_GT(p["in_use_bytes"].get<int64_t>(), 0) << out;
  }
}

TEST_F(ToolsAgainstDaemon, CtlHealthSessionsSnapshot) {
  std::string out;
  EXPECT_EQ(RunShell(Ctl("health"), &out), 0) << out;
  EXPECT_NE(out.find("SERVING"), std::string::npos) << out;
  EXPECT_EQ(RunShell(Ctl("health --service bagualu.v1.Governor"), &out), 0) << out;
  EXPECT_EQ(RunShell(Ctl("health --service no.such.Service"), &out), 1) << out;

  ASSERT_EQ(RunShell(Ctl("sessions"), &out), 0) << out;
  EXPECT_NE(out.find(sessions_[0]), std::string::npos) << out;
  EXPECT_NE(out.find(sessions_[1]), std::string::npos) << out;
  ASSERT_EQ(RunShell(Ctl("sessions --json"), &out), 0) << out;
  const auto json = nlohmann::json::parse(out, nullptr, false);
  ASSERT_FALSE(json.is_discarded()) << out;
  EXPECT_EQ(json["sessions"].size(), 2u) << out;

  const std::string file = daemon_.dir() + "/snap.json";
  ASSERT_EQ(RunShell(Ctl("snapshot --session " + sessions_[0] + " --out " + file), &out), 0) << out;
  const auto snap = nlohmann::json::parse(ReadAll(file), nullptr, false);
  ASSERT_FALSE(snap.is_discarded());
  EXPECT_TRUE(snap.contains("segments"));
  ASSERT_EQ(RunShell(Ctl("snapshot"), &out), 0) << out;
  EXPECT_NE(out.find(sessions_[0]), std::string::npos) << out;
}

TEST_F(ToolsAgainstDaemon, CtlPlan) {
  std::string out;
  // Another process's session: the daemon lets only its owner plan.
  EXPECT_EQ(RunShell(Ctl("plan --session " + sessions_[0] + " --forward 1"), &out), 1) << out;
  EXPECT_NE(out.find("PERMISSION_DENIED"), std::string::npos) << out;
  // A throwaway session of a model file: registered, planned, ended.
  const std::string model = std::string(BGL_MODELS_DIR) + "/tiny-moe.json";
  ASSERT_EQ(RunShell(Ctl("plan --model " + model + " --capacity 2GiB --forward 0"), &out), 0)
      << out;
  EXPECT_NE(out.find("budget"), std::string::npos) << out;
  ASSERT_EQ(RunShell(Ctl("plan --model " + model + " --capacity 2GiB --forward 0 --json"), &out), 0)
      << out;
  const auto plan = nlohmann::json::parse(out, nullptr, false);
  ASSERT_FALSE(plan.is_discarded()) << out;
  EXPECT_TRUE(plan.contains("budget_bytes")) << out;
  // The daemon checks the probe's budget step and names the field.
  const std::string probe = "plan --model " + model + " --capacity 2GiB --forward 0";
  EXPECT_EQ(RunShell(Ctl(probe + " --budget-step 1KiB"), &out), 1) << out;
  EXPECT_NE(out.find("budget_step_bytes"), std::string::npos) << out;
  ASSERT_EQ(RunShell(Ctl(probe + " --budget-step 1MiB"), &out), 0) << out;
  ASSERT_EQ(RunShell(Ctl("sessions --json"), &out), 0) << out;
  EXPECT_EQ(nlohmann::json::parse(out)["sessions"].size(), 2u) << out;  // the probe is gone
}

// bglctl sessions shows the warm-up's figures (issue 43): WARM-KEYS and WARM-HITS for a session
// that asked for the warm-up (RegisterRequest.warm_up) as of its latest plan, '-' for the others;
// --json carries Session.warm_up.
TEST_F(ToolsAgainstDaemon, CtlSessionsShowsTheWarmUp) {
  bagualu::v1::RegisterRequest req;
  req.set_gpu_uuid("GPU-test-warm");
  req.set_gpu_index(2);
  req.set_pid(getpid());
  req.set_job_id("job-warm");
  req.set_capacity_bytes(2 * kGiB);
  req.set_model_json(ReadAll(std::string(BGL_MODELS_DIR) + "/tiny-moe.json"));
  req.mutable_warm_up()->set_spike_bound(1.5);
  bagualu::v1::RegisterResponse registered;
  {
    grpc::ClientContext ctx;
    const grpc::Status st = stub_->Register(&ctx, req, &registered);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  bagualu::v1::PlanRequest plan;
  plan.set_session_id(registered.session_id());
  plan.set_phase(bagualu::v1::PHASE_WARMUP);
  plan.set_forward_micro_batch(0);
  plan.set_load_factor(1.0);
  bagualu::v1::PlanResponse planned;
  {
    grpc::ClientContext ctx;
    const grpc::Status st = stub_->Plan(&ctx, plan, &planned);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  std::string out;
  ASSERT_EQ(RunShell(Ctl("sessions"), &out), 0) << out;
  EXPECT_NE(out.find("WARM-KEYS"), std::string::npos) << out;
  EXPECT_NE(out.find("WARM-HITS"), std::string::npos) << out;
  std::istringstream lines(out);
  int warm_rows = 0, cold_rows = 0;
  for (std::string line; std::getline(lines, line);) {
    std::istringstream fields(line);
    std::vector<std::string> f;
    for (std::string x; fields >> x;) f.push_back(x);
    if (f.size() < 2) continue;
    const std::string& keys = f[f.size() - 2];
    const std::string& hits = f[f.size() - 1];
    if (line.find(registered.session_id()) != std::string::npos) {
      ++warm_rows;
      EXPECT_TRUE(!keys.empty() && std::isdigit(static_cast<unsigned char>(keys[0]))) << line;
      EXPECT_TRUE(!hits.empty() && std::isdigit(static_cast<unsigned char>(hits[0]))) << line;
    } else if (line.find(sessions_[0]) != std::string::npos ||
               line.find(sessions_[1]) != std::string::npos) {
      ++cold_rows;
      EXPECT_EQ(keys, "-") << line;
      EXPECT_EQ(hits, "-") << line;
    }
  }
  EXPECT_EQ(warm_rows, 1) << out;
  EXPECT_EQ(cold_rows, 2) << out;
  ASSERT_EQ(RunShell(Ctl("sessions --json"), &out), 0) << out;
  const auto json = nlohmann::json::parse(out, nullptr, false);
  ASSERT_FALSE(json.is_discarded()) << out;
  int with_warm_up = 0;
  for (const auto& s : json["sessions"]) {
    if (!s.contains("warm_up")) continue;
    ++with_warm_up;
    EXPECT_EQ(s["session_id"], registered.session_id()) << out;
  }
  EXPECT_EQ(with_warm_up, 1) << out;
}

TEST_F(ToolsAgainstDaemon, ToolsFailClearlyWhenTheDaemonIsGone) {
  // Close our idle connection first: with it open the daemon's drain runs to its deadline.
  stub_.reset();
  daemon_.Stop();
  std::string out;
  EXPECT_EQ(RunShell(Top("--once --timeout 2"), &out), 1) << out;
  EXPECT_NE(out.find(daemon_.address()), std::string::npos) << out;
  EXPECT_EQ(RunShell(Ctl("--timeout 2 health"), &out), 1) << out;
  EXPECT_NE(out.find(daemon_.address()), std::string::npos) << out;
  EXPECT_EQ(RunShell(Ctl("--timeout 2 sessions"), &out), 1) << out;
}

// The interactive dashboard's feed survives a daemon restart: it reports the outage, then
// reconnects on its own and streams again.
TEST(WatchFeedAgainstDaemon, ReconnectsAfterRestart) {
  Daemon daemon;
  ASSERT_TRUE(daemon.Start()) << daemon.log();
  // Polls `done` every 20 ms, at most `attempts` times (a bound, not a timing assertion).
  auto eventually = [](auto done, int attempts) {
    for (int i = 0; i < attempts; ++i) {
      if (done()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return done();
  };
  bgl::top::WatchFeed feed(bgl::tools::OpenGovernorChannel(daemon.address()), daemon.address(), 50);
  size_t frames = 0;
  ASSERT_TRUE(eventually([&] { return (frames += feed.Drain().size()) >= 2; }, 500));
  daemon.Stop();
  ASSERT_TRUE(eventually([&] { return !feed.Problem().empty(); }, 1000));
  EXPECT_NE(feed.Problem().find(daemon.address()), std::string::npos) << feed.Problem();
  (void)feed.Drain();
  ASSERT_TRUE(daemon.Start()) << daemon.log();
  frames = 0;
  EXPECT_TRUE(eventually([&] { return (frames += feed.Drain().size()) >= 2; }, 1500));
  EXPECT_TRUE(feed.Problem().empty()) << feed.Problem();
}

}  // namespace
