// Issue 14 against the real daemon on the host backend: the node's pinned host budget shared as
// grants among 4-8 sessions (rebalanced on register, unregister and the SIGKILL of a client),
// plans within their grants, bandwidth shared by the sessions of one host link, and bad node
// settings or requests refused with the field named while the daemon keeps serving.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "governor/client/remote_governor.h"
#include "tests/integration/daemon_process.h"

namespace bgl::gov {
namespace {

namespace pb = bagualu::v1;
using testing::DaemonProcess;

constexpr int64_t kMiB = int64_t{1} << 20;

RemoteOptions Options(const DaemonProcess& d) {
  RemoteOptions o;
  o.address = d.address();
  o.deadline = std::chrono::milliseconds(2000);
  return o;
}

bool WaitFor(const std::function<bool()>& cond, int ms = 8000) {
  for (int i = 0; i < ms / 20; ++i) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return cond();
}

// A calibration under which offloading is the cheap mitigation of the tiny model: slow compute
// (recompute is expensive, and the forward hides the copies) and slow FP8 casts.
pb::RegisterRequest Request(int gpu, int64_t host_request = 0) {
  pb::RegisterRequest req;
  req.set_gpu_uuid("host-" + std::to_string(gpu));
  req.set_gpu_index(gpu);
  req.set_job_id("node-test");
  req.set_capacity_bytes(int64_t{1} << 30);
  req.set_model_json(testing::TinyModelJson());
  req.set_budget_step_bytes(4 * kMiB);
  req.set_host_request_bytes(host_request);
  req.mutable_calibration()->set_peak_tflops(2);
  req.mutable_calibration()->mutable_fp8_cast()->set_peak_gbps(1);
  return req;
}

class Client {
 public:
  explicit Client(const DaemonProcess& d) : gov_(Options(d)) {}

  grpc::Status Register(const pb::RegisterRequest& req, pb::RegisterResponse* resp) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    return gov_.stub().Register(&ctx, req, resp);
  }
  grpc::Status Plan(const std::string& id, int mb, int64_t bytes_in_use, pb::PlanResponse* resp) {
    pb::PlanRequest req;
    req.set_session_id(id);
    req.set_forward_micro_batch(mb);
    req.set_load_factor(1.2);
    if (bytes_in_use >= 0) req.set_bytes_in_use(bytes_in_use);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    return gov_.stub().Plan(&ctx, req, resp);
  }
  grpc::Status Unregister(const std::string& id) {
    pb::UnregisterRequest req;
    req.set_session_id(id);
    pb::UnregisterResponse resp;
    grpc::ClientContext ctx;
    return gov_.stub().Unregister(&ctx, req, &resp);
  }
  // session id -> grant, from ListSessions.
  std::map<std::string, int64_t> Grants() {
    std::map<std::string, int64_t> out;
    auto list = gov_.ListSessions();
    if (!list.ok()) return out;
    for (const auto& s : list->sessions()) out[s.session_id()] = s.host_grant_bytes();
    return out;
  }

