// The host backend's per-tensor costs (issue 42): the calibration's copy_host_us and
// rerun_host_us, read by the one calibration parser, charged by the cost model per offloaded
// tensor (each way) and per rerun operator, in the evaluator, the searches and the chains alike.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "governor/planner/assignment.h"
#include "governor/planner/dual_batch.h"
#include "governor/planner/mitigation.h"
#include "governor/planner/model_config.h"

namespace bgl::plan {
namespace {

class HostCostsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto c = LoadModelConfig(std::string(BGL_MODELS_DIR) + "/glm-423b-a30b.json");
    ASSERT_TRUE(c.ok());
    config_ = *c;
    hw_ = *HardwareProfileByName("paper");
    graph_ = *BuildStageGraph(config_, hw_);
  }
  Assignment KeepAll() const { return Assignment(graph_.ops.size(), Strategy::kKeep); }
  // Offloads what can be offloaded, one operator in two; recomputes the others that can be.
  Assignment Mixed(const CostEvaluator& eval) const {
    Assignment a = KeepAll();
    for (size_t o = 0; o < a.size(); ++o) {
      const int op = static_cast<int>(o);
      if (o % 2 == 0 && eval.Allowed(op, Strategy::kOffload)) {
        a[o] = Strategy::kOffload;
      } else if (eval.Allowed(op, Strategy::kRecompute)) {
        a[o] = Strategy::kRecompute;
      }
    }
    return a;
  }

  ModelConfig config_;
  HardwareProfile hw_;
  StageGraph graph_;
};

TEST_F(HostCostsTest, CalibrationReadsThemAndRefusesBadValuesByName) {
  HardwareProfile p = hw_;
  ASSERT_TRUE(
      ApplyCalibration(nlohmann::json{{"copy_host_us", 120}, {"rerun_host_us", 450}}, p).ok());
  EXPECT_DOUBLE_EQ(p.copy_host_s, 120e-6);
  EXPECT_DOUBLE_EQ(p.rerun_host_s, 450e-6);
  EXPECT_DOUBLE_EQ(p.RerunTime(1e-3), 1e-3 + 450e-6);
  EXPECT_DOUBLE_EQ(p.CopyHostTime(), 240e-6);
  // Optional: a profile without them charges nothing.
  EXPECT_DOUBLE_EQ(hw_.copy_host_s, 0);
  EXPECT_DOUBLE_EQ(hw_.rerun_host_s, 0);
  for (const auto& [doc, field] :
       {std::pair{nlohmann::json{{"copy_host_us", -1}}, "copy_host_us"},
        std::pair{nlohmann::json{{"rerun_host_us", 2e6}}, "rerun_host_us"},
        std::pair{nlohmann::json{{"rerun_host_us", "fast"}}, "rerun_host_us"}}) {
    HardwareProfile q = hw_;
    const Status s = ApplyCalibration(doc, q);
    ASSERT_FALSE(s.ok()) << doc.dump();
    EXPECT_NE(s.message().find(field), std::string::npos) << s.message();
  }
}

TEST_F(HostCostsTest, EvaluatorChargesEachCopyBothWaysAndEachRerun) {
  const CostEvaluator plain(graph_, hw_);
  HardwareProfile costly = hw_;
  costly.copy_host_s = 1e-4;
  costly.rerun_host_s = 3e-4;
  const CostEvaluator host(graph_, costly);
  const Assignment a = Mixed(plain);
  int offloaded = 0;
  for (size_t t = 0; t < graph_.tensors.size(); ++t) {
    const SavedTensor& x = graph_.tensors[t];
    if ((!x.savers.empty() || x.block_input) &&
        plain.TensorPlacement(a, static_cast<int>(t)) == Placement::kHost) {
      ++offloaded;
    }
  }
  int reruns = 0;
  for (char r : plain.RecomputeClosure(a)) reruns += r ? 1 : 0;
  ASSERT_GT(offloaded, 0);
  ASSERT_GT(reruns, 0);
  const AssignmentCost c0 = plain.Evaluate(a, 1.0), c1 = host.Evaluate(a, 1.0);
  EXPECT_DOUBLE_EQ(c0.copy_host_s, 0);
  EXPECT_NEAR(c1.copy_host_s, offloaded * 2e-4, 1e-12);
  EXPECT_NEAR(c1.recompute_s - c0.recompute_s, reruns * 3e-4, 1e-12);
  EXPECT_NEAR(c1.exposed_s - c0.exposed_s, offloaded * 2e-4 + reruns * 3e-4, 1e-9);
  // Keep-all copies and reruns nothing: nothing charged.
  EXPECT_DOUBLE_EQ(host.Evaluate(KeepAll(), 1.0).exposed_s, 0);
}

TEST_F(HostCostsTest, ChainsCarryTheSameCostsOnCompute) {
  HardwareProfile costly = hw_;
  costly.copy_host_s = 1e-4;
  costly.rerun_host_s = 3e-4;
  const CostEvaluator plain(graph_, hw_), host(graph_, costly);
  const Assignment a = Mixed(plain);
  auto compute = [](const Chains& chains, int chain) {
    double s = 0;
    for (const ChainStage& st : chains[chain]) {
      if (st.resource == Resource::kCompute || st.resource == Resource::kComm) s += st.duration_s;
    }
    return s;
  };
  PointUnits u;
  u.forward = u.backward = u.offload = u.recover = &a;
  const Chains c0 = BuildChains(plain, u), c1 = BuildChains(host, u);
  const AssignmentCost cost = host.Evaluate(a, 1.0);
  int reruns = 0;
  for (char r : plain.RecomputeClosure(a)) reruns += r ? 1 : 0;
  // Each offloaded tensor: its offload issued in the forward, its reload taken in the backward.
  EXPECT_NEAR(compute(c1, 0) - compute(c0, 0), cost.copy_host_s / 2, 1e-9);
  EXPECT_NEAR(compute(c1, 1) - compute(c0, 1), cost.copy_host_s / 2, 1e-9);
  EXPECT_NEAR(compute(c1, 3) - compute(c0, 3), reruns * 3e-4, 1e-9);
}

TEST_F(HostCostsTest, CostlyCopiesTurnTheSearchAwayFromOffloading) {
  // A budget that needs mitigation: the search's plan offloads where copies are free and
  // offloads fewer tensors once each costs more than the whole forward.
  MitigationOptions options;
  options.allow_fp8 = false;
  const double budget = graph_.M0(1.0) + 0.4 * (graph_.KeepAllBytes(1.0) - graph_.M0(1.0));
  auto offloads = [&](const HardwareProfile& hw) {
    const CostEvaluator eval(graph_, hw);
    const auto r = SelectMitigation(eval, 1.0, budget, options);
    EXPECT_TRUE(r.ok()) << r.status().message();
    int n = 0;
    for (Strategy s : r->assignment) n += s == Strategy::kOffload ? 1 : 0;
    return n;
  };
  HardwareProfile costly = hw_;
  costly.copy_host_s = 10 * graph_.ForwardTime(1.0);
  const int cheap = offloads(hw_);
  ASSERT_GT(cheap, 0);
  EXPECT_LT(offloads(costly), cheap);
}

}  // namespace
}  // namespace bgl::plan
