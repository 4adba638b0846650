// bgl-sim: cluster-scale simulator of pipeline-parallel MoE training under activation-memory
// policies, driven by the planner library the daemon runs (see docs/reproduction.md).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "tools/bgl-sim/node.h"
#include "tools/bgl-sim/options.h"
#include "tools/bgl-sim/progress.h"
#include "tools/bgl-sim/report.h"

namespace {

int Fail(const std::string& message) {
  std::fprintf(stderr, "bgl-sim: %s\n", message.c_str());
  return 2;
}

// The load trace of `ranks` ranks (generated, or read from --loads) and the iterations to run.
bgl::Result<bgl::sim::LoadTrace> MakeTrace(const bgl::sim::SimOptions& options,
                                           const bgl::sim::SimConfig& config, int ranks,
                                           int* iterations) {
  using namespace bgl::sim;
  const int mbs = static_cast<int>(config.model.MicroBatches());
  LoadSpec spec = options.load;
  spec.seed = options.seed;
  spec.gpus_per_stage = static_cast<int>(config.model.gpus / config.model.pp);
  const bool replay = options.loads_path.empty() && config.plans != nullptr;
  auto trace = replay ? LoadsFromPlans(*config.plans, ranks, mbs, spec.normal_max)
               : options.loads_path.empty()
                   ? GenerateLoads(spec, options.iterations, ranks, mbs)
                   : ReadLoadLog(options.loads_path, ranks, mbs, spec.normal_max);
  if (!trace.ok()) return trace.status();
  if (config.plans != nullptr &&
      trace->iterations() > static_cast<int>(config.plans->iterations.size())) {
    return bgl::InvalidArgument("--loads: " + std::to_string(trace->iterations()) +
                                " iterations, --plans has " +
                                std::to_string(config.plans->iterations.size()));
  }
  *iterations = (options.loads_path.empty() && !replay) || !options.iterations_given
                    ? trace->iterations()
                    : std::min(trace->iterations(), options.iterations);
  return trace;
}

// Iterations among the first `n` with a routing spike.
int Spikes(const bgl::sim::LoadTrace& trace, int n) {
  int spikes = 0;
  for (int i = 0; i < n; ++i) spikes += trace.spike[i] ? 1 : 0;
  return spikes;
}

// --node: the node's GPUs under per-process planning and under node arbitration.
int RunNode(const bgl::sim::SimOptions& options, const bgl::sim::SimConfig& config) {
  using namespace bgl::sim;
  auto node = LoadNodeSpec(options.node_path);
  if (!node.ok()) return Fail(node.status().message());
  int iterations = 0;
  auto trace = MakeTrace(options, config, node->gpus, &iterations);
  if (!trace.ok()) return Fail(trace.status().message());
  std::vector<NodeSummary> summaries;
  std::vector<std::vector<NodeIteration>> records;
  ProgressBar bar(options.progress || StderrIsTerminal(), 2L * iterations);
  long done = 0;
  for (NodeMode mode : {NodeMode::kPerProcess, NodeMode::kArbitrated}) {
    auto sim = NodeSimulator::Create(config, *node, mode);
    if (!sim.ok()) return Fail(sim.status().message());
    for (int it = 0; it < iterations; ++it) {
      auto rec = (*sim)->Step(*trace, it);
      if (!rec.ok()) return Fail(rec.status().message());
      bar.Update(++done, NodeModeName(mode));
    }
    summaries.push_back((*sim)->Summary());
    records.push_back((*sim)->records());
  }
  bar.Finish();
  const int spikes = Spikes(*trace, iterations);
  nlohmann::json j;
  j["model"] = config.model.name;
  j["gpu"] = config.hw.name;
  j["node"] = options.node_path;
  j["gpus"] = node->gpus;
  j["iterations"] = iterations;
  j["spike_iterations"] = spikes;
  j["spikes"] = options.load.synchronized ? "synchronized" : "independent";
  j["seed"] = options.seed;
  j["modes"] = NodeSummariesToJson(summaries);
  if (!options.out_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(options.out_dir, ec);
    if (ec) return Fail("--out: cannot create '" + options.out_dir + "': " + ec.message());
    std::ofstream csv(std::filesystem::path(options.out_dir) / "node_iterations.csv");
    csv << "mode,iteration,max_load,spike,time_s,run_s,planned_run_s,oom,wasted_s,restart_s,"
           "failed_offloads,failed_bytes,host_demand_peak,host_pinned_peak,link_offloaders_max\n";
    for (size_t m = 0; m < records.size(); ++m) {
      for (const NodeIteration& r : records[m]) {
        csv << NodeModeName(summaries[m].mode) << ',' << r.iteration << ',' << r.max_load << ','
            << (r.spike ? 1 : 0) << ',' << r.time_s << ',' << r.run_s << ',' << r.planned_run_s
            << ',' << (r.oom ? 1 : 0) << ',' << r.wasted_s << ',' << r.restart_s << ','
            << r.failed_offloads << ',' << static_cast<int64_t>(r.failed_bytes) << ','
            << static_cast<int64_t>(r.host_demand_peak) << ','
            << static_cast<int64_t>(r.host_pinned_peak) << ',' << r.link_offloaders_max << '\n';
      }
    }
    std::ofstream js(std::filesystem::path(options.out_dir) / "node_summary.json");
    js << j.dump(2) << "\n";
    if (!csv || !js) return Fail("--out: cannot write into '" + options.out_dir + "'");
  }
  if (options.json) {
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  std::printf(
      "%s on one node of %d x %s (%zu links), PP %lld, %d micro-batches; %d iterations (%d with "
      "%s spikes), seed %llu\n\n",
      config.model.name.c_str(), node->gpus, config.hw.name.c_str(), node->links.size(),
      static_cast<long long>(config.model.pp), static_cast<int>(config.model.MicroBatches()),
      iterations, spikes, options.load.synchronized ? "synchronized" : "independent",
      static_cast<unsigned long long>(options.seed));
  std::fputs(FormatNodeTable(summaries).c_str(), stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace bgl::sim;
  auto options = ParseOptions(std::vector<std::string>(argv + 1, argv + argc));
  if (!options.ok()) return Fail(options.status().message() + "\n" + kUsage);
  if (options->help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  auto config = BuildConfig(*options);
  if (!config.ok()) return Fail(config.status().message());
  if (!options->node_path.empty()) return RunNode(*options, *config);
  const int pp = static_cast<int>(config->model.pp);
  const int ranks =
      options->ranks.empty() ? (pp > 1 ? 2 : 1) : static_cast<int>(options->ranks.size());
  const int mbs = static_cast<int>(config->model.MicroBatches());
  int iterations = 0;
  auto trace = MakeTrace(*options, *config, ranks, &iterations);
  if (!trace.ok()) return Fail(trace.status().message());
  int traced = options->trace_iteration;
  if (traced >= iterations) return Fail("--trace-iteration: beyond the last iteration");
  if (traced < 0) {
    traced = 0;
    for (int i = 1; i < iterations; ++i) {
      if (trace->MaxLoad(i) > trace->MaxLoad(traced)) traced = i;
    }
  }

  std::vector<PolicyRun> runs;
  ProgressBar bar(options->progress || StderrIsTerminal(),
                  static_cast<long>(iterations) * static_cast<long>(options->policies.size()));
  long done = 0;
  for (Policy policy : options->policies) {
    auto sim = PolicySimulator::Create(*config, policy);
    if (!sim.ok()) return Fail(sim.status().message());
    PolicyRun run;
    for (int it = 0; it < iterations; ++it) {
      auto rec = (*sim)->Step(*trace, it, it == traced);
      if (!rec.ok()) return Fail(rec.status().message());
      if (it == traced) run.traced = (*sim)->traced();
      bar.Update(++done, PolicyName(policy));
    }
    run.summary = (*sim)->Summary();
    run.records = (*sim)->records();
    runs.push_back(std::move(run));
  }
  bar.Finish();

  if (!options->out_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(options->out_dir, ec);
    if (ec) return Fail("--out: cannot create '" + options->out_dir + "': " + ec.message());
    auto write = [&](const char* name, auto&& writer) -> bool {
      std::ofstream out(std::filesystem::path(options->out_dir) / name);
      if (!out) return false;
      writer(out);
      return static_cast<bool>(out);
    };
    bool ok =
        write("iterations.csv", [&](std::ostream& o) { WriteIterationsCsv(runs, o); }) &&
        write("summary.csv", [&](std::ostream& o) { WriteSummaryCsv(runs, o); }) &&
        write("timeline.csv", [&](std::ostream& o) { WriteTimelineCsv(runs, o); }) &&
        write("memory.csv", [&](std::ostream& o) { WriteMemoryCsv(runs, o); }) &&
        write("summary.json", [&](std::ostream& o) { o << RunsToJson(runs).dump(2) << "\n"; });
    if (!ok) return Fail("--out: cannot write into '" + options->out_dir + "'");
  }
  if (options->json) {
    nlohmann::json j = RunsToJson(runs);
    j["model"] = config->model.name;
    j["gpu"] = config->hw.name;
    j["gpus"] = config->model.gpus;
    j["iterations"] = iterations;
    j["seed"] = options->seed;
    j["traced_iteration"] = traced;
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  const int spikes = Spikes(*trace, iterations);
  std::printf(
      "%s on %lld x %s, PP %lld (%lld chunk(s)), %lld micro-batches, seq %lld; "
      "%d iterations (%d with spikes), seed %llu\n\n",
      config->model.name.c_str(), static_cast<long long>(config->model.gpus),
      config->hw.name.c_str(), static_cast<long long>(config->model.pp),
      static_cast<long long>(config->model.Chunks()), static_cast<long long>(mbs),
      static_cast<long long>(config->model.seq_len), iterations, spikes,
      static_cast<unsigned long long>(options->seed));
  std::fputs(FormatSummaryTable(runs).c_str(), stdout);
  const std::string ablation = FormatAblationTable(runs);
  if (!ablation.empty()) std::printf("\nablation\n%s", ablation.c_str());
  return 0;
}
