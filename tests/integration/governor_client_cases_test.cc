// The C++ RemoteGovernor against the failure table both clients follow (docs/operations.md,
// "Failed calls"): every case of tests/governor_client_cases.json, on a fake daemon that fails
// one call with the case's status. tests/python/test_governor_cases.py runs the same cases
// against the Python package's Governor. Waits are on conditions (the fake's and WaitReady),
// never on the clock; registrations can be held at the fake so that "no call reaches the
// daemon until it is registered again" is checked while the retry is in flight.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <condition_variable>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "governor/client/failure.h"
#include "governor/client/remote_governor.h"

namespace bgl::gov {
namespace {

namespace pb = bagualu::v1;
using nlohmann::json;

constexpr auto kWait = std::chrono::seconds(60);  // a bound for a hung test, not a timing check

grpc::StatusCode CodeFromName(const std::string& name) {
  static const std::map<std::string, grpc::StatusCode> kCodes = {
      {"CANCELLED", grpc::StatusCode::CANCELLED},
      {"UNKNOWN", grpc::StatusCode::UNKNOWN},
      {"INVALID_ARGUMENT", grpc::StatusCode::INVALID_ARGUMENT},
      {"DEADLINE_EXCEEDED", grpc::StatusCode::DEADLINE_EXCEEDED},
      {"NOT_FOUND", grpc::StatusCode::NOT_FOUND},
      {"ALREADY_EXISTS", grpc::StatusCode::ALREADY_EXISTS},
      {"PERMISSION_DENIED", grpc::StatusCode::PERMISSION_DENIED},
      {"RESOURCE_EXHAUSTED", grpc::StatusCode::RESOURCE_EXHAUSTED},
      {"FAILED_PRECONDITION", grpc::StatusCode::FAILED_PRECONDITION},
      {"ABORTED", grpc::StatusCode::ABORTED},
      {"OUT_OF_RANGE", grpc::StatusCode::OUT_OF_RANGE},
      {"UNIMPLEMENTED", grpc::StatusCode::UNIMPLEMENTED},
      {"INTERNAL", grpc::StatusCode::INTERNAL},
      {"UNAVAILABLE", grpc::StatusCode::UNAVAILABLE},
      {"DATA_LOSS", grpc::StatusCode::DATA_LOSS},
      {"UNAUTHENTICATED", grpc::StatusCode::UNAUTHENTICATED}};
  auto it = kCodes.find(name);
  EXPECT_NE(it, kCodes.end()) << "unknown status code " << name;
  return it == kCodes.end() ? grpc::StatusCode::UNKNOWN : it->second;
}

json Cases() {
  std::ifstream in(BGL_CLIENT_CASES);
  EXPECT_TRUE(in.good()) << BGL_CLIENT_CASES;
  return json::parse(in);
}

grpc::Status CaseStatus(const json& c) {
  return {CodeFromName(c.at("code").get<std::string>()), c.at("details").get<std::string>()};
}

std::string Describe(const json& c) {
  return c.at("code").get<std::string>() + " '" + c.at("details").get<std::string>() + "'";
}

// A daemon that answers every call, except the next Plan or the next registrations, which fail
// with a given status. Registrations can be held until released.
class FakeDaemon final : public pb::Governor::Service {
 public:
  grpc::Status Register(grpc::ServerContext*, const pb::RegisterRequest*,
                        pb::RegisterResponse* resp) override {
    std::unique_lock<std::mutex> lock(mu_);
    ++registers_;
    cv_.notify_all();
    cv_.wait(lock, [&] { return !hold_; });
    if (register_failures_ > 0) {
      --register_failures_;
      return failure_;
    }
    const std::string id = "s-" + std::to_string(++next_id_);
    sessions_.insert(id);
    resp->set_session_id(id);
    return grpc::Status::OK;
  }
  grpc::Status Plan(grpc::ServerContext*, const pb::PlanRequest* req,
                    pb::PlanResponse* resp) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++plans_;
    if (plan_failures_ > 0) {
      --plan_failures_;
      return failure_;
    }
    if (!sessions_.count(req->session_id())) {
      return {grpc::StatusCode::NOT_FOUND, "session_id: unknown session"};
    }
    resp->mutable_plan()->set_micro_batch(req->forward_micro_batch());
    return grpc::Status::OK;
  }
  grpc::Status Report(grpc::ServerContext*, const pb::ReportRequest*,
                      pb::ReportResponse*) override {
    return grpc::Status::OK;
  }
  grpc::Status Unregister(grpc::ServerContext*, const pb::UnregisterRequest* req,
                          pb::UnregisterResponse*) override {
    std::lock_guard<std::mutex> lock(mu_);
    ended_.push_back(req->session_id());
    sessions_.erase(req->session_id());
    return grpc::Status::OK;
  }
  grpc::Status ListSessions(grpc::ServerContext*, const pb::ListSessionsRequest*,
                            pb::ListSessionsResponse* resp) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& id : sessions_) resp->add_sessions()->set_session_id(id);
    return grpc::Status::OK;
  }

  void FailNextPlan(const grpc::Status& s) {
    std::lock_guard<std::mutex> lock(mu_);
    failure_ = s;
    plan_failures_ = 1;
  }
  void FailNextRegistration(const grpc::Status& s) {
    std::lock_guard<std::mutex> lock(mu_);
    failure_ = s;
    register_failures_ = 1;
  }
  void Hold(bool hold) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      hold_ = hold;
    }
    cv_.notify_all();
  }
  // Waits until `n` registrations have arrived (held or answered).
  bool WaitRegisters(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, kWait, [&] { return registers_ >= n; });
  }
  int registers() const {
    std::lock_guard<std::mutex> lock(mu_);
    return registers_;
  }
  int plans() const {
    std::lock_guard<std::mutex> lock(mu_);
    return plans_;
  }
  std::vector<std::string> ended() const {
    std::lock_guard<std::mutex> lock(mu_);
    return ended_;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  grpc::Status failure_;
  int plan_failures_ = 0;
  int register_failures_ = 0;
  bool hold_ = false;
  int registers_ = 0;
  int plans_ = 0;
  int next_id_ = 0;
  std::set<std::string> sessions_;
  std::vector<std::string> ended_;
};

