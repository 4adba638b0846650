#include "tools/bgl-sim/node.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>

#include "base/units.h"
#include "governor/planner/json_limits.h"
#include "governor/planner/model_config.h"
#include "tools/bgl-sim/static_plan.h"

namespace bgl::sim {
namespace {

// A byte count written as a number or as "64GiB".
Result<int64_t> Bytes(const nlohmann::json& v, const std::string& field) {
  if (v.is_number_integer() && v.get<int64_t>() >= 0) return v.get<int64_t>();
  if (v.is_number_float() && v.get<double>() >= 0 && v.get<double>() < 9e18) {
    return static_cast<int64_t>(v.get<double>());
  }
  if (v.is_string()) return ParseBytes(v.get<std::string>(), field);
  return InvalidArgument(field + ": must be a byte count (e.g. 64GiB or 68719476736)");
}

Result<int> Int(const nlohmann::json& v, const std::string& field, int lo, int hi) {
  if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > hi) {
    return InvalidArgument(field + ": must be an integer in [" + std::to_string(lo) + ", " +
                           std::to_string(hi) + "]");
  }
  return static_cast<int>(v.get<int64_t>());
}

Result<std::vector<int>> IntList(const nlohmann::json& v, const std::string& field, int lo,
                                 int hi) {
  if (!v.is_array()) return InvalidArgument(field + ": must be a list of integers");
  std::vector<int> out;
  for (size_t i = 0; i < v.size(); ++i) {
    auto n = Int(v[i], field + "[" + std::to_string(i) + "]", lo, hi);
    if (!n.ok()) return n.status();
    out.push_back(*n);
  }
  return out;
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = static_cast<size_t>(std::ceil(p * static_cast<double>(v.size()))) - 1;
  return v[std::min(i, v.size() - 1)];
}

}  // namespace

Result<NodeSpec> NodeSpecFromJson(const nlohmann::json& doc, const std::string& source) {
  if (!doc.is_object()) return InvalidArgument(source + ": a node file is a mapping of keys");
  NodeSpec n;
  n.source = source;
  const auto prefix = [&](const Status& s) { return InvalidArgument(source + ": " + s.message()); };
  bool budget_given = false;
  for (const auto& [key, v] : doc.items()) {
    if (key == "gpus") {
      auto g = Int(v, "gpus", 1, 64);
      if (!g.ok()) return prefix(g.status());
      n.gpus = *g;
    } else if (key == "host_budget" || key == "host_floor" || key == "pinned_pool") {
      auto b = Bytes(v, key);
      if (!b.ok()) return prefix(b.status());
      if (key == "host_budget") n.host_budget_bytes = *b, budget_given = true;
      if (key == "host_floor") n.host_floor_bytes = *b;
      if (key == "pinned_pool") n.pinned_pool_bytes = *b;
    } else if (key == "links") {
      if (!v.is_array()) return prefix(InvalidArgument("links: must be a list of links"));
      for (size_t i = 0; i < v.size(); ++i) {
        const std::string field = "links[" + std::to_string(i) + "]";
        const nlohmann::json& l = v[i];
        gov::NodeLink link;
        const nlohmann::json* gpus = &l;
        if (l.is_object()) {
          for (const auto& [lk, lv] : l.items()) {
            if (lk == "gpus") continue;
            if (lk != "peak_GBps") {
              return prefix(
                  InvalidArgument(field + ": unknown key '" + lk + "' (known: gpus, peak_GBps)"));
            }
            if (!lv.is_number() || !std::isfinite(lv.get<double>()) || lv.get<double>() <= 0 ||
                lv.get<double>() > 1e5) {
              return prefix(InvalidArgument(field + ".peak_GBps: must be a number in (0, 1e5]"));
            }
            link.peak_bytes_per_s = lv.get<double>() * 1e9;
          }
          if (!l.contains("gpus")) return prefix(InvalidArgument(field + ".gpus: missing"));
          gpus = &l["gpus"];
        }
        auto list = IntList(*gpus, field + ".gpus", 0, 1 << 20);
        if (!list.ok()) return prefix(list.status());
        if (list->empty()) return prefix(InvalidArgument(field + ".gpus: lists no GPU"));
        link.gpus = std::move(*list);
        n.links.push_back(std::move(link));
      }
    } else if (key == "ranks") {
      auto list = IntList(v, "ranks", 0, 1 << 20);
      if (!list.ok()) return prefix(list.status());
      n.ranks = std::move(*list);
    } else {
      return prefix(InvalidArgument("unknown key '" + key +
                                    "' (known: gpus, host_budget, host_floor, pinned_pool, "
                                    "links, ranks)"));
    }
  }
  if (!budget_given || n.host_budget_bytes <= 0) {
    return prefix(InvalidArgument("host_budget: required, a positive byte count"));
  }
  if (n.pinned_pool_bytes <= 0) return prefix(InvalidArgument("pinned_pool: must be positive"));
  if (n.host_floor_bytes > n.host_budget_bytes / n.gpus) {
    return prefix(InvalidArgument("host_floor: " + FormatBytes(n.host_floor_bytes, true) + " x " +
                                  std::to_string(n.gpus) + " GPUs is over host_budget (" +
                                  FormatBytes(n.host_budget_bytes, true) + ")"));
  }
  std::set<int> seen;
  for (size_t i = 0; i < n.links.size(); ++i) {
    for (int g : n.links[i].gpus) {
      const std::string field = "links[" + std::to_string(i) + "].gpus";
      if (g >= n.gpus) {
        return prefix(InvalidArgument(field + ": GPU " + std::to_string(g) +
                                      " is not on this node (gpus: " + std::to_string(n.gpus) +
                                      ")"));
      }
      if (!seen.insert(g).second) {
        return prefix(
            InvalidArgument(field + ": GPU " + std::to_string(g) + " is already on another link"));
      }
    }
  }
  if (!n.ranks.empty() && static_cast<int>(n.ranks.size()) != n.gpus) {
    return prefix(InvalidArgument("ranks: one pipeline rank per GPU needed (" +
                                  std::to_string(n.gpus) + "), got " +
                                  std::to_string(n.ranks.size())));
  }
  return n;
}

