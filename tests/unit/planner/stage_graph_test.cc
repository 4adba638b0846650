#include "governor/planner/stage_graph.h"

#include <gtest/gtest.h>

namespace bgl::plan {
namespace {

StageGraph Glm423() {
  auto c = LoadModelConfig(std::string(BGL_MODELS_DIR) + "/glm-423b-a30b.json");
  auto hw = HardwareProfileByName("paper");
  auto g = BuildStageGraph(*c, *hw);
  EXPECT_TRUE(g.ok()) << g.status().message();
  return *g;
}

const SavedTensor& Tensor(const StageGraph& g, const std::string& name) {
  for (const auto& t : g.tensors) {
    if (t.name == name) return t;
  }
  ADD_FAILURE() << "no tensor " << name;
  return g.tensors.front();
}

TEST(StageGraph, HasTheOperatorsOfAFineGrainedMoeBlock) {
  const StageGraph g = Glm423();
  EXPECT_EQ(g.layers, 2);
  for (const char* op : {"attn_norm", "qkv_proj", "core_attn", "out_proj", "moe_norm", "router",
                         "dispatch", "expert_fc1", "expert_act", "expert_fc2", "combine",
                         "shared_fc1", "shared_act", "shared_fc2"}) {
    EXPECT_GE(g.FindOp(std::string("L1.") + op), 0) << op;
  }
}

TEST(StageGraph, SharedTensorsHaveSeveralConsumers) {
  const StageGraph g = Glm423();
  const auto& moe_in = Tensor(g, "L0.moe_in");
  ASSERT_EQ(moe_in.savers.size(), 2u);
  EXPECT_EQ(g.ops[moe_in.savers[0]].name, "L0.router");
  EXPECT_EQ(g.ops[moe_in.savers[1]].name, "L0.shared_fc1");
  const auto& attn = Tensor(g, "L0.attn_out");
  ASSERT_EQ(attn.savers.size(), 2u);
  EXPECT_EQ(g.ops[attn.savers[1]].name, "L0.out_proj");
}

TEST(StageGraph, ExpertTensorsAndTimesScaleWithLoad) {
  const StageGraph g = Glm423();
  const auto& disp = Tensor(g, "L0.dispatched");
  EXPECT_TRUE(disp.scales_with_load);
  EXPECT_DOUBLE_EQ(disp.Bytes(2.6), 2.6 * static_cast<double>(disp.bytes));
  EXPECT_FALSE(Tensor(g, "L0.qkv").scales_with_load);
  const auto& fc1 = g.ops[g.FindOp("L0.expert_fc1")];
  EXPECT_DOUBLE_EQ(fc1.ForwardTime(2.0), 2 * fc1.forward_s);
  EXPECT_GT(g.KeepAllBytes(2.6), g.KeepAllBytes(1.0));
  EXPECT_EQ(g.M0(2.6), g.M0(1.0));  // block inputs do not depend on routing
}

TEST(StageGraph, BytesFollowTheShapes) {
  const StageGraph g = Glm423();
  // seq 4096, tp 2 (sequence parallel: 2048 local tokens), hidden 8192, bf16.
  EXPECT_EQ(Tensor(g, "L0.moe_in").bytes, int64_t{2048} * 8192 * 2);
  // top-6 routing: 2048 * 6 expert rows; gated FC1 output is 2 x moe_hidden wide.
  EXPECT_EQ(Tensor(g, "L0.expert_fc1_out").bytes, int64_t{2048} * 6 * 2 * 4096 * 2);
  EXPECT_EQ(Tensor(g, "L0.router_probs").dtype, DType::kFP32);
}

}  // namespace
}  // namespace bgl::plan
