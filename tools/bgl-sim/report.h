// Reports of a simulation: per-iteration and per-stage CSV traces, the summary and ablation tables
// for people, and JSON for scripts.
#pragma once

#include <nlohmann/json.hpp>
#include <ostream>
#include <string>
#include <vector>

#include "tools/bgl-sim/simulator.h"

namespace bgl::sim {

// One policy's results, as the reports read them.
struct PolicyRun {
  PolicySummary summary;
  std::vector<IterationRecord> records;
  std::vector<StageIteration> traced;  // stages of the traced iteration
};

void WriteIterationsCsv(const std::vector<PolicyRun>& runs, std::ostream& out);
void WriteSummaryCsv(const std::vector<PolicyRun>& runs, std::ostream& out);
// Every placed stage of the traced iteration: policy, rank, point, chain, resource, start, end.
void WriteTimelineCsv(const std::vector<PolicyRun>& runs, std::ostream& out);
// The traced iteration's activation memory curve per policy and rank.
void WriteMemoryCsv(const std::vector<PolicyRun>& runs, std::ostream& out);

// The summary table, with BaGuaLu's (L4) speedup over each policy when L4 ran: over the whole
// run and over the spike phase (from the first spike iteration to the end).
std::string FormatSummaryTable(const std::vector<PolicyRun>& runs);
// L1 -> L4 step speedups, when all four ran; empty otherwise.
std::string FormatAblationTable(const std::vector<PolicyRun>& runs);
nlohmann::json RunsToJson(const std::vector<PolicyRun>& runs);

}  // namespace bgl::sim
