// Hostile registrations and plans against GovernorCore (issue 12, items 1 and 2): a deeply
// nested model, subnormal calibration, oversized layer graphs and plans that would run for
// minutes are refused with the field or the limit named; the core keeps serving other sessions,
// and the figures Watch and the watchdog's housekeeping read never wait for a plan.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "governor/service/governor_core.h"
#include "governor/service/metrics.h"
#include "tests/unit/governor/tiny_model.h"
#include "tests/unit/planner/heavy_graph.h"

namespace bgl::gov {
namespace {

namespace pb = bagualu::v1;
using nlohmann::json;

Caller User(uint32_t uid = 1000, int32_t pid = 4242) {
  Caller c;
  c.uid = uid;
  c.pid = pid;
  c.user = "u";
  return c;
}

pb::RegisterRequest Request(const std::string& model_json, int64_t capacity = int64_t{8} << 30) {
  pb::RegisterRequest r;
  r.set_gpu_uuid("GPU-0");
  r.set_model_json(model_json);
  r.set_capacity_bytes(capacity);
  return r;
}

// A stage whose greedy would take minutes: 200 operators per layer, 16 layers.
std::string HeavyModel() {
  json model = {{"name", "heavy"},
                {"layers", 16},
                {"hidden", 64},
                {"moe_hidden", 64},
                {"experts", 1},
                {"top_k", 1},
                {"head_dim", 64},
                {"gpus", 1},
                {"dp", 1},
                {"tp", 1},
                {"ep", 1},
                {"pp", 1},
                {"param_bytes", 0},
                {"grad_bytes", 0},
                {"optimizer_bytes", 0},
                {"workspace", 0},
                {"safety_margin", 0.0}};
  model["layer_graph"] = plan::testing::HeavyLayerGraph();
  return model.dump();
}

std::string Register(GovernorCore& core, const pb::RegisterRequest& req, const Caller& caller) {
  pb::RegisterResponse resp;
  const grpc::Status s = core.Register(caller, req, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return resp.session_id();
}

grpc::Status PlanFirstForward(GovernorCore& core, const std::string& id, const Caller& caller) {
  pb::PlanRequest req;
  req.set_session_id(id);
  req.set_forward_micro_batch(0);
  req.set_load_factor(1.0);
  pb::PlanResponse resp;
  return core.Plan(caller, req, &resp);
}

TEST(GovernorHardening, DeeplyNestedModelIsRefusedAndOtherSessionsKeepPlanning) {
  GovernorCore core;
  const std::string tiny = Register(core, Request(testing::TinyModel()), User());
  const std::string deep =
      R"({"name": "x", "layer_graph": )" + std::string(80000, '[') + std::string(80000, ']') + "}";
  pb::RegisterResponse resp;
  const auto start = std::chrono::steady_clock::now();
  const grpc::Status s = core.Register(User(), Request(deep), &resp);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("model_json: arrays and objects nested deeper than 64"),
            std::string::npos)
      << s.error_message();
  EXPECT_LT(s.error_message().size(), 200u);
  std::printf("deep model refused in %.2f ms\n", ms);
  EXPECT_TRUE(PlanFirstForward(core, tiny, User()).ok());
  EXPECT_EQ(core.session_count(), 1u);
  // The limit is the configuration's.
  RequestLimits limits;
  limits.max_json_depth = 8;
  core.SetLimits(limits);
  const std::string nine = R"({"a": [[[[[[[[[1]]]]]]]]]})";
  EXPECT_NE(core.Register(User(), Request(nine), &resp).error_message().find("deeper than 8"),
            std::string::npos);
}

TEST(GovernorHardening, SubnormalCalibrationIsRefusedNamingTheField) {
  GovernorCore core;
  struct Case {
    const char* field;
    void (*set)(pb::Calibration*, double);
  };
  const Case cases[] = {
      {"calibration.peak_tflops", [](pb::Calibration* c, double v) { c->set_peak_tflops(v); }},
      {"calibration.matmul_efficiency",
       [](pb::Calibration* c, double v) { c->set_matmul_efficiency(v); }},
      {"calibration.hbm_gbps", [](pb::Calibration* c, double v) { c->set_hbm_gbps(v); }},
      {"calibration.offload.peak_gbps",
       [](pb::Calibration* c, double v) { c->mutable_offload()->set_peak_gbps(v); }},
      {"calibration.fp8_cast.launch_floor_us",
       [](pb::Calibration* c, double v) { c->mutable_fp8_cast()->set_launch_floor_us(v); }},
  };
  for (const Case& c : cases) {
    for (double v : {5e-324, 1e-310, 1e-12}) {
      pb::RegisterRequest req = Request(testing::TinyModel());
      c.set(req.mutable_calibration(), v);
      pb::RegisterResponse resp;
      const grpc::Status s = core.Register(User(), req, &resp);
      ASSERT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.field << " = " << v;
      EXPECT_NE(s.error_message().find(c.field), std::string::npos) << s.error_message();
    }
  }
  EXPECT_EQ(core.session_count(), 0u);
}

TEST(GovernorHardening, LayerGraphsLargerThanTheLimitsAreRefused) {
  GovernorCore core;
  json model = json::parse(HeavyModel());
  RequestLimits limits;
  limits.max_operators_per_layer = 100;
  core.SetLimits(limits);
  pb::RegisterResponse resp;
  grpc::Status s = core.Register(User(), Request(model.dump()), &resp);
  ASSERT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("model_json.layer_graph.operators: 200"), std::string::npos)
      << s.error_message();
  EXPECT_NE(s.error_message().find("max_operators_per_layer"), std::string::npos);
  limits = RequestLimits{};
  limits.max_layers_per_chunk = 8;
  core.SetLimits(limits);
  s = core.Register(User(), Request(model.dump()), &resp);
  ASSERT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("max_layers_per_chunk"), std::string::npos) << s.error_message();
}