Result<NodeSpec> LoadNodeSpec(const std::string& path) {
  auto doc = plan::LoadJsonOrYaml(path, "--node: node file");
  if (!doc.ok()) return doc.status();
  return NodeSpecFromJson(*doc, path);
}

const char* NodeModeName(NodeMode m) {
  return m == NodeMode::kPerProcess ? "per-process" : "arbitrated";
}

// One GPU of the node: its planner and what the current iteration has done so far.
struct NodeSimulator::Gpu {
  std::unique_ptr<plan::StagePlanner> planner;
  std::vector<PointRef> points;
  int link = 0;                             // index into the node's links
  std::vector<double> host;                 // per unit: host bytes pinned now (accepted offloads)
  std::vector<std::vector<double>> device;  // [mb][chunk] retained on the device
  std::vector<PointSchedule> actual, planned;
  double pinned = 0;
};

NodeSimulator::NodeSimulator(const SimConfig& config, const NodeSpec& node, NodeMode mode)
    : config_(config), node_(node), mode_(mode) {}

NodeSimulator::~NodeSimulator() = default;

Result<std::unique_ptr<NodeSimulator>> NodeSimulator::Create(const SimConfig& config,
                                                             const NodeSpec& node, NodeMode mode) {
  BGL_RETURN_IF_ERROR(config.model.Validate());
  const int pp = static_cast<int>(config.model.pp);
  std::unique_ptr<NodeSimulator> sim(new NodeSimulator(config, node, mode));
  // Every GPU on a link: the ones the file leaves out get a link of their own.
  std::vector<int> link_of(node.gpus, -1);
  for (size_t i = 0; i < node.links.size(); ++i) {
    for (int g : node.links[i].gpus) link_of[g] = static_cast<int>(i);
  }
  for (int g = 0; g < node.gpus; ++g) {
    if (link_of[g] >= 0) continue;
    link_of[g] = static_cast<int>(sim->node_.links.size());
    sim->node_.links.push_back(gov::NodeLink{{g}, 0});
  }
  gov::NodeConfig nc;
  nc.host_budget_bytes = node.host_budget_bytes;
  nc.host_floor_bytes = node.host_floor_bytes;
  nc.max_sessions = node.gpus;
  nc.links = sim->node_.links;
  auto arbiter = gov::NodeArbiter::Create(nc);
  if (!arbiter.ok()) return InvalidArgument(node.source + ": " + arbiter.status().message());
  sim->arbiter_ = std::make_unique<gov::NodeArbiter>(std::move(*arbiter));
  for (int g = 0; g < node.gpus; ++g) {
    const int rank = node.ranks.empty() ? g % pp : node.ranks[g];
    if (rank >= pp) {
      return InvalidArgument(node.source + ": ranks[" + std::to_string(g) + "]: rank " +
                             std::to_string(rank) + " is outside [0, " + std::to_string(pp) +
                             ") (the model's PP)");
    }
    plan::PlannerOptions options;
    options.capacity_bytes = config.capacity_bytes;
    options.pipeline_rank = rank;
    options.issue_policy = plan::IssuePolicy::kDualBatch;
    options.schedule_load_class = config.schedule_load_class;
    auto planner = plan::StagePlanner::Create(config.model, config.hw, options);
    if (!planner.ok()) return planner.status();
    auto gpu = std::make_unique<Gpu>();
    gpu->planner = std::move(*planner);
    gpu->points = GroupPoints(gpu->planner->steps());
    gpu->link = link_of[g];
    // Every process asks for the pool it would have had alone (the arbiter refuses requests
    // over the whole budget, so at most that).
    auto grant = sim->arbiter_->Register(static_cast<uint64_t>(g + 1), g,
                                         std::min(node.pinned_pool_bytes, node.host_budget_bytes));
    if (!grant.ok()) return InvalidArgument(node.source + ": " + grant.status().message());
    sim->gpus_.push_back(std::move(gpu));
  }
  for (int g = 0; g < node.gpus; ++g) {
    sim->host_limits_.push_back(mode == NodeMode::kPerProcess
                                    ? node.pinned_pool_bytes
                                    : sim->arbiter_->Grant(static_cast<uint64_t>(g + 1)));
  }
  return sim;
}

