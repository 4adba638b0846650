#include "tools/bgl-sim/options.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <sstream>
#include <string_view>
#include <type_traits>

#include "base/units.h"
#include "governor/planner/planner.h"

namespace bgl::sim {

const char* const kUsage =
    R"(usage: bgl-sim --model FILE [--policy NAMES] [--iterations N] [--seed S] [--json] [--out DIR]

Simulates pipeline-parallel MoE training of the model under activation-memory policies, driving
the planner library the daemon runs, and prints a summary per policy and the ablation table.

  --model FILE         model description (.json, .yaml; see models/)
  --policy NAMES       comma-separated: static-under, static-over, kuai-like, adapipe-like,
                       L1, L2, L3, L4 (= bagualu), plans (with --plans), or the groups
                       all, baselines, ablation (default: all; with --plans: plans)
  --iterations N       iterations to simulate (default 200; with --loads: every line of the
                       log, or at most N)
  --seed S             seed of the load distribution (default 1)
  --json               print JSON instead of tables
  --out DIR            write iterations.csv, summary.csv, timeline.csv, memory.csv, summary.json
  --loads FILE         replay a router log: one iteration per line, one load factor per
                       micro-batch (the worst GPU of the stage), comma or blank separated
  --plans FILE         replay the plans a run was served (bench_unmodified.py --sim-graphs
                       writes MODEL.plans.json): policy "plans" (the default with --plans)
                       runs each micro-batch under its served strategies at the load it was
                       planned for, one iteration per iteration of the file (at most
                       --iterations); without --loads the others run at those loads too
  --spike-prob P       fraction of spike iterations (default 0.029)
  --spike-max R        largest spike load factor (default 2.6)
  --normal-max R       normal iterations stay below this load (default 1.2)
  --design-load R      load factor static policies are sized for (default 1.2)
  --restart-cost S     seconds an OOM restart costs (default 284)
  --cooldown N         iterations after an OOM before restarting under-provisioned (0: never)
  --capacity SIZE      device memory (default: the GPU profile's), e.g. 64GB, 80GiB
  --gpu NAME           hardware profile: paper, h100, h200, host (default: the model file's)
  --calibration FILE   a calibration document applied on top of that profile (the planner's
                       format, docs/planner.md "Calibration"; an emulated link's file from
                       python -m bagualu.planning.emulation: the rates the run's copies take)
  --seq-len N          override the sequence length
  --top-k N            override the experts per token (activated parameters)
  --micro-batches N    override the micro-batches per iteration
  --ranks LIST         pipeline ranks to simulate, e.g. 0,7 (default: first and last)
  --exec M             execution model of every policy but L4: serial (default, Megatron
                       1F1B: a point's forward then its backward), lockstep (the planner's
                       program order), dual-batch
  --trace-iteration I  iteration whose timeline and memory curve go to --out (default: the
                       one with the largest load)
  --progress           progress bar on stderr even when it is not a terminal
  --spikes MODE        synchronized (default: a spike hits every rank at the same
                       micro-batches) or independent (each rank draws its own)
  --node FILE          node mode: the GPUs of one node (budget, floor, pinned pool, links,
                       ranks; see tools/bgl-sim/examples/node-8gpu.yaml), each a stage
                       running L4, with per-process planning and node arbitration side by
                       side (--policy and --ranks do not apply)
  -h, --help           this text
)";

namespace {

Result<double> ParseDouble(const std::string& flag, const std::string& v, double lo, double hi) {
  char* end = nullptr;
  const double d = std::strtod(v.c_str(), &end);
  if (v.empty() || *end || !std::isfinite(d) || d < lo || d > hi) {
    std::ostringstream msg;
    msg << flag << ": '" << v << "' must be a number in [" << lo << ", " << hi << "]";
    return InvalidArgument(msg.str());
  }
  return d;
}

Result<int64_t> ParseInt(const std::string& flag, const std::string& v, int64_t lo, int64_t hi) {
  char* end = nullptr;
  const long long i = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end || i < lo || i > hi) {
    return InvalidArgument(flag + ": '" + v + "' must be an integer in [" + std::to_string(lo) +
                           ", " + std::to_string(hi) + "]");
  }
  return static_cast<int64_t>(i);
}

// Whether the usage text documents `flag` (every flag is there): a flag it does not name is
// unknown, whether or not a value follows it.
bool Documented(const std::string& flag) {
  const std::string_view usage(kUsage);
  for (size_t at = usage.find(flag); at != std::string_view::npos; at = usage.find(flag, at + 1)) {
    const size_t end = at + flag.size();
    if (end == usage.size() ||
        !(std::islower(static_cast<unsigned char>(usage[end])) || usage[end] == '-')) {
      return true;
    }
  }
  return false;
}

}  // namespace

Result<SimOptions> ParseOptions(const std::vector<std::string>& args) {
  SimOptions o;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-h" || a == "--help") {
      o.help = true;
      return o;
    }
    if (a == "--json") {
      o.json = true;
      continue;
    }
    if (a == "--progress") {
      o.progress = true;
      continue;
    }
    if (i + 1 >= args.size()) {
      if (a.rfind("--", 0) == 0 && Documented(a)) return InvalidArgument(a + ": needs a value");
      return InvalidArgument("unknown argument '" + a + "'");
    }
    const std::string& v = args[++i];
    auto set_double = [&](double& out, double lo, double hi) -> Status {
      auto d = ParseDouble(a, v, lo, hi);
      if (!d.ok()) return d.status();
      out = *d;
      return OkStatus();
    };
    auto set_int = [&](auto& out, int64_t lo, int64_t hi) -> Status {
      auto n = ParseInt(a, v, lo, hi);
      if (!n.ok()) return n.status();
      out = static_cast<std::remove_reference_t<decltype(out)>>(*n);
      return OkStatus();
    };
    if (a == "--model") {
      o.model_path = v;
    } else if (a == "--policy") {
      o.policies_text = v;
      o.policies_given = true;
    } else if (a == "--iterations") {
      BGL_RETURN_IF_ERROR(set_int(o.iterations, 1, 10'000'000));
      o.iterations_given = true;
    } else if (a == "--seed") {
      BGL_RETURN_IF_ERROR(set_int(o.seed, 0, INT64_MAX));
    } else if (a == "--out") {
      o.out_dir = v;
    } else if (a == "--loads") {
      o.loads_path = v;
    } else if (a == "--plans") {
      o.plans_path = v;
    } else if (a == "--gpu") {
      o.gpu = v;
    } else if (a == "--calibration") {
      o.calibration_path = v;
    } else if (a == "--capacity") {
      auto bytes = ParseBytes(v, "--capacity");
      if (!bytes.ok()) return bytes.status();
      if (*bytes <= 0) return InvalidArgument("--capacity: must be positive");
      o.capacity_bytes = *bytes;
    } else if (a == "--seq-len") {
      BGL_RETURN_IF_ERROR(set_int(o.seq_len, 1, int64_t{1} << 24));
    } else if (a == "--top-k") {
      BGL_RETURN_IF_ERROR(set_int(o.top_k, 1, 1024));
    } else if (a == "--micro-batches") {
      BGL_RETURN_IF_ERROR(set_int(o.micro_batches, 1, 100'000));
    } else if (a == "--spike-prob") {
      BGL_RETURN_IF_ERROR(set_double(o.load.spike_prob, 0, 1));
    } else if (a == "--spike-max") {
      BGL_RETURN_IF_ERROR(set_double(o.load.spike_max, 1, 64));
    } else if (a == "--normal-max") {
      BGL_RETURN_IF_ERROR(set_double(o.load.normal_max, 1.0001, 64));
    } else if (a == "--design-load") {
      BGL_RETURN_IF_ERROR(set_double(o.design_load, 0.01, 64));
    } else if (a == "--restart-cost") {
      BGL_RETURN_IF_ERROR(set_double(o.restart_s, 0, 1e7));
    } else if (a == "--cooldown") {
      BGL_RETURN_IF_ERROR(set_int(o.cooldown, 0, 10'000'000));
    } else if (a == "--trace-iteration") {
      BGL_RETURN_IF_ERROR(set_int(o.trace_iteration, 0, 10'000'000));
    } else if (a == "--exec") {
      auto e = ParseExecModel(v);
      if (!e.ok()) return e.status();
      o.exec = *e;
      o.exec_override = true;
    } else if (a == "--node") {
      o.node_path = v;
    } else if (a == "--spikes") {
      if (v != "synchronized" && v != "independent") {
        return InvalidArgument("--spikes: '" + v + "' must be synchronized or independent");
      }
      o.load.synchronized = v == "synchronized";
    } else if (a == "--ranks") {
      std::stringstream in(v);
      std::string item;
      while (std::getline(in, item, ',')) {
        auto n = ParseInt("--ranks", item, 0, 1'000'000);
        if (!n.ok()) return n.status();
        o.ranks.push_back(static_cast<int>(*n));
      }
      if (o.ranks.empty()) return InvalidArgument("--ranks: no rank given");
    } else {
      return InvalidArgument("unknown argument '" + a + "'");
    }
  }
  if (o.model_path.empty()) return InvalidArgument("--model is required");
  if (!o.node_path.empty() && !o.ranks.empty()) {
    return InvalidArgument(
        "--ranks: not used with --node (the node file's ranks say which stage "
        "each GPU runs)");
  }
  if (!o.plans_path.empty() && !o.policies_given) o.policies_text = "plans";
  auto policies = ParsePolicies(o.policies_text);
  if (!policies.ok()) return policies.status();
  o.policies = *policies;
  const bool replays =
      std::find(o.policies.begin(), o.policies.end(), Policy::kPlans) != o.policies.end();
  if (replays && o.plans_path.empty()) return InvalidArgument("--policy plans: needs --plans FILE");
  if (!replays && !o.plans_path.empty()) {
    return InvalidArgument("--plans: --policy lacks 'plans', the policy that replays them");
  }
  if (!o.plans_path.empty() && !o.node_path.empty()) {
    return InvalidArgument("--plans: not used with --node");
  }
  if (o.load.spike_max < o.load.normal_max) {
    return InvalidArgument("--spike-max: must be at least --normal-max (" +
                           std::to_string(o.load.normal_max) + ")");
  }
  return o;
}

Result<SimConfig> BuildConfig(const SimOptions& o) {
  auto model = plan::LoadModelConfig(o.model_path);
  if (!model.ok()) return model.status();
  SimConfig c;
  c.model = std::move(*model);
  if (o.seq_len > 0) c.model.seq_len = o.seq_len;
  if (o.top_k > 0) c.model.top_k = o.top_k;
  if (o.micro_batches > 0) c.model.micro_batches = o.micro_batches;
  if (!o.gpu.empty()) c.model.gpu = o.gpu;
  BGL_RETURN_IF_ERROR(c.model.Validate());
  auto hw = plan::HardwareProfileByName(c.model.gpu);
  if (!hw.ok()) return hw.status();
  c.hw = std::move(*hw);
  if (!o.calibration_path.empty()) {
    BGL_RETURN_IF_ERROR(plan::ApplyCalibrationFile(o.calibration_path, c.hw));
  }
  if (!o.plans_path.empty()) {
    auto plans = ReadServedPlans(o.plans_path);
    if (!plans.ok()) return plans.status();
    c.plans = std::make_shared<const ServedPlans>(std::move(*plans));
  }
  c.capacity_bytes = o.capacity_bytes;
  c.ranks = o.ranks;
  c.design_load = o.design_load;
  c.restart_s = o.restart_s;
  c.cooldown = o.cooldown;
  c.exec_override = o.exec_override;
  c.exec = o.exec;
  // Capacity below weights, impossible ranks: the planner of every simulated stage says so.
  const int pp = static_cast<int>(c.model.pp);
  std::vector<int> ranks = c.ranks;
  if (ranks.empty()) ranks = {0, pp - 1};
  for (int rank : ranks) {
    if (rank < 0 || rank >= pp) {
      return InvalidArgument("--ranks: rank " + std::to_string(rank) + " is outside [0, " +
                             std::to_string(pp) + ")");
    }
    plan::PlannerOptions options;
    options.capacity_bytes = c.capacity_bytes;
    options.pipeline_rank = rank;
    auto planner = plan::StagePlanner::Create(c.model, c.hw, options);
    if (!planner.ok()) return planner.status();
  }
  return c;
}

}  // namespace bgl::sim
