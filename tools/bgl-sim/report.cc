#include "tools/bgl-sim/report.h"

#include <cstdio>

#include "base/units.h"
#include "governor/planner/dual_batch.h"

namespace bgl::sim {
namespace {

const PolicyRun* Find(const std::vector<PolicyRun>& runs, Policy p) {
  for (const auto& r : runs) {
    if (r.summary.policy == p) return &r;
  }
  return nullptr;
}

std::string Fmt(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

nlohmann::json SummaryJson(const PolicySummary& s) {
  nlohmann::json j = {{"policy", PolicyName(s.policy)},
                      {"exec", ExecModelName(s.exec)},
                      {"iterations", s.iterations},
                      {"total_s", s.total_s},
                      {"mfu", s.mfu},
                      {"throughput_tflops", s.throughput_tflops},
                      {"tokens_per_s", s.tokens_per_s},
                      {"normal_mfu", s.normal_mfu},
                      {"spike_mfu", s.spike_mfu},
                      {"spike_s", s.spike_s},
                      {"ooms", s.ooms},
                      {"restart_s", s.restart_s},
                      {"wasted_s", s.wasted_s},
                      {"planning_ms_mean", s.planning_ms_mean},
                      {"planning_ms_max", s.planning_ms_max},
                      {"peak_bytes", s.peak_bytes},
                      {"capacity_bytes", s.capacity_bytes},
                      {"recompute_share", s.recompute_share}};
  if (s.policy == Policy::kPlans) j["reordered_points"] = s.reordered_points;
  return j;
}

// Time from the first spike iteration to the end: the spike phase in which a static policy
// crashes, restarts and runs over-provisioned (paper VI-C, Fig. 9). 0 without spikes.
double SpikePhaseSeconds(const PolicyRun& run) {
  double total = 0;
  bool started = false;
  for (const auto& r : run.records) {
    started |= r.spike;
    if (started) total += r.time_s;
  }
  return total;
}

}  // namespace

void WriteIterationsCsv(const std::vector<PolicyRun>& runs, std::ostream& out) {
  out << "policy,iteration,max_load,spike,time_s,run_s,bubble_s,mfu,peak_bytes,capacity_bytes,"
         "oom,wasted_s,restart_s,mode,planning_ms,fallbacks\n";
  for (const auto& run : runs) {
    for (const auto& r : run.records) {
      out << PolicyName(run.summary.policy) << ',' << r.iteration << ',' << r.max_load << ','
          << (r.spike ? 1 : 0) << ',' << r.time_s << ',' << r.run_s << ',' << r.bubble_s << ','
          << r.mfu << ',' << static_cast<int64_t>(r.peak_bytes) << ','
          << static_cast<int64_t>(r.capacity_bytes) << ',' << (r.oom ? 1 : 0) << ',' << r.wasted_s
          << ',' << r.restart_s << ',' << r.mode << ',' << r.planning_ms << ',' << r.fallbacks
          << '\n';
    }
  }
}

void WriteSummaryCsv(const std::vector<PolicyRun>& runs, std::ostream& out) {
  out << "policy,exec,iterations,total_s,mfu,throughput_tflops,tokens_per_s,normal_mfu,"
         "spike_mfu,spike_s,ooms,restart_s,wasted_s,planning_ms_mean,planning_ms_max,peak_bytes,"
         "capacity_bytes,recompute_share\n";
  for (const auto& run : runs) {
    const PolicySummary& s = run.summary;
    out << PolicyName(s.policy) << ',' << ExecModelName(s.exec) << ',' << s.iterations << ','
        << s.total_s << ',' << s.mfu << ',' << s.throughput_tflops << ',' << s.tokens_per_s << ','
        << s.normal_mfu << ',' << s.spike_mfu << ',' << s.spike_s << ',' << s.ooms << ','
        << s.restart_s << ',' << s.wasted_s << ',' << s.planning_ms_mean << ',' << s.planning_ms_max
        << ',' << static_cast<int64_t>(s.peak_bytes) << ','
        << static_cast<int64_t>(s.capacity_bytes) << ',' << s.recompute_share << '\n';
  }
}

void WriteTimelineCsv(const std::vector<PolicyRun>& runs, std::ostream& out) {
  out << "policy,rank,point,chain,stage,resource,start_s,end_s\n";
  for (const auto& run : runs) {
    for (const auto& stage : run.traced) {
      for (const auto& iv : stage.timeline) {
        out << PolicyName(run.summary.policy) << ',' << stage.rank << ',' << iv.point << ','
            << plan::ChainName(iv.chain) << ',' << iv.stage << ','
            << plan::ResourceName(iv.resource) << ',' << iv.start_s << ',' << iv.end_s << '\n';
      }
    }
  }
}

void WriteMemoryCsv(const std::vector<PolicyRun>& runs, std::ostream& out) {
  out << "policy,rank,time_s,bytes,capacity_bytes\n";
  for (const auto& run : runs) {
    for (const auto& stage : run.traced) {
      for (const auto& m : stage.memory) {
        out << PolicyName(run.summary.policy) << ',' << stage.rank << ',' << m.time_s << ','
            << static_cast<int64_t>(m.bytes) << ',' << static_cast<int64_t>(stage.capacity_bytes)
            << '\n';
      }
    }
  }
}

std::string FormatSummaryTable(const std::vector<PolicyRun>& runs) {
  const PolicyRun* best = Find(runs, Policy::kL4);
  std::string t;
  char line[512];
  std::snprintf(line, sizeof line, "%-13s %-10s %9s %7s %7s %7s %5s %10s %9s %10s %9s %9s\n",
                "policy", "exec", "PFLOP/s", "MFU", "normal", "spike", "OOMs", "restart_s", "peak",
                "plan_ms/it", "L4 gain", "phase gain");
  t += line;
  for (const auto& run : runs) {
    const PolicySummary& s = run.summary;
    const std::string gain = best ? Fmt("%.3fx", s.total_s / best->summary.total_s) : "-";
    const double phase = SpikePhaseSeconds(run);
    const double best_phase = best ? SpikePhaseSeconds(*best) : 0;
    const std::string spike_gain = best_phase > 0 ? Fmt("%.3fx", phase / best_phase) : "-";
    std::snprintf(line, sizeof line,
                  "%-13s %-10s %9.2f %6.1f%% %6.1f%% %6.1f%% %5d %10.0f %9s %10.3f %9s %9s\n",
                  PolicyName(s.policy), ExecModelName(s.exec), s.throughput_tflops / 1e3,
                  100 * s.mfu, 100 * s.normal_mfu, 100 * s.spike_mfu, s.ooms, s.restart_s,
                  FormatBytes(s.peak_bytes).c_str(), s.planning_ms_mean, gain.c_str(),
                  spike_gain.c_str());
    t += line;
  }
  return t;
}

std::string FormatAblationTable(const std::vector<PolicyRun>& runs) {
  const Policy levels[] = {Policy::kL1, Policy::kL2, Policy::kL3, Policy::kL4};
  const char* paper[] = {"-", "1.16x", "1.05x", "1.13x"};
  const PolicyRun* found[4];
  for (int i = 0; i < 4; ++i) {
    found[i] = Find(runs, levels[i]);
    if (!found[i]) return "";
  }
  std::string t;
  char line[256];
  std::snprintf(line, sizeof line, "%-6s %7s %10s %10s %8s\n", "level", "MFU", "step", "vs L1",
                "paper");
  t += line;
  for (int i = 0; i < 4; ++i) {
    const double step = i == 0 ? 1 : found[i - 1]->summary.total_s / found[i]->summary.total_s;
    const double total = found[0]->summary.total_s / found[i]->summary.total_s;
    std::snprintf(line, sizeof line, "%-6s %6.1f%% %9.3fx %9.3fx %8s\n", PolicyName(levels[i]),
                  100 * found[i]->summary.mfu, step, total, paper[i]);
    t += line;
  }
  return t;
}

nlohmann::json RunsToJson(const std::vector<PolicyRun>& runs) {
  nlohmann::json j;
  j["policies"] = nlohmann::json::array();
  for (const auto& run : runs) j["policies"].push_back(SummaryJson(run.summary));
  if (const PolicyRun* best = Find(runs, Policy::kL4)) {
    nlohmann::json gains = nlohmann::json::object();
    for (const auto& run : runs) {
      nlohmann::json g = {{"throughput", run.summary.total_s / best->summary.total_s}};
      if (best->summary.spike_s > 0 && run.summary.spike_s > 0) {
        g["spike_iterations"] = run.summary.spike_s / best->summary.spike_s;
        g["spike_phase"] = SpikePhaseSeconds(run) / SpikePhaseSeconds(*best);
      }
      gains[PolicyName(run.summary.policy)] = g;
    }
    j["bagualu_speedup_over"] = gains;
  }
  const Policy levels[] = {Policy::kL1, Policy::kL2, Policy::kL3, Policy::kL4};
  nlohmann::json steps = nlohmann::json::array();
  const PolicyRun* prev = nullptr;
  for (Policy p : levels) {
    const PolicyRun* cur = Find(runs, p);
    if (!cur) {
      steps = nullptr;
      break;
    }
    if (prev) {
      steps.push_back({{"from", PolicyName(prev->summary.policy)},
                       {"to", PolicyName(p)},
                       {"speedup", prev->summary.total_s / cur->summary.total_s}});
    }
    prev = cur;
  }
  if (!steps.is_null()) j["ablation"] = steps;
  return j;
}

}  // namespace bgl::sim
