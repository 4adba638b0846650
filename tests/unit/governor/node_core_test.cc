// Issue 14 in the service without transport: GovernorCore with a NodeArbiter publishes grants,
// use and link load as gauges (and drops them with the session); the daemon's node settings
// (links in both spellings, defaults from /proc/meminfo and /sys) name the field on bad input.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "governor/daemon/config.h"
#include "governor/service/governor_core.h"
#include "tests/unit/governor/tiny_model.h"

namespace bgl::gov {
namespace {

namespace pb = bagualu::v1;

Caller Me() {
  Caller c;
  c.uid = getuid();
  c.pid = -1;
  c.user = "me";
  return c;
}

TEST(NodeCore, GrantsAndLinkLoadAreGaugesThatLeaveWithTheSession) {
  NodeConfig node;
  node.host_budget_bytes = int64_t{1} << 30;
  node.host_floor_bytes = int64_t{64} << 20;
  node.max_sessions = 4;
  node.links = {{{0, 1}, 0}};
  auto arbiter = NodeArbiter::Create(node);
  ASSERT_TRUE(arbiter.ok());
  Metrics metrics;
  GovernorCore core(&metrics, RequestLimits{}, std::move(arbiter).value());
  std::string ids[2];
  for (int gpu = 0; gpu < 2; ++gpu) {
    pb::RegisterRequest req;
    req.set_gpu_uuid("host-" + std::to_string(gpu));
    req.set_gpu_index(gpu);
    req.set_job_id("j");
    req.set_capacity_bytes(int64_t{1} << 30);
    req.set_model_json(testing::TinyModel());
    pb::RegisterResponse resp;
    ASSERT_TRUE(core.Register(Me(), req, &resp).ok());
    EXPECT_EQ(resp.host_grant_bytes(), (int64_t{1} << 30) / (gpu + 1));
    ids[gpu] = resp.session_id();
  }
  core.PublishMetrics();
  std::string text = metrics.Text();
  EXPECT_NE(text.find("bagualu_host_grant_bytes{"), std::string::npos) << text;
  EXPECT_NE(text.find("session=\"" + ids[1] + "\""), std::string::npos) << text;
  EXPECT_NE(text.find("bagualu_host_used_bytes{"), std::string::npos) << text;
  EXPECT_NE(text.find("bagualu_link_offload_sessions{link=\"0\"} 0"), std::string::npos) << text;
  pb::ListSessionsResponse list;
  ASSERT_TRUE(core.ListSessions(Me(), {}, &list).ok());
  ASSERT_EQ(list.sessions_size(), 2);
  EXPECT_EQ(list.sessions(0).host_grant_bytes(), int64_t{1} << 29);
  EXPECT_EQ(list.sessions(0).link(), 0);
  pb::UnregisterRequest un;
  un.set_session_id(ids[1]);
  pb::UnregisterResponse unresp;
  Caller owner = Me();
  ASSERT_TRUE(core.Unregister(owner, un, &unresp).ok());
  core.PublishMetrics();
  text = metrics.Text();
  EXPECT_EQ(text.find("session=\"" + ids[1] + "\""), std::string::npos) << text;
  EXPECT_EQ(core.HostGrants().size(), 1u);
  EXPECT_EQ(core.HostGrants()[0].second, int64_t{1} << 30);
}

// A session's reported pinned use above its shrunk grant holds the newcomer's grant back until
// the use comes back (NodeArbiter::SetUsed through Report).
// A node of 1 GiB of pinned host memory for at most 4 sessions, each granted at least 16 MiB.
NodeArbiter SmallNode() {
  NodeConfig node;
  node.host_budget_bytes = int64_t{1} << 30;
  node.host_floor_bytes = int64_t{16} << 20;
  node.max_sessions = 4;
  auto arbiter = NodeArbiter::Create(node);
  EXPECT_TRUE(arbiter.ok());
  return std::move(arbiter).value();
}

TEST(NodeCore, ReportedUseAboveAShrunkGrantHoldsTheNewcomerBack) {
  GovernorCore core(nullptr, RequestLimits{}, SmallNode());
  auto reg = [&](int gpu) {
    pb::RegisterRequest req;
    req.set_gpu_uuid("host-" + std::to_string(gpu));
    req.set_gpu_index(gpu);
    req.set_capacity_bytes(int64_t{1} << 30);
    req.set_model_json(testing::TinyModel());
    pb::RegisterResponse resp;
    EXPECT_TRUE(core.Register(Me(), req, &resp).ok());
    return resp;
  };
  auto report = [&](const std::string& id, int64_t used) {
    pb::PlanRequest plan;  // a report is about a planned micro-batch
    plan.set_session_id(id);
    plan.set_forward_micro_batch(0);
    plan.set_load_factor(1.0);
    pb::PlanResponse planned;
    const grpc::Status p = core.Plan(Me(), plan, &planned);
    EXPECT_TRUE(p.ok()) << p.error_message();
    pb::ReportRequest req;
    req.set_session_id(id);
    req.mutable_stats()->set_host_used_bytes(used);
    pb::ReportResponse resp;
    const grpc::Status s = core.Report(Me(), req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
  };
  auto grant = [&](const std::string& id) {
    pb::ListSessionsResponse list;
    EXPECT_TRUE(core.ListSessions(Me(), {}, &list).ok());
    for (const auto& s : list.sessions()) {
      if (s.session_id() == id) return s.host_grant_bytes();
    }
    return int64_t{-1};
  };
  const pb::RegisterResponse a = reg(0);
  EXPECT_EQ(a.host_grant_bytes(), int64_t{1} << 30);
  report(a.session_id(), int64_t{900} << 20);  // A pins 900 MiB under its whole-node grant
  const pb::RegisterResponse b = reg(1);
  EXPECT_EQ(grant(a.session_id()), int64_t{512} << 20);  // told to shrink
  EXPECT_EQ(b.host_grant_bytes(), int64_t{124} << 20);   // only what is free now
  EXPECT_EQ(grant(b.session_id()), int64_t{124} << 20);
  report(a.session_id(), int64_t{100} << 20);  // A's copies came back
  EXPECT_EQ(grant(b.session_id()), int64_t{512} << 20);
}

// A process registering its stage again names the session it replaces: the new session takes
// the old one's place in the arbitration (the other sessions' grants never grow in between), at
// the session limits too; the old one ends. Another process's session is refused; an unknown one
// makes a plain registration.
TEST(NodeCore, ARegistrationReplacesTheCallersSessionInPlace) {
  RequestLimits limits;
  limits.max_sessions = 4;
  GovernorCore core(nullptr, limits, SmallNode());
  auto reg = [&](int gpu, const std::string& replaces, const Caller& caller) {
    pb::RegisterRequest req;
    req.set_gpu_uuid("host-" + std::to_string(gpu));
    req.set_gpu_index(gpu);
    req.set_capacity_bytes(int64_t{1} << 30);
    req.set_model_json(testing::TinyModel());
    req.set_replaces_session_id(replaces);
    pb::RegisterResponse resp;
    const grpc::Status s = core.Register(caller, req, &resp);
    return std::make_pair(s, resp);
  };
  std::string ids[4];
  for (int gpu = 0; gpu < 4; ++gpu) {
    auto [s, resp] = reg(gpu, "", Me());
    ASSERT_TRUE(s.ok()) << s.error_message();
    ids[gpu] = resp.session_id();
  }
  const auto grants_before = core.HostGrants();
  ASSERT_EQ(grants_before.size(), 4u);
  for (const auto& [id, grant] : grants_before) EXPECT_EQ(grant, int64_t{256} << 20) << id;
  // At the daemon's limit of 4 a fifth session is refused; the replacement is not.
  EXPECT_EQ(reg(0, "", Me()).first.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  auto [s, replaced] = reg(0, ids[0], Me());
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(replaced.host_grant_bytes(), int64_t{256} << 20);
  pb::ListSessionsResponse list;
  ASSERT_TRUE(core.ListSessions(Me(), {}, &list).ok());
  ASSERT_EQ(list.sessions_size(), 4);
  for (const auto& session : list.sessions()) {
    EXPECT_NE(session.session_id(), ids[0]);
    EXPECT_EQ(session.host_grant_bytes(), int64_t{256} << 20) << session.session_id();
  }
  pb::UnregisterRequest un;
  un.set_session_id(ids[0]);
  pb::UnregisterResponse unresp;
  EXPECT_EQ(core.Unregister(Me(), un, &unresp).error_code(), grpc::StatusCode::NOT_FOUND);
  // An unknown (ended) session: a plain registration, refused here only by the limit.
  EXPECT_EQ(reg(0, ids[0], Me()).first.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  // Another user's session: refused, naming the field; nothing changes.
  Caller stranger = Me();
  stranger.uid = Me().uid + 1;
  auto [denied, none] = reg(1, ids[1], stranger);
  EXPECT_EQ(denied.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(denied.error_message().rfind("replaces_session_id: ", 0), 0u) << denied.error_message();
  pb::ListSessionsResponse after;
  ASSERT_TRUE(core.ListSessions(Me(), {}, &after).ok());
  EXPECT_EQ(after.sessions_size(), 4);
  EXPECT_TRUE(none.session_id().empty());
}

TEST(NodeConfigKeys, LinksSpellingsAndErrors) {
  auto links = ParseLinks("0,1,2,3@25;4,5,6,7");
  ASSERT_TRUE(links.ok()) << links.status().message();
  ASSERT_EQ(links->size(), 2u);
  EXPECT_EQ((*links)[0].gpus.size(), 4u);
  EXPECT_EQ((*links)[0].peak_bytes_per_s, 25e9);
  EXPECT_EQ((*links)[1].peak_bytes_per_s, 0);
  EXPECT_TRUE(ParseLinks("none")->empty());
  for (const char* bad : {"0,,1", "0;;1", "a", "0@x", "0@-1", "4096"}) {
    auto r = ParseLinks(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().message().rfind("links", 0), 0u) << r.status().message();
  }
}

// A fake /sys with NVIDIA GPUs on two NUMA nodes (and one other device), and a fake meminfo.
TEST(NodeConfigKeys, DefaultsFromMeminfoAndSysfs) {
  char tmpl[] = "/tmp/bgl-node-sysfs-XXXXXX";
  const std::filesystem::path root = mkdtemp(tmpl);
  auto device = [&](const std::string& bus, const std::string& vendor, const std::string& cls,
                    const std::string& numa) {
    const auto dir = root / "bus/pci/devices" / bus;
    std::filesystem::create_directories(dir);
    std::ofstream(dir / "vendor") << vendor << "\n";
    std::ofstream(dir / "class") << cls << "\n";
    std::ofstream(dir / "numa_node") << numa << "\n";
  };
  device("0000:c1:00.0", "0x10de", "0x030200", "1");
  device("0000:41:00.0", "0x10de", "0x030200", "0");
  device("0000:42:00.0", "0x10de", "0x030000", "0");
  device("0000:c2:00.0", "0x10de", "0x030200", "1");
  device("0000:01:00.0", "0x8086", "0x020000", "0");
  std::ofstream(root / "meminfo") << "MemTotal:       16777216 kB\nMemFree: 1 kB\n";
  DaemonConfig c;
  ASSERT_TRUE(ResolveNodeDefaults(c, root.string(), (root / "meminfo").string()).ok());
  EXPECT_EQ(c.node_gpus, 4);
  EXPECT_EQ(c.host_budget_bytes, int64_t{8} << 30);   // half of 16 GiB
  EXPECT_EQ(c.host_floor_bytes, int64_t{128} << 20);  // 8 GiB / 64 sessions < 256 MiB
  ASSERT_EQ(c.links.size(), 2u);                      // bus order: GPUs 0,1 on node 0; 2,3 on 1
  EXPECT_EQ(c.links[0].gpus, (std::vector<int>{0, 1}));
  EXPECT_EQ(c.links[1].gpus, (std::vector<int>{2, 3}));
  EXPECT_NE(c.links_source.find("sysfs"), std::string::npos);
  // No GPU (the host backend): no shared link; links naming GPUs twice or off the node fail.
  DaemonConfig host;
  ASSERT_TRUE(
      ResolveNodeDefaults(host, (root / "none").string(), (root / "meminfo").string()).ok());
  EXPECT_TRUE(host.links.empty());
  EXPECT_NE(host.links_source.find("host backend"), std::string::npos);
  DaemonConfig twice;
  ASSERT_TRUE(ApplyConfigValue("links", "0,1;1", twice).ok());
  EXPECT_EQ(ResolveNodeDefaults(twice, root.string(), (root / "meminfo").string())
                .message()
                .rfind("links:", 0),
            0u);
  DaemonConfig off;
  ASSERT_TRUE(ApplyConfigValue("links", "0,7", off).ok());
  Status s = ResolveNodeDefaults(off, root.string(), (root / "meminfo").string());
  EXPECT_NE(s.message().find("GPU 7, which is not on this node (node_gpus 4)"), std::string::npos)
      << s.message();
  DaemonConfig small;
  ASSERT_TRUE(ApplyConfigValue("host_budget_bytes", "1GiB", small).ok());
  ASSERT_TRUE(ApplyConfigValue("host_floor_bytes", "256MiB", small).ok());
  ASSERT_TRUE(ApplyConfigValue("node_max_sessions", "8", small).ok());
  s = ResolveNodeDefaults(small, root.string(), (root / "meminfo").string());
  EXPECT_EQ(s.message().rfind("host_budget_bytes", 0), 0u) << s.message();
  DaemonConfig unreadable;
  s = ResolveNodeDefaults(unreadable, root.string(), (root / "missing").string());
  EXPECT_EQ(s.message().rfind("host_budget_bytes", 0), 0u) << s.message();
  std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace bgl::gov