Result<NodeIteration> NodeSimulator::Step(const LoadTrace& trace, int iteration) {
  if (iteration < 0 || iteration >= trace.iterations()) {
    return InvalidArgument("iteration " + std::to_string(iteration) + " is outside the trace");
  }
  if (static_cast<int>(trace.loads[iteration].size()) < node_.gpus) {
    return InvalidArgument("loads: one row per GPU of the node needed");
  }
  NodeIteration rec;
  rec.iteration = iteration;
  rec.max_load = trace.MaxLoad(iteration);
  rec.spike = trace.spike[iteration] != 0;
  const int n = node_.gpus;
  const int chunks = static_cast<int>(config_.model.Chunks());
  const int mbs = static_cast<int>(config_.model.MicroBatches());
  size_t points = 0;
  for (auto& gpu : gpus_) {
    gpu->planner->ResetIteration();
    gpu->host.assign(static_cast<size_t>(mbs * chunks), 0);
    gpu->device.assign(mbs, std::vector<double>(chunks, 0));
    gpu->actual.clear();
    gpu->planned.clear();
    gpu->pinned = 0;
    points = std::max(points, gpu->points.size());
  }
  const auto unit = [&](int mb, int chunk) { return static_cast<size_t>(mb * chunks + chunk); };
  double node_pinned = 0;
  std::vector<char> moving(n);
  std::vector<int> on_link(node_.links.size());
  std::vector<plan::Plan> plans(n);
  for (size_t i = 0; i < points; ++i) {
    // Whether a GPU moves bytes over its link at point i is known from earlier plans: O offloads
    // the previous forward, R reloads the next backward's unit (both planned before).
    std::fill(on_link.begin(), on_link.end(), 0);
    for (int g = 0; g < n; ++g) {
      Gpu& gpu = *gpus_[g];
      moving[g] = 0;
      if (i >= gpu.points.size()) continue;
      const PointRef& p = gpu.points[i];
      moving[g] = (p.o_mb >= 0 && gpu.host[unit(p.o_mb, p.o_chunk)] > 0) ||
                  (p.r_mb >= 0 && gpu.host[unit(p.r_mb, p.r_chunk)] > 0);
      on_link[gpu.link] += moving[g];
      arbiter_->SetOffloading(static_cast<uint64_t>(g + 1), moving[g] != 0);
    }
    for (size_t l = 0; l < on_link.size(); ++l) {
      if (on_link[l] == 0) continue;
      ++link_busy_points_;
      link_offloaders_sum_ += on_link[l];
      rec.link_offloaders_max = std::max(rec.link_offloaders_max, on_link[l]);
    }
    // Plan every GPU's point.
    double demand = node_pinned;
    for (int g = 0; g < n; ++g) {
      Gpu& gpu = *gpus_[g];
      plans[g] = plan::Plan{};
      if (i >= gpu.points.size()) continue;
      const PointRef& p = gpu.points[i];
      const double share = mode_ == NodeMode::kPerProcess
                               ? 1.0
                               : arbiter_->PlanShare(static_cast<uint64_t>(g + 1),
                                                     config_.hw.offload.peak_bytes_per_s);
      // What its copies really get: the link among the GPUs that move bytes at this point
      // (the arbiter knows them all, whatever the mode planned with).
      const double actual_share = moving[g]
                                      ? arbiter_->PlanShare(static_cast<uint64_t>(g + 1),
                                                            config_.hw.offload.peak_bytes_per_s)
                                      : 1.0;
      plan::SchedulePoint point;
      point.forward_micro_batch = p.f_mb;
      point.forward_chunk = p.f_chunk;
      point.backward_micro_batch = p.b_mb;
      point.backward_chunk = p.b_chunk;
      point.load_factor = p.f_mb >= 0 ? trace.loads[iteration][g][p.f_mb] : 1.0;
      // The plan may offload what is left of the GPU's pool (per-process) or grant (arbitrated):
      // the limit is per plan, the pool holds every forward still waiting for its backward.
      point.host_limit_bytes =
          std::max<int64_t>(0, host_limits_[g] - static_cast<int64_t>(std::ceil(gpu.pinned)));
      point.bandwidth_share = share;
      auto planned = gpu.planner->PlanPoint(point);
      if (!planned.ok()) return planned.status();
      plans[g] = std::move(*planned);
      const plan::Plan& plan = plans[g];
      // The plan's copies take as long as the share it assumed says (rounded down to the
      // planner's share step); in reality they get the link's share at this point.
      std::vector<plan::IssueItem> items = plan.issue_order;
      for (plan::IssueItem& item : items) {
        if (plan::IsHostCopy(item.resource)) item.duration_s *= plan.bandwidth_share / actual_share;
      }
      gpu.planned.push_back(ScheduleRounds(plan.issue_order, false));
      gpu.actual.push_back(ScheduleRounds(items, false));
      if (plan.micro_batch >= 0) {
        demand += static_cast<double>(plan.host_bytes);
        recompute_ += RecomputeFlops(gpu.planner->evaluator(), plan.strategies, plan.load_factor);
      }
    }
    rec.host_demand_peak = std::max(rec.host_demand_peak, demand);
    // Pin the new forwards' host bytes, GPU by GPU, as far as the node has them; the rest stays
    // on the device (the enforcer's offload fails with kPinnedExhausted and keeps the tensor).
    for (int g = 0; g < n; ++g) {
      Gpu& gpu = *gpus_[g];
      const plan::Plan& plan = plans[g];
      if (plan.micro_batch < 0) continue;
      const double want = static_cast<double>(plan.host_bytes);
      const double room = std::max(0.0, static_cast<double>(node_.host_budget_bytes) - node_pinned);
      const double got = std::min(want, room);
      const double failed = want - got;
      gpu.host[unit(plan.micro_batch, plan.chunk)] = got;
      gpu.pinned += got;
      node_pinned += got;
      double retained = static_cast<double>(plan.predicted_bytes);
      if (failed > 0) {
        ++rec.failed_offloads;
        rec.failed_bytes += failed;
        retained += failed;
      }
      gpu.device[plan.micro_batch][plan.chunk] = retained;
      Status reported =
          gpu.planner->Report(plan.micro_batch, plan.chunk, static_cast<int64_t>(retained));
      if (!reported.ok()) return reported;
    }
    rec.host_pinned_peak = std::max(rec.host_pinned_peak, node_pinned);
    // Backwards free their units' pinned bytes.
    for (int g = 0; g < n; ++g) {
      Gpu& gpu = *gpus_[g];
      if (i >= gpu.points.size()) continue;
      const PointRef& p = gpu.points[i];
      if (p.b_mb < 0) continue;
      double& h = gpu.host[unit(p.b_mb, p.b_chunk)];
      gpu.pinned -= h;
      node_pinned -= h;
      h = 0;
    }
  }
  // The pipeline: the slowest GPU's busy time stretched by the 1F1B bubble (as PolicySimulator).
  const int pp = static_cast<int>(config_.model.pp);
  const double units = static_cast<double>(mbs * chunks);
  const double bubble = static_cast<double>(pp - 1) / units;
  double busy = 0, planned_busy = 0, first_over = -1;
  for (auto& gpu : gpus_) {
    StageIteration actual;
    actual.capacity_bytes = gpu->planner->activation_capacity();
    WalkPoints(gpu->points, gpu->actual, gpu->device, false, actual);
    StageIteration planned;
    planned.capacity_bytes = actual.capacity_bytes;
    WalkPoints(gpu->points, gpu->planned, gpu->device, false, planned);
    busy = std::max(busy, actual.busy_s);
    planned_busy = std::max(planned_busy, planned.busy_s);
    if (actual.first_over_s >= 0) {
      first_over = first_over < 0 ? actual.first_over_s : std::min(first_over, actual.first_over_s);
    }
    useful_ += 3.0 * gpu->planner->graph().ForwardFlops(1.0) * units;
  }
  rec.run_s = busy * (1 + bubble);
  rec.planned_run_s = planned_busy * (1 + bubble);
  if (first_over >= 0) {
    // A GPU ran out of device memory: the iteration's work up to the crash is lost and the job
    // restarts from its checkpoint (the OOM model of PolicySimulator).
    rec.oom = true;
    rec.wasted_s = first_over * (1 + bubble);
    rec.restart_s = config_.restart_s;
  }
  rec.time_s = rec.run_s + rec.wasted_s + rec.restart_s;
  records_.push_back(rec);
  return rec;
}

