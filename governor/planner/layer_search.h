// The search over per-layer choices that backs Algorithm 2 (issue 12 item 11).
//
// The cost of an assignment separates over blocks of operators that share no tensor other than
// block inputs (in practice: one block per layer): device and host bytes, recompute and FP8 time
// add up over blocks, and only the copy terms, max(0, D2H - forward) and max(0, H2D - backward),
// couple them. The search lists each block's candidate assignments (all of them when they are
// few, else the assignments greedy runs on the block alone pass through), keeps the Pareto front
// of (bytes, compute overhead, D2H, H2D), and combines blocks by a DP over those fronts. With
// every block enumerated and the front under its cap it is exact.
//
// Internal to the planner library; mitigation.cc calls it. Free functions without state: safe
// to call from any thread on evaluators no other thread modifies.
#pragma once

#include <optional>
#include <vector>

#include "governor/planner/assignment.h"
#include "governor/planner/mitigation.h"

namespace bgl::plan {

// The cheapest conflict-free assignment within `budget` the search finds with an exposed overhead
// below `bound` (the greedy's), or nothing.
std::optional<Assignment> LayerSearch(const CostEvaluator& eval, double r, double budget,
                                      double bound, const MitigationOptions& options);

// The greedy of Algorithm 2 alone (mitigation.cc), without the budget check of SelectMitigation:
// appends every assignment it passes through (keep-all first) to `trajectory` when given.
MitigationResult GreedyMitigation(const CostEvaluator& eval, double r, double budget,
                                  const MitigationOptions& options,
                                  std::vector<Assignment>* trajectory);

}  // namespace bgl::plan