TEST(GovernorHardening, PlanPastTheTimeLimitIsRefusedAndTheSessionSurvives) {
  RequestLimits limits;
  limits.plan_timeout_ms = 100;
  GovernorCore core(nullptr, limits);
  const std::string heavy = Register(core, Request(HeavyModel(), int64_t{1} << 30), User());
  const std::string tiny = Register(core, Request(testing::TinyModel()), User(1001, 77));
  const grpc::Status s = PlanFirstForward(core, heavy, User());
  ASSERT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_NE(s.error_message().find("plan_timeout_ms"), std::string::npos) << s.error_message();
  EXPECT_TRUE(PlanFirstForward(core, tiny, User(1001, 77)).ok());
  EXPECT_EQ(core.session_count(), 2u);
  // The refused plan left the session's planner as it was: the same refusal again.
  EXPECT_EQ(PlanFirstForward(core, heavy, User()).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
}

// The plans the planner is working on now, as the core's metrics count them.
double PlansInProgress(const Metrics& metrics) {
  const std::string text = metrics.Text();
  const std::string key = "\nbagualu_plans_in_progress ";
  const size_t at = text.find(key);
  return at == std::string::npos ? -1 : std::stod(text.substr(at + key.size()));
}

// Waits until a plan is running, by the core's own count, not by the clock (the bound only
// keeps a broken core from hanging the test).
bool WaitForRunningPlan(const Metrics& metrics) {
  for (int i = 0; i < 60000; ++i) {
    if (PlansInProgress(metrics) >= 1) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

TEST(GovernorHardening, WatchAndMetricsNeverWaitForARunningPlan) {
  // The heavy plan runs for minutes; only CancelPlans (below, after the sample) ends it in this
  // test. If the sample waited for the plan, the 60 s limit would end the plan first and it
  // would come back RESOURCE_EXHAUSTED instead of UNAVAILABLE.
  RequestLimits limits;
  limits.plan_timeout_ms = 60000;
  Metrics metrics;
  GovernorCore core(&metrics, limits);
  const std::string heavy = Register(core, Request(HeavyModel(), int64_t{1} << 30), User());
  grpc::Status planned;
  std::thread planner([&] { planned = PlanFirstForward(core, heavy, User()); });
  const bool running = WaitForRunningPlan(metrics);
  Caller admin;
  admin.admin = true;
  pb::WatchResponse sample;
  if (running) {
    core.Sample(admin, &sample);  // what Watch streams and the housekeeping thread run
    core.PublishMetrics();
  }
  const double in_progress = PlansInProgress(metrics);
  core.CancelPlans();
  planner.join();
  ASSERT_TRUE(running) << "the plan never started";
  EXPECT_EQ(in_progress, 1) << "the plan ended before the sample returned";
  EXPECT_EQ(planned.error_code(), grpc::StatusCode::UNAVAILABLE)
      << "the sample waited for the plan: " << planned.error_message();
  ASSERT_EQ(sample.gpus_size(), 1);
  EXPECT_EQ(sample.gpus(0).processes_size(), 1);
  EXPECT_EQ(PlansInProgress(metrics), 0);
}

TEST(GovernorHardening, CancelPlansEndsARunningPlanForTheDrain) {
  RequestLimits limits;
  limits.plan_timeout_ms = 600000;
  Metrics metrics;
  GovernorCore core(&metrics, limits);
  const std::string heavy = Register(core, Request(HeavyModel(), int64_t{1} << 30), User());
  grpc::Status planned;
  std::thread planner([&] { planned = PlanFirstForward(core, heavy, User()); });
  // Cancelled while the planner works on it, not before it started (a plan refused at its
  // start would also come back UNAVAILABLE).
  const bool running = WaitForRunningPlan(metrics);
  core.CancelPlans();
  planner.join();
  ASSERT_TRUE(running) << "the plan never started";
  EXPECT_EQ(planned.error_code(), grpc::StatusCode::UNAVAILABLE) << planned.error_message();
  EXPECT_EQ(PlansInProgress(metrics), 0);
}

}  // namespace
}  // namespace bgl::gov
