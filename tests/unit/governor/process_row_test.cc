// Watch's per-process row (issue 44): planned against actual and the strategy mix in effect are
// what the process last reported (ReportRequest.in_effect: the plans it serves, whichever planner
// made them, revised after the gate), not the daemon's latest plan; a bad report is refused
// naming the field and leaves the row as it was.
#include <google/protobuf/util/message_differencer.h>
#include <gtest/gtest.h>

#include "governor/service/governor_core.h"
#include "tests/unit/governor/tiny_model.h"

namespace bgl::gov {
namespace {

namespace pb = bagualu::v1;

Caller Owner() {
  Caller c;
  c.uid = 1000;
  c.pid = 4242;
  c.user = "u";
  return c;
}

struct Registered {
  std::string id;
  int operators = 0;
};

Registered RegisterTiny(GovernorCore& core) {
  pb::RegisterRequest req;
  req.set_gpu_uuid("host-0");
  req.set_model_json(testing::TinyModel());
  req.set_capacity_bytes(int64_t{8} << 30);
  pb::RegisterResponse resp;
  const grpc::Status s = core.Register(Owner(), req, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return {resp.session_id(), resp.operator_names_size()};
}

// Plans the forward of micro-batch 0 with nothing in use: the tiny model keeps everything.
pb::Plan PlanFirstForward(GovernorCore& core, const std::string& id) {
  pb::PlanRequest req;
  req.set_session_id(id);
  req.set_forward_micro_batch(0);
  req.set_load_factor(1.0);
  pb::PlanResponse resp;
  const grpc::Status s = core.Plan(Owner(), req, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return resp.plan();
}

bool Same(const pb::InEffect& a, const pb::InEffect& b) {
  return google::protobuf::util::MessageDifferencer::Equals(a, b);
}

pb::ProcessRow OnlyRow(GovernorCore& core) {
  pb::WatchResponse frame;
  core.Sample(Owner(), &frame);
  EXPECT_EQ(frame.gpus_size(), 1);
  if (frame.gpus_size() != 1 || frame.gpus(0).processes_size() != 1) return {};
  return frame.gpus(0).processes(0);
}

pb::ReportRequest Report(const std::string& id, const pb::InEffect& in_effect) {
  pb::ReportRequest req;
  req.set_session_id(id);
  req.set_micro_batch(0);
  req.set_actual_bytes(3 << 20);
  *req.mutable_in_effect() = in_effect;
  return req;
}

// Two micro-batches in flight: one as planned (keep), one revised after its gate to offload
// and recompute a few operators (the daemon's latest plan, a later forward's, keeps all).
pb::InEffect Offloading(int operators) {
  pb::InEffect e;
  e.set_micro_batches(2);
  e.set_planned_bytes(int64_t{96} << 20);
  e.set_actual_bytes((int64_t{96} << 20) + 12345);
  e.set_planned_host_bytes(int64_t{24} << 20);
  e.set_actual_host_bytes(int64_t{23} << 20);
  (*e.mutable_strategy_counts())["keep"] = 2 * operators - 5;
  (*e.mutable_strategy_counts())["offload"] = 3;
  (*e.mutable_strategy_counts())["recompute"] = 2;
  return e;
}

TEST(ProcessRow, ShowsThePlansInEffectAsReported) {
  GovernorCore core;
  const Registered s = RegisterTiny(core);
  ASSERT_GT(s.operators, 3);
  const pb::Plan plan = PlanFirstForward(core, s.id);
  ASSERT_EQ(plan.host_bytes(), 0);
  EXPECT_FALSE(OnlyRow(core).has_in_effect()) << "nothing reported yet";

  const pb::InEffect sent = Offloading(s.operators);
  pb::ReportResponse out;
  const grpc::Status st = core.Report(Owner(), Report(s.id, sent), &out);
  ASSERT_TRUE(st.ok()) << st.error_message();

  const pb::ProcessRow row = OnlyRow(core);
  ASSERT_TRUE(row.has_in_effect());
  EXPECT_TRUE(Same(row.in_effect(), sent)) << row.in_effect().DebugString();
  EXPECT_EQ(row.in_effect().strategy_counts().at("offload"), 3);
  EXPECT_EQ(row.in_effect().planned_host_bytes(), int64_t{24} << 20);
  // The latest plan's counts stay what they are: keep only.
  EXPECT_EQ(row.strategy_counts().size(), 1u);
  EXPECT_EQ(row.strategy_counts().at("keep"), s.operators);

  // A report without in_effect (an older client) leaves the last one shown.
  pb::ReportRequest plain = Report(s.id, {});
  plain.clear_in_effect();
  ASSERT_TRUE(core.Report(Owner(), plain, &out).ok());
  EXPECT_TRUE(Same(OnlyRow(core).in_effect(), sent));
}

TEST(ProcessRow, BadInEffectIsRefusedNamingTheFieldAndTheRowStays) {
  GovernorCore core;
  const Registered s = RegisterTiny(core);
  PlanFirstForward(core, s.id);
  const pb::InEffect good = Offloading(s.operators);
  pb::ReportResponse out;
  ASSERT_TRUE(core.Report(Owner(), Report(s.id, good), &out).ok());

  struct Case {
    const char* field;
    pb::InEffect in_effect;
  };
  std::vector<Case> cases;
  pb::InEffect e = good;
  e.set_planned_bytes(-1);
  cases.push_back({"in_effect.planned_bytes", e});
  e = good;
  e.set_actual_host_bytes(int64_t{1} << 60);
  cases.push_back({"in_effect.actual_host_bytes", e});
  e = good;
  e.set_micro_batches(-2);
  cases.push_back({"in_effect.micro_batches", e});
  e = good;
  (*e.mutable_strategy_counts())["drop"] = 1;
  cases.push_back({"unknown strategy 'drop'", e});
  e = good;
  (*e.mutable_strategy_counts())["keep"] = 2 * s.operators + 1;  // more than 2 micro-batches have
  cases.push_back({"in_effect.strategy_counts[keep]", e});
  for (const Case& c : cases) {
    const grpc::Status st = core.Report(Owner(), Report(s.id, c.in_effect), &out);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.field;
    EXPECT_NE(st.error_message().find(c.field), std::string::npos) << st.error_message();
  }
  EXPECT_TRUE(Same(OnlyRow(core).in_effect(), good));
}

}  // namespace
}  // namespace bgl::gov
