// Several callers drive the daemon's handlers at once, as gRPC's thread pool does: every caller
// registers, plans, reports and unregisters its own sessions while a dashboard samples, an
// operator lists sessions and the reaper runs. Run under ThreadSanitizer (label tsan); the
// handlers are tested without gRPC because Debian's libgrpc is not built with TSan.
#include <gtest/gtest.h>

#include <atomic>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "governor/service/governor_core.h"
#include "tests/unit/governor/tiny_model.h"

namespace bgl::gov {
namespace {

namespace pb = bagualu::v1;

using testing::TinyModel;

void CallersDashboardsAndReaper(GovernorCore& core) {
  const std::string model = TinyModel();
  constexpr int kWorkers = 4;
  constexpr int kRounds = 3;
  std::atomic<bool> done{false};
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < kWorkers; ++w) {
    threads.emplace_back([&, w] {
      Caller caller;
      caller.uid = 1000 + static_cast<uint32_t>(w % 2);
      caller.pid = 4000 + w;
      for (int round = 0; round < kRounds; ++round) {
        pb::RegisterRequest reg;
        reg.set_gpu_uuid("host-" + std::to_string(w % 2));
        reg.set_gpu_index(w % 2);
        reg.set_model_json(model);
        reg.set_capacity_bytes(int64_t{2} << 30);
        reg.set_pipeline_rank(w % 4);
        pb::RegisterResponse registered;
        if (!core.Register(caller, reg, &registered).ok()) {
          ++failures;
          continue;
        }
        for (int mb = 0; mb < registered.micro_batches(); ++mb) {
          pb::PlanRequest plan;
          plan.set_session_id(registered.session_id());
          plan.set_forward_micro_batch(mb);
          plan.set_load_factor(mb % 3 == 0 ? 2.6 : 1.0);
          pb::PlanResponse planned;
          if (!core.Plan(caller, plan, &planned).ok()) {
            ++failures;
            continue;
          }
          pb::ReportRequest report;
          report.set_session_id(registered.session_id());
          report.set_micro_batch(mb);
          report.set_actual_bytes(planned.plan().predicted_bytes());
          report.mutable_stats()->set_allocated_bytes(planned.plan().predicted_bytes());
          pb::ReportResponse reported;
          if (!core.Report(caller, report, &reported).ok()) ++failures;
        }
        pb::UnregisterRequest unreg;
        unreg.set_session_id(registered.session_id());
        pb::UnregisterResponse unregistered;
        if (!core.Unregister(caller, unreg, &unregistered).ok()) ++failures;
      }
    });
  }
  // A dashboard, an operator and the reaper, until the workers finish.
  std::thread observers([&] {
    Caller admin;
    admin.uid = 0;
    admin.admin = true;
    while (!done.load()) {
      pb::WatchResponse sample;
      core.Sample(admin, &sample);
      pb::ListSessionsResponse list;
      (void)core.ListSessions(admin, pb::ListSessionsRequest{}, &list);
      (void)core.Reap([](int32_t) { return true; });
      core.PublishMetrics();
    }
  });
  for (auto& t : threads) t.join();
  done.store(true);
  observers.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(core.session_count(), 0u);
}

TEST(GovernorCoreConcurrency, CallersDashboardsAndReaperAtOnce) {
  GovernorCore core;
  CallersDashboardsAndReaper(core);
}

// The same with the node's arbiter (issue 14): grants, shares and offloading marks change under
// every call while the dashboard, the metrics and the reaper read them.
TEST(GovernorCoreConcurrency, WithTheNodesArbiter) {
  NodeConfig node;
  node.host_budget_bytes = int64_t{1} << 30;
  node.host_floor_bytes = int64_t{16} << 20;
  node.max_sessions = 8;
  node.links = {{{0, 1}, 0}};
  auto arbiter = NodeArbiter::Create(node);
  ASSERT_TRUE(arbiter.ok());
  Metrics metrics;
  GovernorCore core(&metrics, RequestLimits{}, std::move(arbiter).value());
  CallersDashboardsAndReaper(core);
  EXPECT_TRUE(core.HostGrants().empty());
}

}  // namespace
}  // namespace bgl::gov
