// The daemon's warm-up (issue 43): a RegisterRequest asks for it (warm_up, its spike bound
// checked); the sessions of one job with the same stage share its plans, so the second rank's
// first spike point is a warm hit of the first's warm-up, and the plans outlive the session that
// made them; another job shares nothing; the figures reach the plan responses, the process rows
// and the metrics. Also run under ThreadSanitizer (label tsan).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>

#include "governor/service/governor_core.h"
#include "governor/service/metrics.h"

namespace bgl::gov {
namespace {

namespace pb = bagualu::v1;

// GLM-423B-A30B (Table II) at 8 micro-batches on 48 GB (as the planner's Warmup.* tests).
pb::RegisterRequest Request(const std::string& job, double spike_bound) {
  std::ifstream in(std::string(BGL_MODELS_DIR) + "/glm-423b-a30b.json");
  std::stringstream ss;
  ss << in.rdbuf();
  nlohmann::json doc = nlohmann::json::parse(ss.str());
  doc["micro_batches"] = 8;
  pb::RegisterRequest reg;
  reg.set_gpu_uuid("host-0");
  reg.set_job_id(job);
  reg.set_model_json(doc.dump());
  reg.set_capacity_bytes(int64_t{48} * 1000 * 1000 * 1000);
  reg.mutable_warm_up()->set_spike_bound(spike_bound);
  return reg;
}

Caller Process(int pid) {
  Caller caller;
  caller.uid = 1000;
  caller.pid = pid;
  return caller;
}

// A forward of micro-batch 0 at `load` with room for 1.37 M0 more: a budget below keep-all.
pb::PlanRequest Point(const pb::RegisterResponse& session, double load) {
  pb::PlanRequest plan;
  plan.set_session_id(session.session_id());
  plan.set_forward_micro_batch(0);
  plan.set_load_factor(load);
  plan.set_bytes_in_use(session.activation_capacity_bytes() -
                        static_cast<int64_t>(1.37 * static_cast<double>(session.m0_bytes())));
  return plan;
}

// Bounded wait for the warm-up (not a timing assert: the bound only ends a hang).
constexpr int kPolls = 6000;
constexpr auto kPoll = std::chrono::milliseconds(10);

TEST(WarmUpHost, TheSecondRankOfAJobIsServedTheFirstRanksWarmPlans) {
  Metrics metrics;
  GovernorCore core(&metrics);
  const Caller first = Process(101), second = Process(102), other = Process(103);
  pb::RegisterResponse a, b, c;
  ASSERT_TRUE(core.Register(first, Request("job-1", 1.5), &a).ok());
  // The first point starts the warm-up; its budget is warmed at every load up to the bound.
  pb::PlanResponse planned;
  ASSERT_TRUE(core.Plan(first, Point(a, 1.0), &planned).ok());
  ASSERT_TRUE(planned.has_warm_up());
  ASSERT_LT(planned.plan().predicted_bytes(), planned.plan().keep_all_bytes());
  for (int i = 0; i < kPolls && !planned.warm_up().complete(); ++i) {
    std::this_thread::sleep_for(kPoll);
    ASSERT_TRUE(core.Plan(first, Point(a, 1.0), &planned).ok());
  }
  ASSERT_TRUE(planned.warm_up().complete());
  EXPECT_GT(planned.warm_up().done(), 0u);
  EXPECT_GT(planned.warm_up().cpu_s(), 0);
  EXPECT_GT(planned.warm_up().shared_keys(), 0u);

  // Rank 1 of the same job: its first point, a spike, is a warm hit of rank 0's warm-up.
  pb::RegisterRequest rank1 = Request("job-1", 1.5);
  rank1.set_gpu_index(1);
  ASSERT_TRUE(core.Register(second, rank1, &b).ok());
  pb::PlanResponse spiked;
  ASSERT_TRUE(core.Plan(second, Point(b, 1.4), &spiked).ok());
  ASSERT_LT(spiked.plan().predicted_bytes(), spiked.plan().keep_all_bytes());
  EXPECT_TRUE(spiked.plan().warm());
  EXPECT_EQ(spiked.warm_up().hits(), 1u);
  EXPECT_EQ(spiked.warm_up().shared_hits(), 1u);

  // Another job with the same model shares nothing: its first spike point is cold.
  ASSERT_TRUE(core.Register(other, Request("job-2", 1.5), &c).ok());
  pb::PlanResponse cold;
  ASSERT_TRUE(core.Plan(other, Point(c, 1.4), &cold).ok());
  EXPECT_FALSE(cold.plan().warm());
  EXPECT_EQ(cold.warm_up().hits(), 0u);
  EXPECT_EQ(cold.warm_up().shared_hits(), 0u);
  // Nor does another user's session naming the same job (issue 45 item 4: a job id is the
  // client's word; sharing would show it which plans this user's sessions met).
  Caller intruder = Process(104);
  intruder.uid = 1001;
  pb::RegisterResponse d;
  ASSERT_TRUE(core.Register(intruder, Request("job-1", 1.5), &d).ok());
  pb::PlanResponse foreign;
  ASSERT_TRUE(core.Plan(intruder, Point(d, 1.4), &foreign).ok());
  EXPECT_FALSE(foreign.plan().warm());
  EXPECT_EQ(foreign.warm_up().shared_hits(), 0u);

  // The figures reach Watch's process rows and the metrics.
  core.PublishMetrics();
  const std::string text = metrics.Text();
  EXPECT_NE(text.find("bagualu_warm_shared_hits 1"), std::string::npos) << text;
  EXPECT_NE(text.find("bagualu_warm_keys"), std::string::npos);
  EXPECT_NE(text.find("bagualu_warm_cpu_seconds"), std::string::npos);
  pb::WatchResponse sample;
  core.Sample(first, &sample);
  int rows = 0;
  for (const pb::GpuState& g : sample.gpus()) {
    for (const pb::ProcessRow& row : g.processes()) {
      ++rows;
      EXPECT_TRUE(row.has_warm_up());
      if (row.session().session_id() == b.session_id()) {
        EXPECT_EQ(row.warm_up().shared_hits(), 1u);
      }
    }
  }
  EXPECT_EQ(rows, 3);

  // Rank 0 ends: its plans stay with the job; rank 1's next spike, at another load, is warm.
  pb::UnregisterRequest unreg;
  unreg.set_session_id(a.session_id());
  pb::UnregisterResponse unregistered;
  ASSERT_TRUE(core.Unregister(first, unreg, &unregistered).ok());
  ASSERT_TRUE(core.Plan(second, Point(b, 1.3), &spiked).ok());
  EXPECT_TRUE(spiked.plan().warm());
  EXPECT_EQ(spiked.warm_up().shared_hits(), 2u);
}

TEST(WarmUpHost, ABadSpikeBoundIsRefusedNamingTheFieldAndTheRange) {
  GovernorCore core;
  for (double bad : {0.5, 65.0, -1.0, std::numeric_limits<double>::quiet_NaN(),
                     std::numeric_limits<double>::infinity()}) {
    pb::RegisterResponse resp;
    const grpc::Status s = core.Register(Process(104), Request("job-3", bad), &resp);
    ASSERT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad;
    EXPECT_NE(s.error_message().find("warm_up.spike_bound"), std::string::npos)
        << s.error_message();
    EXPECT_NE(s.error_message().find("[1, 64]"), std::string::npos) << s.error_message();
  }
  EXPECT_EQ(core.session_count(), 0u);
  // 0 is the default bound (3.0).
  pb::RegisterResponse resp;
  EXPECT_TRUE(core.Register(Process(104), Request("job-3", 0), &resp).ok());
}

// An old client (no warm_up field): no warm-up, no figures, as before.
TEST(WarmUpHost, WithoutTheFieldNothingWarms) {
  GovernorCore core;
  pb::RegisterRequest reg = Request("job-4", 1.5);
  reg.clear_warm_up();
  pb::RegisterResponse a;
  ASSERT_TRUE(core.Register(Process(105), reg, &a).ok());
  pb::PlanResponse planned;
  ASSERT_TRUE(core.Plan(Process(105), Point(a, 1.4), &planned).ok());
  EXPECT_FALSE(planned.has_warm_up());
  EXPECT_FALSE(planned.plan().warm());
}

}  // namespace
}  // namespace bgl::gov
