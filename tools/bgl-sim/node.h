// Node mode of bgl-sim (issue 14): the GPUs of one node, each a pipeline stage running BaGuaLu
// (L4), sharing the node's pinned host memory and host links. Two modes side by side:
// per-process planning (every GPU plans as if alone: its own pinned pool, its link's full
// bandwidth) and node arbitration (every plan gets its NodeArbiter grant as the host limit and
// the link's bandwidth share at that point). Reality is the same for both: offloads on one link
// at the same point divide its bandwidth, and pinned bytes beyond the node budget cannot be had.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "governor/common/node_arbiter.h"
#include "tools/bgl-sim/load_trace.h"
#include "tools/bgl-sim/point_schedule.h"
#include "tools/bgl-sim/simulator.h"

namespace bgl::sim {

// The node: budget, topology and the stage each GPU runs. A plain value.
struct NodeSpec {
  std::string source;  // the file, for messages
  int gpus = 8;
  int64_t host_budget_bytes = 0;                  // pinned host memory the node can give
  int64_t host_floor_bytes = 0;                   // arbitration: least grant per GPU
  int64_t pinned_pool_bytes = int64_t{16} << 30;  // per-process planning: each GPU's own pool
  std::vector<gov::NodeLink> links;               // peak 0: the GPU profile's offload peak
  std::vector<int> ranks;                         // pipeline rank per GPU; empty: g mod PP
};

// Parses a node document (keys: gpus, host_budget, host_floor, pinned_pool, links: [{gpus: [..],
// peak_GBps}], ranks). Errors name the field; unknown keys are errors.
Result<NodeSpec> NodeSpecFromJson(const nlohmann::json& doc, const std::string& source);
// Reads a .json, .yaml or .yml node file.
Result<NodeSpec> LoadNodeSpec(const std::string& path);

// How the node's GPUs plan. A plain value.
enum class NodeMode {
  kPerProcess,  // each GPU plans alone: pinned_pool bytes of host, full link bandwidth
  kArbitrated,  // each GPU plans within its NodeArbiter grant and bandwidth share
};
const char* NodeModeName(NodeMode m);

// One iteration of the node. A plain value.
struct NodeIteration {
  int iteration = 0;
  double max_load = 1;
  bool spike = false;
  double time_s = 0;         // wall time: the run plus, after an OOM, lost work and restart
  double run_s = 0;          // the pipeline's iteration as it ran (shared link bandwidth)
  double planned_run_s = 0;  // the same iteration at the bandwidth the plans assumed
  bool oom = false;          // some GPU exceeded its activation capacity
  double wasted_s = 0;
  double restart_s = 0;
  int failed_offloads = 0;      // forwards whose host bytes did not fit in the node budget
  double failed_bytes = 0;      // bytes that stayed on the device instead
  double host_demand_peak = 0;  // most host bytes the plans wanted at once, whole node
  double host_pinned_peak = 0;  // most host bytes pinned at once (never above the budget)
  int link_offloaders_max = 0;  // most GPUs moving bytes over one link at one point
};

// Totals of one mode. A plain value.
struct NodeSummary {
  NodeMode mode = NodeMode::kPerProcess;
  int gpus = 0;
  int iterations = 0;
  double total_s = 0;
  double mean_s = 0;
  double p99_s = 0;
  double mean_run_s = 0;      // without restarts
  double overlap_lost_s = 0;  // sum over iterations of run_s - planned_run_s
  int ooms = 0;
  int failed_offloads = 0;
  double failed_bytes = 0;
  double host_budget_bytes = 0;
  double host_demand_peak = 0;
  double host_pinned_peak = 0;
  double host_limit_bytes = 0;  // per GPU: the pool (per-process) or the smallest grant
  int link_offloaders_max = 0;
  double link_offloaders_mean = 0;  // mean over (point, link) with at least one GPU moving bytes
  double recompute_share = 0;       // recompute FLOPs over useful FLOPs, whole node
};

// Simulates the node's GPUs through the iterations of a trace with one row per GPU.
// Not thread-safe; one per mode.
class NodeSimulator {
 public:
  // `config.ranks` is ignored: the node says which stage each GPU runs. Errors name the field.
  static Result<std::unique_ptr<NodeSimulator>> Create(const SimConfig& config,
                                                       const NodeSpec& node, NodeMode mode);
  ~NodeSimulator();

  Result<NodeIteration> Step(const LoadTrace& trace, int iteration);
  NodeSummary Summary() const;
  const std::vector<NodeIteration>& records() const { return records_; }
  const std::vector<int64_t>& host_limits() const { return host_limits_; }

 private:
  struct Gpu;
  NodeSimulator(const SimConfig& config, const NodeSpec& node, NodeMode mode);

  SimConfig config_;
  NodeSpec node_;
  NodeMode mode_;
  std::unique_ptr<gov::NodeArbiter> arbiter_;
  std::vector<std::unique_ptr<Gpu>> gpus_;
  std::vector<int64_t> host_limits_;
  std::vector<NodeIteration> records_;
  double useful_ = 0, recompute_ = 0;
  long link_busy_points_ = 0;
  long link_offloaders_sum_ = 0;
};

// The side-by-side table and its JSON.
std::string FormatNodeTable(const std::vector<NodeSummary>& modes);
nlohmann::json NodeSummariesToJson(const std::vector<NodeSummary>& modes);

}  // namespace bgl::sim
