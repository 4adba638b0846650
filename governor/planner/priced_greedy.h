// The anytime path's priced candidates (issue 43): cheap answers for a mitigation-cache miss on a
// large chunk that see the whole chunk at once.
//
// The chunk's movable operators are grouped into units: the operators joined by the tensors they
// save (a tensor with several savers moves with all of them, so a unit never conflicts). Each
// unit offers keep, offload, FP8 (recompute where an operator may not take FP8) and recompute,
// each with its own terms (bytes on device, recompute and FP8 seconds, D2H and H2D seconds, host
// bytes; the recompute closure taken with every other unit kept). Under prices on the copy
// seconds, a unit's options form a convex hull of (bytes, priced cost); the steps of all hulls,
// cheapest per byte saved first, are taken until the budget holds (the fractional knapsack's
// order), then steps the budget no longer needs are undone, or the last step is replaced by the
// cheapest single move that meets the budget. Copy prices: 0 (offloads are free: keep what fits,
// offload the rest) and the price at which the offloads just fit the copy windows (a bisection),
// so the windows are spent on what is dearest to recompute. Each candidate is costed with the
// true windows (max(0, D2H - forward) + max(0, H2D - backward)); the cheapest few are checked by
// the full evaluator.
//
// Internal to the planner library; mitigation.cc calls it. A free function without state: safe to
// call from any thread on an evaluator no other thread modifies.
#pragma once

#include <optional>
#include <vector>

#include "governor/planner/assignment.h"
#include "governor/planner/mitigation.h"

namespace bgl::plan {

// Operators whose strategy is fixed: those a forward has already run when the plan is revised
// after the gate (ReplanAfterGate). A plain value.
struct Pinned {
  Assignment strategies;     // one per operator; only the pinned operators' are read
  std::vector<char> pinned;  // one per operator: 1 when its strategy is fixed
};

// The cheapest conflict-free candidate within `budget` and options.host_limit_bytes by the full
// evaluator, or nothing when no candidate fits. With `pinned`, the pinned operators keep their
// strategies and the others start from keep.
std::optional<Assignment> PricedGreedy(const CostEvaluator& eval, double r, double budget,
                                       const MitigationOptions& options,
                                       const Pinned* pinned = nullptr);

}  // namespace bgl::plan