 private:
  RemoteGovernor gov_;
};

int64_t Sum(const std::map<std::string, int64_t>& grants) {
  int64_t sum = 0;
  for (const auto& [id, g] : grants) sum += g;
  return sum;
}

// Bytes retained now that leave a small budget: the planner has to mitigate.
constexpr int64_t kPressure = 560 * kMiB;

TEST(NodeDaemon, GrantsShareTheBudgetRebalanceAndBoundEveryPlan) {
  const int64_t budget = 512 * kMiB, floor = 32 * kMiB;
  DaemonProcess daemon({"--host-budget-bytes", "512MiB", "--host-floor-bytes", "32MiB",
                        "--node-max-sessions", "8", "--node-gpus", "8", "--links", "0,1;2,3",
                        "--reap-interval-ms", "100"});
  ASSERT_TRUE(daemon.Start()) << testing::ReadFile(daemon.dir() + "/daemon.log");
  Client client(daemon);
  std::vector<std::string> ids;
  std::vector<int64_t> previous;
  auto check = [&](const char* when) {
    const auto grants = client.Grants();
    EXPECT_LE(Sum(grants), budget) << when;
    for (const auto& [id, g] : grants) EXPECT_GE(g, floor) << when << " " << id;
    return grants;
  };
  // Six sessions, one asking for little: it gets what it asked, the others share the rest.
  for (int gpu = 0; gpu < 6; ++gpu) {
    pb::RegisterResponse resp;
    ASSERT_TRUE(client.Register(Request(gpu, gpu == 5 ? 40 * kMiB : 0), &resp).ok());
    ids.push_back(resp.session_id());
    EXPECT_GT(resp.host_grant_bytes(), 0);
    check("register");
  }
  auto grants = check("six");
  EXPECT_EQ(grants[ids[5]], 40 * kMiB);
  EXPECT_NEAR(grants[ids[0]], (budget - 40 * kMiB) / 5, 1);
  EXPECT_EQ(Sum(grants), budget);

  // Every plan's host bytes stay within the grant it carries.
  int offloading_plans = 0;
  for (int mb = 0; mb < 4; ++mb) {
    for (const std::string& id : ids) {
      pb::PlanResponse resp;
      ASSERT_TRUE(client.Plan(id, mb, mb == 0 ? kPressure : -1, &resp).ok());
      EXPECT_GT(resp.host_grant_bytes(), 0);
      EXPECT_EQ(resp.host_grant_bytes(), client.Grants()[id]);
      EXPECT_LE(resp.plan().host_bytes(), resp.host_grant_bytes()) << id << " mb " << mb;
      offloading_plans += resp.plan().host_bytes() > 0 ? 1 : 0;
    }
  }
  std::printf("plans that offload: %d of %zu\n", offloading_plans, 4 * ids.size());
  // What a worker reports its offloads hold is what ListSessions (and bgl-top) show as used.
  {
    RemoteGovernor gov(Options(daemon));
    pb::ReportRequest report;
    report.set_session_id(ids[0]);
    report.set_micro_batch(3);
    report.set_actual_bytes(1 << 20);
    report.mutable_stats()->set_allocated_bytes(1 << 20);
    report.mutable_stats()->set_host_used_bytes(12345678);
    pb::ReportResponse reported;
    grpc::ClientContext ctx;
    ASSERT_TRUE(gov.stub().Report(&ctx, report, &reported).ok());
    auto list = gov.ListSessions();
    ASSERT_TRUE(list.ok());
    bool found = false;
    for (const auto& s : list->sessions()) {
      if (s.session_id() == ids[0]) {
        found = true;
        EXPECT_EQ(s.host_used_bytes(), 12345678);
        EXPECT_EQ(s.link(), 0);  // GPU 0 is on link 0
      }
    }
    EXPECT_TRUE(found);
  }
  EXPECT_GT(offloading_plans, 0) << "the scenario must offload";

  // A seventh session (another process, killed later) takes its share from the others.
  const pid_t probe = fork();
  if (probe == 0) {
    execl(BGL_PROBE, BGL_PROBE, "register-hold", daemon.address().c_str(),
          (std::string(BGL_MODELS_DIR) + "/tiny-moe.json").c_str(), "6", nullptr);
    _exit(127);
  }
  ASSERT_TRUE(WaitFor([&] { return client.Grants().size() == 7; }));
  grants = check("seven");
  EXPECT_NEAR(grants[ids[0]], (budget - 40 * kMiB) / 6, 1);
  // SIGKILL: the reaper returns its grant.
  kill(probe, SIGKILL);
  waitpid(probe, nullptr, 0);
  ASSERT_TRUE(WaitFor([&] { return client.Grants().size() == 6; }));
  grants = check("reaped");
  EXPECT_NEAR(grants[ids[0]], (budget - 40 * kMiB) / 5, 1);

  // Unregister: the others grow.
  ASSERT_TRUE(client.Unregister(ids[4]).ok());
  grants = check("unregistered");
  EXPECT_EQ(grants.size(), 5u);
  EXPECT_NEAR(grants[ids[0]], (budget - 40 * kMiB) / 4, 1);
  EXPECT_EQ(Sum(grants), budget);
  // A plan after the rebalance carries the new grant.
  pb::PlanResponse resp;
  ASSERT_TRUE(client.Plan(ids[0], 4, -1, &resp).ok());
  EXPECT_NEAR(resp.host_grant_bytes(), (budget - 40 * kMiB) / 4, 1);

  // The metrics carry the grants and the links' offloading sessions.
  EXPECT_EQ(daemon.Stop(), 0);
}

// A grant below what a session would offload binds: its plans stay within it and mitigate with
// recompute/FP8 instead.
TEST(NodeDaemon, SmallGrantsPlanMoreRecompute) {
  DaemonProcess daemon(
      {"--host-budget-bytes", "64MiB", "--host-floor-bytes", "8MiB", "--node-max-sessions", "8"});
  ASSERT_TRUE(daemon.Start()) << testing::ReadFile(daemon.dir() + "/daemon.log");
  Client client(daemon);
  auto plan_first = [&](int gpu, pb::PlanResponse* out) {
    pb::RegisterResponse reg;
    ASSERT_TRUE(client.Register(Request(gpu), &reg).ok());
    ASSERT_TRUE(client.Plan(reg.session_id(), 0, kPressure, out).ok());
  };
  pb::PlanResponse alone;
  plan_first(0, &alone);
  EXPECT_EQ(alone.host_grant_bytes(), 64 * kMiB);
  EXPECT_LE(alone.plan().host_bytes(), 64 * kMiB);
  for (int gpu = 1; gpu < 7; ++gpu) {
    pb::PlanResponse ignored;
    plan_first(gpu, &ignored);
  }
  pb::PlanResponse crowded;
  plan_first(7, &crowded);
  EXPECT_EQ(crowded.host_grant_bytes(), 8 * kMiB);
  EXPECT_LE(crowded.plan().host_bytes(), 8 * kMiB);
  std::printf("host bytes alone %lld (grant 64 MiB), among 8 %lld (grant 8 MiB)\n",
              static_cast<long long>(alone.plan().host_bytes()),
              static_cast<long long>(crowded.plan().host_bytes()));
  // The scenario must put more on host alone than the crowded grant allows, or nothing binds.
  ASSERT_GT(alone.plan().host_bytes(), 8 * kMiB);
  int offloaded_alone = 0, offloaded_crowded = 0;
  for (int s : alone.plan().strategies()) offloaded_alone += s == pb::STRATEGY_OFFLOAD;
  for (int s : crowded.plan().strategies()) offloaded_crowded += s == pb::STRATEGY_OFFLOAD;
  EXPECT_LT(offloaded_crowded, offloaded_alone);
  EXPECT_LE(crowded.plan().predicted_bytes(), crowded.plan().budget_bytes());
  EXPECT_EQ(daemon.Stop(), 0);
}

// Sums the copy items' durations of a plan by (chain, first, last) tensor range.
std::map<std::tuple<int, int, int>, double> CopyItems(const pb::Plan& plan) {
  std::map<std::tuple<int, int, int>, double> out;
  for (const auto& item : plan.issue_order()) {
    if (item.resource() == pb::RESOURCE_D2H || item.resource() == pb::RESOURCE_H2D) {
      out[{item.chain(), item.first(), item.last()}] += item.duration_s();
    }
  }
  return out;
}

TEST(NodeDaemon, SessionsOnOneLinkShareItsBandwidth) {
  DaemonProcess daemon({"--host-budget-bytes", "4GiB", "--host-floor-bytes", "64MiB",
                        "--node-max-sessions", "8", "--node-gpus", "8", "--links", "0,1;2,3"});
  ASSERT_TRUE(daemon.Start()) << testing::ReadFile(daemon.dir() + "/daemon.log");
  Client client(daemon);
  // GPUs 0 and 1 share link 0; GPUs 4 and 5 are links of their own.
  std::map<int, std::string> ids;
  for (int gpu : {0, 1, 4, 5}) {
    pb::RegisterResponse resp;
    ASSERT_TRUE(client.Register(Request(gpu), &resp).ok());
    ids[gpu] = resp.session_id();
  }
  // Round 1: every session plans its first forward under pressure and starts offloading.
  std::map<int, pb::PlanResponse> first, second;
  for (int gpu : {0, 1, 4, 5}) {
    ASSERT_TRUE(client.Plan(ids[gpu], 0, kPressure, &first[gpu]).ok());
    ASSERT_GT(first[gpu].plan().host_bytes(), 0) << "gpu " << gpu << ": the scenario must offload";
  }
  // GPU 0 planned alone; GPU 1 planned while GPU 0 offloaded on the same link.
  EXPECT_EQ(first[0].bandwidth_share(), 1.0);
  EXPECT_EQ(first[1].bandwidth_share(), 0.5);
  EXPECT_EQ(first[4].bandwidth_share(), 1.0);
  EXPECT_EQ(first[5].bandwidth_share(), 1.0);
  // Round 2: the second forward also runs the first one's offloads (chain O).
  for (int gpu : {0, 1, 4, 5}) {
    ASSERT_TRUE(client.Plan(ids[gpu], 1, -1, &second[gpu]).ok());
  }
  EXPECT_EQ(second[0].bandwidth_share(), 0.5);
  EXPECT_EQ(second[1].bandwidth_share(), 0.5);
  EXPECT_EQ(second[0].plan().bandwidth_share(), 0.5);
  EXPECT_EQ(second[4].bandwidth_share(), 1.0);
  EXPECT_EQ(second[5].bandwidth_share(), 1.0);
  EXPECT_EQ(second[4].plan().bandwidth_share(), 1.0);
  // The same copies take twice as long on the shared link.
  const auto shared = CopyItems(second[1].plan());
  const auto alone = CopyItems(second[5].plan());
  int matched = 0;
  for (const auto& [key, seconds] : shared) {
    auto it = alone.find(key);
    if (it == alone.end()) continue;
    ++matched;
    EXPECT_NEAR(seconds / it->second, 2.0, 0.05);
  }
  EXPECT_GT(matched, 0) << "no copy in common between the shared and the lone session";
  EXPECT_GE(second[1].plan().serial_s(), second[5].plan().serial_s());
  std::printf("copy items matched %d; serial %.6f s shared vs %.6f s alone\n", matched,
              second[1].plan().serial_s(), second[5].plan().serial_s());

  // Watch reports the links' load.
  RemoteGovernor gov(Options(daemon));
  pb::WatchRequest wreq;
  wreq.set_interval_ms(50);
  wreq.set_max_samples(1);
  pb::WatchResponse sample;
  ASSERT_TRUE(gov.Watch(wreq,
                        [&](const pb::WatchResponse& r) {
                          sample = r;
                          return true;
                        })
                  .ok());
  EXPECT_EQ(sample.host_budget_bytes(), int64_t{4} << 30);
  bool link0 = false;
  for (const auto& l : sample.links()) {
    if (l.link() == 0) {
      link0 = true;
      EXPECT_EQ(l.sessions(), 2);
      EXPECT_EQ(l.offloading_sessions(), 2);
    }
  }
  EXPECT_TRUE(link0);
  EXPECT_EQ(daemon.Stop(), 0);
}

// Runs the daemon with `flags` expecting it to refuse them; returns what it printed.
std::string Refused(const std::string& flags, int* status) {
  std::string out;
  *status = testing::RunProgram(
      {"/bin/sh", "-c",
       std::string(BGL_GOVERNORD) + " --listen unix:///tmp/bgl-node-refused-" +
           std::to_string(getpid()) + ".sock --metrics-port 0 " + flags + " 2>&1"},
      &out);
  return out;
}

TEST(NodeDaemon, BadNodeSettingsAreRefusedNamingTheField) {
  int status = 0;
  std::string out = Refused(
      "--host-budget-bytes 1GiB --host-floor-bytes 256MiB "
      "--node-max-sessions 8",
      &status);
  EXPECT_EQ(status, 2) << out;
  EXPECT_NE(out.find("host_budget_bytes"), std::string::npos) << out;
  out = Refused("--links '0,1;1,2'", &status);
  EXPECT_EQ(status, 2) << out;
  EXPECT_NE(out.find("links: GPU 1 is in more than one link"), std::string::npos) << out;
  out = Refused("--node-gpus 4 --links '0,1;2,9'", &status);
  EXPECT_EQ(status, 2) << out;
  EXPECT_NE(out.find("links: links[1] names GPU 9, which is not on this node"), std::string::npos)
      << out;
  out = Refused("--links '0,x'", &status);
  EXPECT_EQ(status, 2) << out;
  EXPECT_NE(out.find("links"), std::string::npos) << out;
  // The YAML spelling: a list of lists, and a list of maps.
  char tmpl[] = "/tmp/bgl-node-config-XXXXXX";
  const int fd = mkstemp(tmpl);
  ASSERT_GE(fd, 0);
  close(fd);
  {
    FILE* f = std::fopen(tmpl, "w");
    std::fputs("links:\n  - gpus: [0, 1]\n    peak_gbps: 25\n  - [1, 2]\n", f);
    std::fclose(f);
  }
  out = Refused(std::string("--config ") + tmpl, &status);
  EXPECT_EQ(status, 2) << out;
  EXPECT_NE(out.find("links: GPU 1 is in more than one link"), std::string::npos) << out;
  {
    FILE* f = std::fopen(tmpl, "w");
    std::fputs("links:\n  - {gpus: [0, 1], peek_gbps: 25}\n", f);
    std::fclose(f);
  }
  out = Refused(std::string("--config ") + tmpl, &status);
  EXPECT_EQ(status, 2) << out;
  EXPECT_NE(out.find("unknown key 'peek_gbps'"), std::string::npos) << out;
  unlink(tmpl);
}

TEST(NodeDaemon, RequestsOverTheBudgetAreRefusedAndOthersKeepBeingServed) {
  DaemonProcess daemon(
      {"--host-budget-bytes", "256MiB", "--host-floor-bytes", "32MiB", "--node-max-sessions", "4"});
  ASSERT_TRUE(daemon.Start()) << testing::ReadFile(daemon.dir() + "/daemon.log");
  Client client(daemon);
  pb::RegisterResponse ok;
  ASSERT_TRUE(client.Register(Request(0), &ok).ok());
  EXPECT_EQ(ok.host_grant_bytes(), 256 * kMiB);
  pb::RegisterResponse bad;
  grpc::Status s = client.Register(Request(1, 257 * kMiB), &bad);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("host_request_bytes"), std::string::npos) << s.error_message();
  s = client.Register(Request(1, -1), &bad);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("host_request_bytes"), std::string::npos) << s.error_message();
  // The node holds four sessions at the floor: the fifth is refused, naming the field.
  for (int gpu = 1; gpu < 4; ++gpu) {
    pb::RegisterResponse resp;
    ASSERT_TRUE(client.Register(Request(gpu), &resp).ok());
  }
  s = client.Register(Request(4), &bad);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(s.error_message().find("host_request_bytes"), std::string::npos) << s.error_message();
  // The first session is still served, with its grant unchanged by the refusals.
  pb::PlanResponse plan;
  ASSERT_TRUE(client.Plan(ok.session_id(), 0, -1, &plan).ok());
  EXPECT_EQ(plan.host_grant_bytes(), 64 * kMiB);
  EXPECT_EQ(Sum(client.Grants()), 256 * kMiB);
  EXPECT_EQ(daemon.Stop(), 0);
}

}  // namespace
}  // namespace bgl::gov
