// Renders plans for people (a table) and programs (JSON), and memory curves as CSV.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "governor/planner/cost_model.h"
#include "governor/planner/planner.h"

namespace bgl::plan {

// A readable table: the budget line, one row per operator, then the issue order.
std::string FormatPlanTable(const Plan& plan, const StagePlanner& planner);
nlohmann::json PlanToJson(const Plan& plan, const StageGraph& graph);
// time_s,bytes,step rows with a header.
std::string CurveToCsv(const IterationCurve& planned, const IterationCurve& keep_all);

}  // namespace bgl::plan
