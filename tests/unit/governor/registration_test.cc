// RegisterRequest.budget_step_bytes: it reaches the session's planner and sets the width of the
// plan cache's budget buckets; out-of-range values are INVALID_ARGUMENT naming the field. The
// daemon's and the session's calibration, and the strategies a session disallows, reach it too.
#include "governor/common/registration.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "governor/service/governor_core.h"
#include "tests/unit/governor/tiny_model.h"

namespace bgl::gov {
namespace {

namespace pb = bagualu::v1;

constexpr int64_t kMiB = int64_t{1} << 20;

pb::RegisterRequest TinyRegister(int64_t budget_step_bytes) {
  pb::RegisterRequest r;
  r.set_gpu_uuid("host-0");
  r.set_model_json(testing::TinyModel());
  r.set_capacity_bytes(int64_t{8} << 30);
  r.set_budget_step_bytes(budget_step_bytes);
  return r;
}

// Plans the first forward twice, in two iterations, with `in_use` and then `in_use + delta`
// retained; returns both plans.
std::pair<plan::Plan, plan::Plan> PlanTwice(plan::StagePlanner& p, int64_t in_use, int64_t delta) {
  plan::SchedulePoint point;
  point.forward_micro_batch = 0;
  point.bytes_in_use = in_use;
  auto first = p.PlanPoint(point);
  EXPECT_TRUE(first.ok()) << first.status().message();
  p.ResetIteration();
  point.bytes_in_use = in_use + delta;
  auto second = p.PlanPoint(point);
  EXPECT_TRUE(second.ok()) << second.status().message();
  return {*first, *second};
}

int64_t Bucket(int64_t budget, int64_t step) { return budget / step; }

TEST(Registration, BudgetStepReachesThePlanner) {
  auto fine = CreatePlannerFromRequest(TinyRegister(kMiB), RequestLimits{});
  ASSERT_TRUE(fine.ok()) << fine.status().message();
  EXPECT_EQ((*fine)->options().budget_step_bytes, kMiB);
  auto coarse = CreatePlannerFromRequest(TinyRegister(0), RequestLimits{});
  ASSERT_TRUE(coarse.ok()) << coarse.status().message();
  EXPECT_EQ((*coarse)->options().budget_step_bytes, plan::PlannerOptions{}.budget_step_bytes);
}

TEST(Registration, BudgetStepSplitsADefaultBucket) {
  // Two budgets a few MiB apart inside one 64 MiB bucket: the default planner reuses the first
  // plan, a planner with 1 MiB buckets plans the second budget afresh. Both budgets (about 79
  // and 75 MiB of 7.4 GiB for activations, k = 4) are below keep-all (94 MiB): a budget that
  // holds keep-all is planned as keep-all whatever the step, without the cache.
  const int64_t in_use = 7300 * kMiB, delta = 16 * kMiB;
  auto coarse = CreatePlannerFromRequest(TinyRegister(0), RequestLimits{});
  ASSERT_TRUE(coarse.ok()) << coarse.status().message();
  auto [c1, c2] = PlanTwice(**coarse, in_use, delta);
  ASSERT_NE(c1.budget_bytes, c2.budget_bytes);
  ASSERT_EQ(Bucket(c1.budget_bytes, 64 * kMiB), Bucket(c2.budget_bytes, 64 * kMiB))
      << "pick in_use so that both budgets share a 64 MiB bucket: " << c1.budget_bytes << " "
      << c2.budget_bytes;
  EXPECT_FALSE(c1.cache_hit);
  EXPECT_TRUE(c2.cache_hit);

  auto fine = CreatePlannerFromRequest(TinyRegister(kMiB), RequestLimits{});
  ASSERT_TRUE(fine.ok()) << fine.status().message();
  auto [f1, f2] = PlanTwice(**fine, in_use, delta);
  EXPECT_EQ(f1.budget_bytes, c1.budget_bytes);
  EXPECT_EQ(f2.budget_bytes, c2.budget_bytes);
  ASSERT_NE(Bucket(f1.budget_bytes, kMiB), Bucket(f2.budget_bytes, kMiB));
  EXPECT_FALSE(f1.cache_hit);
  EXPECT_FALSE(f2.cache_hit);
  EXPECT_EQ((*fine)->cache_stats().mitigation.misses, 2u);
}

TEST(Registration, BadBudgetStepIsRejectedNamingTheField) {
  GovernorCore core;
  const Caller caller{1000, 111, false, "user"};
  for (int64_t step :
       {int64_t{-1}, -kMiB, int64_t{1}, kMinBudgetStepBytes - 1, (int64_t{1} << 50) + 1}) {
    pb::RegisterResponse resp;
    const grpc::Status s = core.Register(caller, TinyRegister(step), &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << step;
    EXPECT_EQ(s.error_message().rfind("budget_step_bytes: ", 0), 0u) << s.error_message();
    EXPECT_NE(s.error_message().find(std::to_string(step)), std::string::npos) << s.error_message();
  }
  EXPECT_EQ(core.session_count(), 0u);
  pb::RegisterResponse resp;
  EXPECT_TRUE(core.Register(caller, TinyRegister(kMinBudgetStepBytes), &resp).ok());
  EXPECT_EQ(core.session_count(), 1u);
}

// The daemon's calibration file (bgl-governord --calibration) reaches every session's planner
// on top of the profile it names; a session's own calibration comes after it.
TEST(Registration, NodeCalibrationReachesThePlannerAndTheSessionsOwnComesAfter) {
  const nlohmann::json node = {
      {"gpu", "host"}, {"copy_overlap", 0.25}, {"rooflines", {{"offload", {{"peak_GBps", 7}}}}}};
  pb::RegisterRequest req = TinyRegister(0);
  auto p = CreatePlannerFromRequest(req, RequestLimits{}, {}, &node);
  ASSERT_TRUE(p.ok()) << p.status().message();
  EXPECT_EQ((*p)->hardware().name, "host");
  EXPECT_DOUBLE_EQ((*p)->hardware().copy_overlap, 0.25);
  EXPECT_DOUBLE_EQ((*p)->hardware().offload.peak_bytes_per_s, 7e9);
  req.mutable_calibration()->mutable_offload()->set_peak_gbps(3);
  req.mutable_calibration()->set_copy_overlap(1);
  auto own = CreatePlannerFromRequest(req, RequestLimits{}, {}, &node);
  ASSERT_TRUE(own.ok()) << own.status().message();
  EXPECT_DOUBLE_EQ((*own)->hardware().offload.peak_bytes_per_s, 3e9);
  EXPECT_DOUBLE_EQ((*own)->hardware().copy_overlap, 1);
  auto plain = CreatePlannerFromRequest(TinyRegister(0), RequestLimits{});
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ((*plain)->hardware().name, "h200");
  req.mutable_calibration()->set_copy_overlap(1.5);
  auto bad = CreatePlannerFromRequest(req, RequestLimits{}, {}, &node);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("calibration.copy_overlap"), std::string::npos)
      << bad.status().message();
}

// The host backend's per-tensor costs (issue 42) reach a daemon-planned session: the request's
// calibration.copy_host_us and rerun_host_us (else the daemon's calibration file's) go through
// the one calibration parser into the session planner's profile, and its plans are charged
// them: at a point that needs mitigating, with FP8 (which they do not charge) disallowed, every
// plan copies or reruns something, so the cheapest plan's overhead grows. A bad value is
// refused naming the field.
TEST(Registration, HostCostsReachTheSessionAndItsPlansAreChargedThem) {
  const int64_t in_use = 7300 * kMiB;  // a budget below keep-all (BudgetStepSplitsADefaultBucket)
  auto tight_overhead = [&](const pb::RegisterRequest& req, const nlohmann::json* node) {
    auto p = CreatePlannerFromRequest(req, RequestLimits{}, {}, node);
    EXPECT_TRUE(p.ok()) << p.status().message();
    if (!p.ok()) return std::pair{plan::HardwareProfile{}, plan::Plan{}};
    plan::SchedulePoint point;
    point.forward_micro_batch = 0;
    point.bytes_in_use = in_use;
    auto plan = (*p)->PlanPoint(point);
    EXPECT_TRUE(plan.ok()) << plan.status().message();
    return std::pair{(*p)->hardware(), plan.ok() ? *plan : plan::Plan{}};
  };
  pb::RegisterRequest req = TinyRegister(kMiB);
  req.set_disallow_fp8(true);
  const auto [hw0, free] = tight_overhead(req, nullptr);
  EXPECT_DOUBLE_EQ(hw0.copy_host_s, 0);
  EXPECT_DOUBLE_EQ(hw0.rerun_host_s, 0);
  ASSERT_FALSE(free.fallback_full_recompute);
  ASSERT_LT(free.predicted_bytes, free.keep_all_bytes) << "the point must need mitigating";
  req.mutable_calibration()->set_copy_host_us(120);
  req.mutable_calibration()->set_rerun_host_us(450);
  const auto [hw1, charged] = tight_overhead(req, nullptr);
  EXPECT_DOUBLE_EQ(hw1.copy_host_s, 120e-6);
  EXPECT_DOUBLE_EQ(hw1.rerun_host_s, 450e-6);
  EXPECT_GT(charged.overhead_s, free.overhead_s + 100e-6);
  // The daemon's calibration file's, where the request has none; the request's after it.
  const nlohmann::json node = {{"gpu", "h200"}, {"copy_host_us", 7}, {"rerun_host_us", 9}};
  pb::RegisterRequest bare = TinyRegister(kMiB);
  EXPECT_DOUBLE_EQ(tight_overhead(bare, &node).first.rerun_host_s, 9e-6);
  EXPECT_DOUBLE_EQ(tight_overhead(req, &node).first.copy_host_s, 120e-6);
  for (auto [field, value] :
       {std::pair{"calibration.copy_host_us", -1.0}, std::pair{"calibration.rerun_host_us", 2e6}}) {
    pb::RegisterRequest bad = TinyRegister(kMiB);
    if (std::string(field) == "calibration.copy_host_us") {
      bad.mutable_calibration()->set_copy_host_us(value);
    } else {
      bad.mutable_calibration()->set_rerun_host_us(value);
    }
    auto refused = CreatePlannerFromRequest(bad, RequestLimits{});
    ASSERT_FALSE(refused.ok()) << field;
    EXPECT_NE(refused.status().message().find(field), std::string::npos)
        << refused.status().message();
  }
}

// RegisterRequest.disallow_offload / disallow_fp8 (install(allow_fp8=False) against the daemon):
// they reach the session's planner, and its plans under pressure use neither strategy. On a
// machine whose FP8 cast costs next to nothing and whose recomputes are dear, the same point's
// plan stores in FP8 where only offloads are disallowed (the test would not tell otherwise).
TEST(Registration, DisallowedStrategiesReachThePlannerAndItsPlans) {
  auto uses = [](const plan::Plan& p, plan::Strategy s) {
    return std::count(p.strategies.begin(), p.strategies.end(), s) > 0;
  };
  pb::RegisterRequest req = TinyRegister(kMiB);
  pb::Calibration& cal = *req.mutable_calibration();
  cal.mutable_fp8_cast()->set_peak_gbps(1e4);
  cal.mutable_offload()->set_peak_gbps(0.01);
  cal.mutable_reload()->set_peak_gbps(0.01);
  cal.set_copy_overlap(0);
  cal.set_peak_tflops(0.01);
  cal.set_hbm_gbps(1);
  auto plan_tight = [&](bool offload, bool fp8) {
    req.set_disallow_offload(!offload);
    req.set_disallow_fp8(!fp8);
    auto p = CreatePlannerFromRequest(req, RequestLimits{});
    EXPECT_TRUE(p.ok()) << p.status().message();
    if (!p.ok()) return plan::Plan{};
    EXPECT_EQ((*p)->options().mitigation.allow_offload, offload);
    EXPECT_EQ((*p)->options().mitigation.allow_fp8, fp8);
    plan::SchedulePoint point;
    point.forward_micro_batch = 0;
    point.bytes_in_use = 7340 * kMiB;  // about 69 MiB of the tiny model's 94 MiB keep-all
    auto r = (*p)->PlanPoint(point);
    EXPECT_TRUE(r.ok()) << r.status().message();
    return r.ok() ? *r : plan::Plan{};
  };
  const plan::Plan fp8 = plan_tight(false, true);
  ASSERT_LT(fp8.budget_bytes, fp8.keep_all_bytes);
  EXPECT_TRUE(uses(fp8, plan::Strategy::kFp8));
  EXPECT_FALSE(uses(fp8, plan::Strategy::kOffload));
  const plan::Plan recompute_only = plan_tight(false, false);
  EXPECT_EQ(recompute_only.budget_bytes, fp8.budget_bytes);
  EXPECT_FALSE(uses(recompute_only, plan::Strategy::kFp8));
  EXPECT_FALSE(uses(recompute_only, plan::Strategy::kOffload));
  EXPECT_TRUE(uses(recompute_only, plan::Strategy::kRecompute));
  const plan::Plan no_fp8 = plan_tight(true, false);
  EXPECT_FALSE(uses(no_fp8, plan::Strategy::kFp8));
  EXPECT_TRUE(uses(no_fp8, plan::Strategy::kOffload) || uses(no_fp8, plan::Strategy::kRecompute));
}

}  // namespace
}  // namespace bgl::gov
