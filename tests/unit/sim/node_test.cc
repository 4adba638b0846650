#include "tools/bgl-sim/node.h"

#include <gtest/gtest.h>

#include <fstream>
#include <numeric>
#include <string>

#include "tools/bgl-sim/options.h"

namespace bgl::sim {
namespace {

const std::string kModels = BGL_MODELS_DIR;
constexpr int64_t kMiB = int64_t{1} << 20;

SimConfig TinyConfig() {
  // Long sequences and a small device make the tiny model offload.
  auto options = ParseOptions(
      {"--model", kModels + "/tiny-moe.json", "--seq-len", "2048", "--capacity", "1GB"});
  EXPECT_TRUE(options.ok()) << options.status().message();
  auto config = BuildConfig(*options);
  EXPECT_TRUE(config.ok()) << config.status().message();
  return *config;
}

// Four GPUs (tiny-moe has PP 4) on one link, each process alone would pin 1 GiB.
NodeSpec TinyNode(int64_t budget) {
  NodeSpec n;
  n.source = "test-node";
  n.gpus = 4;
  n.host_budget_bytes = budget;
  n.pinned_pool_bytes = 1024 * kMiB;
  n.links = {gov::NodeLink{{0, 1, 2, 3}, 0}};
  return n;
}

LoadTrace SpikyTrace(const SimConfig& c, int iterations, int gpus, bool synchronized) {
  LoadSpec spec;
  spec.spike_prob = 0.5;
  spec.seed = 5;
  spec.synchronized = synchronized;
  auto trace = GenerateLoads(spec, iterations, gpus, static_cast<int>(c.model.MicroBatches()));
  EXPECT_TRUE(trace.ok());
  return *trace;
}

NodeSummary RunNode(const SimConfig& config, const NodeSpec& node, NodeMode mode,
                    const LoadTrace& trace) {
  auto sim = NodeSimulator::Create(config, node, mode);
  EXPECT_TRUE(sim.ok()) << sim.status().message();
  if (!sim.ok()) return {};
  for (int it = 0; it < trace.iterations(); ++it) {
    auto rec = (*sim)->Step(trace, it);
    EXPECT_TRUE(rec.ok()) << rec.status().message();
    if (mode == NodeMode::kArbitrated && rec.ok()) {
      EXPECT_LE(rec->host_demand_peak, static_cast<double>(node.host_budget_bytes)) << it;
    }
  }
  if (mode == NodeMode::kArbitrated) {
    const auto& limits = (*sim)->host_limits();
    EXPECT_LE(std::accumulate(limits.begin(), limits.end(), int64_t{0}), node.host_budget_bytes);
  }
  return (*sim)->Summary();
}

TEST(NodeTest, ArbitrationStaysInTheBudgetWherePerProcessPlanningDoesNot) {
  const SimConfig config = TinyConfig();
  const NodeSpec node = TinyNode(64 * kMiB);
  const LoadTrace trace = SpikyTrace(config, 6, node.gpus, /*synchronized=*/true);
  const NodeSummary alone = RunNode(config, node, NodeMode::kPerProcess, trace);
  const NodeSummary arbitrated = RunNode(config, node, NodeMode::kArbitrated, trace);
  ASSERT_EQ(alone.iterations, 6);
  ASSERT_EQ(arbitrated.iterations, 6);
  // Per-process plans want more pinned memory than the node has, and their copies share a link
  // they planned as their own: failed offloads or iterations slower than planned.
  EXPECT_GT(alone.host_demand_peak, alone.host_budget_bytes);
  EXPECT_GT(alone.failed_offloads, 0);
  EXPECT_GT(alone.overlap_lost_s, 0);  // copies planned at full speed shared the link
  EXPECT_GT(alone.link_offloaders_max, 1);
  // Arbitrated plans fit the node: nothing fails, nothing crashes, and the iterations are no
  // slower. (Pinned memory within the budget and no lost overlap hold by construction of the
  // simulator: the grants bound the pool, and a plan assumes the share its copies then get.)
  EXPECT_LE(arbitrated.host_demand_peak, arbitrated.host_budget_bytes);
  EXPECT_EQ(arbitrated.failed_offloads, 0);
  EXPECT_EQ(arbitrated.ooms, 0);
  EXPECT_LE(arbitrated.mean_s, alone.mean_s);
}

TEST(NodeTest, AmpleBudgetMeansNoFailures) {
  const SimConfig config = TinyConfig();
  const NodeSpec node = TinyNode(4096 * kMiB);
  const LoadTrace trace = SpikyTrace(config, 4, node.gpus, /*synchronized=*/true);
  for (NodeMode mode : {NodeMode::kPerProcess, NodeMode::kArbitrated}) {
    const NodeSummary s = RunNode(config, node, mode, trace);
    EXPECT_EQ(s.failed_offloads, 0) << NodeModeName(mode);
    EXPECT_EQ(s.ooms, 0) << NodeModeName(mode);
    EXPECT_LE(s.host_pinned_peak, s.host_budget_bytes);
    EXPECT_GT(s.host_pinned_peak, 0) << NodeModeName(mode) << ": the scenario must offload";
  }
}

TEST(NodeTest, SynchronizedSpikesHitEveryRankAtOnce) {
  LoadSpec spec;
  spec.spike_prob = 1;
  spec.seed = 11;
  auto together = GenerateLoads(spec, 20, 8, 16);
  spec.synchronized = false;
  auto apart = GenerateLoads(spec, 20, 8, 16);
  ASSERT_TRUE(together.ok() && apart.ok());
  bool differ = false;
  for (int it = 0; it < 20; ++it) {
    for (int mb = 0; mb < 16; ++mb) {
      const bool spiked = together->loads[it][0][mb] >= spec.normal_max;
      for (int rank = 1; rank < 8; ++rank) {
        EXPECT_EQ(together->loads[it][rank][mb] >= spec.normal_max, spiked);
        differ |= (apart->loads[it][rank][mb] >= spec.normal_max) !=
                  (apart->loads[it][0][mb] >= spec.normal_max);
      }
    }
  }
  EXPECT_TRUE(differ);
}

Status Parse(const std::string& text) {
  auto doc = nlohmann::json::parse(text);
  auto spec = NodeSpecFromJson(doc, "node.json");
  return spec.ok() ? OkStatus() : spec.status();
}

TEST(NodeTest, ParsesAFile) {
  const std::string path = ::testing::TempDir() + "/node.yaml";
  std::ofstream(path) << "gpus: 8\nhost_budget: 64GiB\nhost_floor: 1GiB\npinned_pool: 8GiB\n"
                         "links:\n  - gpus: [0, 1, 2, 3]\n    peak_GBps: 25\n  - [4, 5, 6, 7]\n"
                         "ranks: [0, 1, 2, 3, 4, 5, 6, 7]\n";
  auto spec = LoadNodeSpec(path);
  ASSERT_TRUE(spec.ok()) << spec.status().message();
  EXPECT_EQ(spec->gpus, 8);
  EXPECT_EQ(spec->host_budget_bytes, int64_t{64} << 30);
  EXPECT_EQ(spec->host_floor_bytes, int64_t{1} << 30);
  EXPECT_EQ(spec->pinned_pool_bytes, int64_t{8} << 30);
  ASSERT_EQ(spec->links.size(), 2u);
  EXPECT_DOUBLE_EQ(spec->links[0].peak_bytes_per_s, 25e9);
  EXPECT_EQ(spec->links[1].gpus, (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(spec->ranks.size(), 8u);
}

TEST(NodeTest, BadFilesNameTheField) {
  const auto has = [](const Status& s, const std::string& field) {
    return s.message().find(field) != std::string::npos;
  };
  EXPECT_TRUE(has(Parse(R"({"gpus": 8})"), "host_budget"));
  EXPECT_TRUE(has(Parse(R"({"host_budget": "lots"})"), "host_budget"));
  EXPECT_TRUE(has(Parse(R"({"host_budget": "8GiB", "host_floor": "2GiB"})"), "host_floor"));
  EXPECT_TRUE(has(Parse(R"({"host_budget": "8GiB", "gpus": 0})"), "gpus"));
  EXPECT_TRUE(has(Parse(R"({"host_budget": "8GiB", "links": [[0, 9]]})"), "links[0].gpus"));
  EXPECT_TRUE(has(Parse(R"({"host_budget": "8GiB", "links": [[0, 1], [1]]})"), "links[1].gpus"));
  EXPECT_TRUE(has(Parse(R"({"host_budget": "8GiB", "links": [{"gpus": [0], "peak_GBps": -1}]})"),
                  "links[0].peak_GBps"));
  EXPECT_TRUE(has(Parse(R"({"host_budget": "8GiB", "links": [{"gpu": [0]}]})"), "links[0]"));
  EXPECT_TRUE(has(Parse(R"({"host_budget": "8GiB", "ranks": [0, 1]})"), "ranks"));
  EXPECT_TRUE(has(Parse(R"({"host_budget": "8GiB", "pinned_pool": 0})"), "pinned_pool"));
  EXPECT_TRUE(has(Parse(R"({"host_budget": "8GiB", "budget": 1})"), "unknown key 'budget'"));
  EXPECT_TRUE(has(LoadNodeSpec("/no/such/node.yaml").status(), "--node"));
  const std::string tiny = kModels + "/tiny-moe.json";
  EXPECT_TRUE(has(ParseOptions({"--model", tiny, "--spikes", "sometimes"}).status(), "--spikes"));
  EXPECT_TRUE(
      has(ParseOptions({"--model", tiny, "--node", "n.yaml", "--ranks", "0"}).status(), "--ranks"));
  auto spikes = ParseOptions({"--model", tiny, "--spikes", "independent", "--node", "n.yaml"});
  ASSERT_TRUE(spikes.ok()) << spikes.status().message();
  EXPECT_FALSE(spikes->load.synchronized);
  EXPECT_EQ(spikes->node_path, "n.yaml");
  // A rank outside the model's pipeline is found when the node meets the model.
  NodeSpec node = TinyNode(64 * kMiB);
  node.ranks = {0, 1, 2, 7};
  auto sim = NodeSimulator::Create(TinyConfig(), node, NodeMode::kArbitrated);
  ASSERT_FALSE(sim.ok());
  EXPECT_TRUE(has(sim.status(), "ranks[3]")) << sim.status().message();
}

}  // namespace
}  // namespace bgl::sim
