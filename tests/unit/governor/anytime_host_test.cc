// The anytime path (issue 23) through both hosts: the daemon's handlers (GovernorCore, without
// gRPC) and the in-process EmbeddedGovernor answer a large chunk's plan-cache miss with the first
// answer, flagged in the plan; the same point planned again gets the refined plan once the
// background search landed; a session unregistered with a refinement in flight goes cleanly.
// Also run under ThreadSanitizer (label tsan).
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "governor/client/embedded_governor.h"
#include "governor/service/governor_core.h"

namespace bgl::gov {
namespace {

namespace pb = bagualu::v1;

// GLM-423B-A30B (Table II) with 80 layers: 5 layers of 14 operators per chunk, 70 operators, over
// the planner's anytime_min_ops (64).
std::string LargeChunkModel() {
  std::ifstream in(std::string(BGL_MODELS_DIR) + "/glm-423b-a30b.json");
  std::stringstream ss;
  ss << in.rdbuf();
  nlohmann::json doc = nlohmann::json::parse(ss.str());
  doc["layers"] = 80;
  doc["vp"] = 5;  // layers per virtual stage: 10 per rank, two chunks of 5
  return doc.dump();
}

constexpr int64_t kCapacity = int64_t{141} * 1000 * 1000 * 1000;
// Bounded waits for the background search (not a timing assert: the bound only ends a hang).
constexpr int kPolls = 4000;
constexpr auto kPoll = std::chrono::milliseconds(5);

TEST(AnytimeHosts, TheDaemonAnswersWithTheFirstAnswerThenTheRefinedPlan) {
  GovernorCore core;
  Caller caller;
  caller.uid = 1000;
  caller.pid = 4242;
  pb::RegisterRequest reg;
  reg.set_gpu_uuid("host-0");
  reg.set_model_json(LargeChunkModel());
  reg.set_capacity_bytes(kCapacity);
  pb::RegisterResponse registered;
  ASSERT_TRUE(core.Register(caller, reg, &registered).ok());
  ASSERT_GE(registered.operator_names_size(), 64);
  pb::PlanRequest plan;
  plan.set_session_id(registered.session_id());
  plan.set_forward_micro_batch(0);
  plan.set_load_factor(2.6);
  // Little free memory: a budget between M0 and keep-all.
  plan.set_bytes_in_use(registered.activation_capacity_bytes() - 3 * registered.m0_bytes() / 2);
  pb::PlanResponse first;
  ASSERT_TRUE(core.Plan(caller, plan, &first).ok());
  ASSERT_TRUE(first.plan().first_answer());
  EXPECT_FALSE(first.plan().refined());
  EXPECT_FALSE(first.plan().cache_hit());
  EXPECT_LE(first.plan().predicted_bytes(), first.plan().budget_bytes());
  pb::PlanResponse again;
  for (int i = 0; i < kPolls; ++i) {
    ASSERT_TRUE(core.Plan(caller, plan, &again).ok());
    ASSERT_EQ(again.plan().budget_bytes(), first.plan().budget_bytes());  // the same key
    if (again.plan().refined()) break;
    EXPECT_TRUE(again.plan().first_answer());
    std::this_thread::sleep_for(kPoll);
  }
  ASSERT_TRUE(again.plan().refined());
  EXPECT_FALSE(again.plan().first_answer());
  EXPECT_LE(again.plan().overhead_s(), first.plan().overhead_s());
  EXPECT_LE(again.plan().predicted_bytes(), again.plan().budget_bytes());
  // A miss of another key, then Unregister while its refinement runs.
  plan.set_load_factor(1.0);
  pb::PlanResponse other;
  ASSERT_TRUE(core.Plan(caller, plan, &other).ok());
  pb::UnregisterRequest unreg;
  unreg.set_session_id(registered.session_id());
  pb::UnregisterResponse unregistered;
  EXPECT_TRUE(core.Unregister(caller, unreg, &unregistered).ok());
  EXPECT_EQ(core.session_count(), 0u);
}

TEST(AnytimeHosts, TheEmbeddedPlannerAnswersWithTheFirstAnswerThenTheRefinedPlan) {
  EmbeddedGovernor governor;
  Registration reg;
  reg.model_json = LargeChunkModel();
  reg.capacity_bytes = kCapacity;
  auto session = governor.Register(reg);
  ASSERT_TRUE(session.ok()) << session.status().message();
  plan::SchedulePoint point;
  point.forward_micro_batch = 0;
  point.load_factor = 2.6;
  point.bytes_in_use = session->activation_capacity_bytes - 3 * session->m0_bytes / 2;
  auto first = governor.Plan(session->session_id, point);
  ASSERT_TRUE(first.ok()) << first.status().message();
  ASSERT_TRUE(first->first_answer);
  EXPECT_FALSE(first->refined);
  Result<plan::Plan> again = first;
  for (int i = 0; i < kPolls; ++i) {
    again = governor.Plan(session->session_id, point);
    ASSERT_TRUE(again.ok());
    if (again->refined) break;
    std::this_thread::sleep_for(kPoll);
  }
  ASSERT_TRUE(again->refined);
  EXPECT_FALSE(again->first_answer);
  EXPECT_LE(again->overhead_s, first->overhead_s);
  // Unregister with a refinement in flight, then a second session planning at once.
  point.load_factor = 1.0;
  ASSERT_TRUE(governor.Plan(session->session_id, point).ok());
  EXPECT_TRUE(governor.Unregister(session->session_id).ok());
  auto second = governor.Register(reg);
  ASSERT_TRUE(second.ok());
  ASSERT_TRUE(governor.Plan(second->session_id, point).ok());
  EXPECT_TRUE(governor.Unregister(second->session_id).ok());
}

}  // namespace
}  // namespace bgl::gov