NodeSummary NodeSimulator::Summary() const {
  NodeSummary s;
  s.mode = mode_;
  s.gpus = node_.gpus;
  s.iterations = static_cast<int>(records_.size());
  s.host_budget_bytes = static_cast<double>(node_.host_budget_bytes);
  s.host_limit_bytes =
      static_cast<double>(*std::min_element(host_limits_.begin(), host_limits_.end()));
  if (records_.empty()) return s;
  std::vector<double> times;
  for (const NodeIteration& r : records_) {
    times.push_back(r.time_s);
    s.total_s += r.time_s;
    s.mean_run_s += r.run_s;
    s.overlap_lost_s += r.run_s - r.planned_run_s;
    s.ooms += r.oom ? 1 : 0;
    s.failed_offloads += r.failed_offloads;
    s.failed_bytes += r.failed_bytes;
    s.host_demand_peak = std::max(s.host_demand_peak, r.host_demand_peak);
    s.host_pinned_peak = std::max(s.host_pinned_peak, r.host_pinned_peak);
    s.link_offloaders_max = std::max(s.link_offloaders_max, r.link_offloaders_max);
  }
  s.mean_s = s.total_s / s.iterations;
  s.mean_run_s /= s.iterations;
  s.p99_s = Percentile(times, 0.99);
  s.link_offloaders_mean = link_busy_points_ > 0 ? static_cast<double>(link_offloaders_sum_) /
                                                       static_cast<double>(link_busy_points_)
                                                 : 0;
  s.recompute_share = useful_ > 0 ? recompute_ / useful_ : 0;
  return s;
}