// The fake on a unix socket in a fresh directory (one per case: its counters start at zero).
class FakeServer {
 public:
  FakeServer() {
    char tmpl[] = "/tmp/bgl-client-cases-XXXXXX";
    EXPECT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    address_ = "unix://" + dir_ + "/governor.sock";
    grpc::ServerBuilder builder;
    builder.AddListeningPort(address_, grpc::InsecureServerCredentials());
    builder.RegisterService(&fake_);
    server_ = builder.BuildAndStart();
    EXPECT_NE(server_, nullptr);
  }
  ~FakeServer() {
    fake_.Hold(false);
    if (server_) server_->Shutdown();
    (void)std::system(("rm -rf '" + dir_ + "'").c_str());
  }
  FakeDaemon& fake() { return fake_; }

  // A client with the table's behaviour, deadlines that never fire on a loaded machine and a
  // backoff that does not slow the test down.
  RemoteOptions Options() const {
    RemoteOptions o;
    o.address = address_;
    o.deadline = std::chrono::seconds(30);
    o.register_deadline = std::chrono::seconds(30);
    o.probe_deadline = std::chrono::seconds(30);
    o.min_backoff = std::chrono::milliseconds(1);
    o.max_backoff = std::chrono::milliseconds(10);
    return o;
  }

 private:
  FakeDaemon fake_;
  std::unique_ptr<grpc::Server> server_;
  std::string dir_;
  std::string address_;
};

Registration Reg() {
  Registration r;
  r.job_id = "client-cases";
  r.model_json = "{}";  // the fake does not read it
  return r;
}

plan::SchedulePoint Point(int mb) {
  plan::SchedulePoint p;
  p.forward_micro_batch = mb;
  return p;
}

TEST(GovernorClientCases, EveryCaseIsClassifiedAsInTheTable) {
  const json cases = Cases();
  int n = 0;
  for (const char* group : {"calls", "registrations"}) {
    for (const json& c : cases.at(group)) {
      EXPECT_EQ(FailureName(ClassifyFailure(CaseStatus(c))), c.at("kind").get<std::string>())
          << Describe(c);
      ++n;
    }
  }
  EXPECT_GE(n, 10);
}

