// Renders plans for people (a table) and programs (JSON), and memory curves as CSV.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "governor/planner/cost_model.h"
#include "governor/planner/planner.h"

namespace bgl::plan {

// What an issued stage covers, e.g. "L0.attn_norm..L0.router" or "offload L1.dispatched".
std::string IssueLabel(const IssueItem& item, const StageGraph& graph);
// A readable table: the budget line, one row per operator, then the issue order.
std::string FormatPlanTable(const Plan& plan, const StagePlanner& planner);
nlohmann::json PlanToJson(const Plan& plan, const StageGraph& graph);
// PlanToJson(plan, graph).dump(), written without building the document: the C ABI's answer at
// every point and every call after a gate, on the training thread (issue 43: the document cost
// about 150 us a plan there). Same keys in the same order, the same values.
std::string PlanToJsonText(const Plan& plan, const StageGraph& graph);
// time_s,bytes,step rows with a header.
std::string CurveToCsv(const IterationCurve& planned, const IterationCurve& keep_all);

}  // namespace bgl::plan
