// Command lines of bgl-top and bglctl, and the shared governor address rules.
#include "tools/bgl-top/options.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include "tools/bglctl/governor_address.h"
#include "tools/bglctl/options.h"

namespace bgl {
namespace {

TEST(TopOptions, Flags) {
  auto o = top::ParseTopOptions({"--governor", "unix:///tmp/s", "--once", "-d", "0.5", "--sort",
                                 "pid", "--reverse", "--ascii", "--width", "80"});
  ASSERT_TRUE(o.ok()) << o.status().message();
  EXPECT_EQ(o->governor, "unix:///tmp/s");
  EXPECT_TRUE(o->once);
  EXPECT_DOUBLE_EQ(o->interval_s, 0.5);
  EXPECT_EQ(o->sort, top::SortKey::kPid);
  EXPECT_TRUE(o->reverse && o->ascii);
  EXPECT_EQ(o->width, 80);
}

TEST(TopOptions, ErrorsNameTheFlag) {
  for (const auto& [args, flag] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"-d", "0.01"}, "-d"},
           {{"-d", "x"}, "-d"},
           {{"--sort", "speed"}, "--sort"},
           {{"--width", "5"}, "--width"},
           {{"--governor"}, "--governor"},
           {{"--frobnicate"}, "--frobnicate"}}) {
    auto o = top::ParseTopOptions(args);
    ASSERT_FALSE(o.ok()) << flag;
    EXPECT_NE(o.status().message().find(flag), std::string::npos) << o.status().message();
  }
}

TEST(CtlOptions, Commands) {
  auto health = ctl::ParseCtlOptions({"--governor", "unix:///x", "health"});
  ASSERT_TRUE(health.ok());
  EXPECT_EQ(health->command, ctl::Command::kHealth);
  EXPECT_EQ(health->governor, "unix:///x");
  auto snap = ctl::ParseCtlOptions({"snapshot", "--session", "s1", "--out", "f.json"});
  ASSERT_TRUE(snap.ok());
  EXPECT_EQ(snap->session_id, "s1");
  EXPECT_EQ(snap->out_path, "f.json");
  auto plan = ctl::ParseCtlOptions({"plan", "--session", "s1", "--phase", "steady", "--forward",
                                    "3", "--backward", "1", "--load", "1.5", "--bytes-in-use",
                                    "1GiB", "--json"});
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  EXPECT_EQ(plan->phase, "steady");
  EXPECT_EQ(plan->forward_micro_batch, 3);
  EXPECT_EQ(plan->backward_micro_batch, 1);
  EXPECT_EQ(plan->bytes_in_use, int64_t{1} << 30);
  EXPECT_TRUE(plan->json);
  EXPECT_EQ(plan->budget_step_bytes, 0);
  auto probe = ctl::ParseCtlOptions(
      {"plan", "--model", "m.json", "--capacity", "256MiB", "--budget-step", "4MiB"});
  ASSERT_TRUE(probe.ok()) << probe.status().message();
  EXPECT_EQ(probe->budget_step_bytes, int64_t{4} << 20);
}

TEST(CtlOptions, Errors) {
  EXPECT_FALSE(ctl::ParseCtlOptions({}).ok());
  EXPECT_FALSE(ctl::ParseCtlOptions({"frob"}).ok());
  EXPECT_FALSE(ctl::ParseCtlOptions({"plan"}).ok());                  // no session
  EXPECT_FALSE(ctl::ParseCtlOptions({"health", "--out", "x"}).ok());  // wrong command
  EXPECT_FALSE(ctl::ParseCtlOptions({"plan", "--session", "s", "--phase", "x"}).ok());
  EXPECT_FALSE(ctl::ParseCtlOptions({"--timeout", "0", "health"}).ok());
  EXPECT_FALSE(ctl::ParseCtlOptions({"health", "sessions"}).ok());
  // A session keeps the budget step it registered with.
  EXPECT_FALSE(ctl::ParseCtlOptions({"plan", "--session", "s", "--budget-step", "1MiB"}).ok());
}

TEST(GovernorAddress, DefaultFromEnvironment) {
  unsetenv("BGL_GOVERNOR");
  EXPECT_EQ(tools::DefaultGovernorAddress(), "unix:///run/bagualu/governor.sock");
  setenv("BGL_GOVERNOR", "unix:///tmp/other.sock", 1);
  EXPECT_EQ(tools::DefaultGovernorAddress(), "unix:///tmp/other.sock");
  setenv("BGL_GOVERNOR", "", 1);
  EXPECT_EQ(tools::DefaultGovernorAddress(), "unix:///run/bagualu/governor.sock");
  unsetenv("BGL_GOVERNOR");
}

TEST(GovernorAddress, Check) {
  EXPECT_TRUE(tools::CheckGovernorAddress("unix:///run/bagualu/governor.sock").ok());
  EXPECT_TRUE(tools::CheckGovernorAddress("localhost:7787").ok());
  EXPECT_TRUE(tools::CheckGovernorAddress("ipv4:127.0.0.1:7787").ok());
  EXPECT_FALSE(tools::CheckGovernorAddress("").ok());
  EXPECT_FALSE(tools::CheckGovernorAddress("unix://").ok());
  EXPECT_FALSE(tools::CheckGovernorAddress("/run/bagualu/governor.sock").ok());
}

TEST(GovernorAddress, FailureNamesAddressAndMissingSocket) {
  const std::string text = tools::DescribeRpcFailure(
      "unix:///nonexistent/dir/g.sock", grpc::Status(grpc::StatusCode::UNAVAILABLE, "down"));
  EXPECT_NE(text.find("unix:///nonexistent/dir/g.sock"), std::string::npos);
  EXPECT_NE(text.find("no such socket"), std::string::npos);
  EXPECT_NE(text.find("UNAVAILABLE"), std::string::npos);
}

}  // namespace
}  // namespace bgl