TEST(GovernorClientCases, FailedPlanningCalls) {
  const json cases = Cases().at("calls");
  ASSERT_GE(cases.size(), 10u);
  for (const json& c : cases) {
    SCOPED_TRACE(Describe(c));
    FakeServer server;
    FakeDaemon& fake = server.fake();
    RemoteGovernor gov(server.Options());
    auto info = gov.Register(Reg());
    ASSERT_TRUE(info.ok()) << info.status().message();
    const std::string handle = info->session_id;
    const std::string first = gov.DaemonSessionId(handle);
    ASSERT_TRUE(gov.Plan(handle, Point(0)).ok());

    fake.Hold(true);  // a retry's registration waits at the fake until released
    fake.FailNextPlan(CaseStatus(c));
    auto failed = gov.Plan(handle, Point(1));
    ASSERT_FALSE(failed.ok());
    EXPECT_EQ(AnswerInProcess(failed.status()), c.at("answer") == "embedded")
        << failed.status().message();

    const std::string daemon = c.at("daemon");
    const int plans = fake.plans();
    if (daemon == "kept") {
      EXPECT_TRUE(gov.connected());
      EXPECT_TRUE(gov.Plan(handle, Point(2)).ok());
      EXPECT_EQ(gov.DaemonSessionId(handle), first);
      EXPECT_EQ(fake.plans(), plans + 1);
      EXPECT_EQ(fake.registers(), 1);
    } else {
      ASSERT_TRUE(daemon == "down" || daemon == "register_again") << daemon;
      // Marked down after an outage; still connected when only the session was lost.
      EXPECT_EQ(gov.connected(), daemon == "register_again");
      auto next = gov.Plan(handle, Point(2));  // does not reach the daemon
      ASSERT_FALSE(next.ok());
      EXPECT_EQ(next.status().code(), StatusCode::kUnavailable) << next.status().message();
      EXPECT_EQ(fake.plans(), plans);
      ASSERT_TRUE(fake.WaitRegisters(2));  // the retry registers the model again
      fake.Hold(false);
      ASSERT_TRUE(gov.WaitReady(handle, kWait));
      EXPECT_NE(gov.DaemonSessionId(handle), first);
      EXPECT_EQ(fake.registers(), 2);
      // After an outage the daemon may still hold the old session: it is ended, after the new
      // registration. A lost session has nothing to end.
      const std::vector<std::string> ended = fake.ended();
      if (daemon == "down") {
        EXPECT_EQ(ended, std::vector<std::string>{first});
      } else {
        EXPECT_TRUE(ended.empty());
      }
      EXPECT_TRUE(gov.Plan(handle, Point(3)).ok());
    }
    fake.Hold(false);
    EXPECT_TRUE(gov.Unregister(handle).ok());
  }
}

TEST(GovernorClientCases, FailedRegistrations) {
  const json cases = Cases().at("registrations");
  ASSERT_GE(cases.size(), 5u);
  for (const json& c : cases) {
    SCOPED_TRACE(Describe(c));
    FakeServer server;
    FakeDaemon& fake = server.fake();
    RemoteGovernor gov(server.Options());
    fake.FailNextRegistration(CaseStatus(c));
    const std::string handle = gov.RegisterWhenAvailable(Reg());
    const std::string retry = c.at("retry");
    if (retry == "backoff") {
      ASSERT_TRUE(gov.WaitReady(handle, kWait));
      EXPECT_EQ(fake.registers(), 2);
      EXPECT_TRUE(gov.Plan(handle, Point(0)).ok());
    } else {
      ASSERT_EQ(retry, "never");
      ASSERT_TRUE(fake.WaitRegisters(1));
      // A second registration goes through; the refused one is not in its retry pass.
      const std::string other = gov.RegisterWhenAvailable(Reg());
      ASSERT_TRUE(gov.WaitReady(other, kWait));
      EXPECT_EQ(fake.registers(), 2);
      EXPECT_EQ(gov.DaemonSessionId(handle), "");
      auto plan = gov.Plan(handle, Point(0));
      ASSERT_FALSE(plan.ok());
      EXPECT_TRUE(AnswerInProcess(plan.status())) << plan.status().message();
    }
  }
}

}  // namespace
}  // namespace bgl::gov