std::string FormatNodeTable(const std::vector<NodeSummary>& modes) {
  std::string t;
  char line[512];
  std::snprintf(line, sizeof line, "%-12s %10s %10s %10s %10s %5s %8s %10s %10s %10s %10s %9s\n",
                "mode", "host/GPU", "mean_s", "p99_s", "lost_s", "OOMs", "failed", "host_peak",
                "demand", "budget", "link_max", "link_mean");
  t += line;
  for (const NodeSummary& s : modes) {
    std::snprintf(
        line, sizeof line, "%-12s %10s %10.3f %10.3f %10.3f %5d %8d %10s %10s %10s %10d %9.2f\n",
        NodeModeName(s.mode), FormatBytes(s.host_limit_bytes).c_str(), s.mean_s, s.p99_s,
        s.overlap_lost_s, s.ooms, s.failed_offloads, FormatBytes(s.host_pinned_peak).c_str(),
        FormatBytes(s.host_demand_peak).c_str(), FormatBytes(s.host_budget_bytes).c_str(),
        s.link_offloaders_max, s.link_offloaders_mean);
    t += line;
  }
  return t;
}

nlohmann::json NodeSummariesToJson(const std::vector<NodeSummary>& modes) {
  nlohmann::json j = nlohmann::json::array();
  for (const NodeSummary& s : modes) {
    j.push_back({{"mode", NodeModeName(s.mode)},
                 {"gpus", s.gpus},
                 {"iterations", s.iterations},
                 {"total_s", s.total_s},
                 {"mean_s", s.mean_s},
                 {"p99_s", s.p99_s},
                 {"mean_run_s", s.mean_run_s},
                 {"overlap_lost_s", s.overlap_lost_s},
                 {"ooms", s.ooms},
                 {"failed_offloads", s.failed_offloads},
                 {"failed_bytes", s.failed_bytes},
                 {"host_budget_bytes", s.host_budget_bytes},
                 {"host_limit_bytes", s.host_limit_bytes},
                 {"host_demand_peak_bytes", s.host_demand_peak},
                 {"host_pinned_peak_bytes", s.host_pinned_peak},
                 {"link_offloaders_max", s.link_offloaders_max},
                 {"link_offloaders_mean", s.link_offloaders_mean},
                 {"recompute_share", s.recompute_share}});
  }
  return j;
}

}  // namespace bgl::sim
