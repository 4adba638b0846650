// The operator DP behind Algorithm 2 (issue 23): a dynamic program over the chunk's operators in
// reverse forward order whose states are partial assignments of the operators decided so far.
//
// Deciding operators last to first makes every cost of section 2 of docs/algorithms.md local: a
// tensor's savers all run at or after its producer, so its placement (and a conflict) is known
// once its producer is decided; the producer is rerun exactly when one of its outputs is dropped
// or read, unretained, by an operator rerun later, which is decided before it. What the earlier
// operators still need of a state is its signature: for every open tensor (produced before the
// cut, touched after it) the strategy its decided savers agreed on and whether a rerun operator
// reads it. States of one signature are compared by Pareto dominance on (device bytes, recompute
// and FP8 seconds, D2H seconds, H2D seconds, and host bytes under a host limit); the copy terms
// couple layers only through max(0, D2H - forward) and max(0, H2D - backward), so the DP spans
// the whole chunk and fills the copy windows across layers. States whose bytes pass the budget
// are cut, and so are those whose overhead, plus a lower bound of what the operators still to
// decide must add to fit the budget (a fractional knapsack of their tensors' bytes: offloads free
// within the windows' slack, then at the cheaper copy rate, FP8 casts, reruns), reaches the bound.
// With every front under its cap the answer is the optimum; past the cap a front is thinned on a
// grid of bytes and D2H seconds (the cheapest and the least-copying state of each cell stay), and
// the answer is near it; a caller may search again below the answer's overhead (ReplanAfterGate).
//
// Internal to the planner library; mitigation.cc calls it. A free function without state: safe to
// call from any thread on an evaluator no other thread modifies.
#pragma once

#include <optional>

#include "governor/planner/assignment.h"
#include "governor/planner/mitigation.h"
#include "governor/planner/priced_greedy.h"

namespace bgl::plan {

struct OperatorDpResult {
  Assignment assignment;
  bool exact = false;  // no front was thinned: the assignment is the optimum below the bound
  int states = 0;      // states created, over all cuts
};

// The cheapest conflict-free assignment within `budget` (and options.host_limit_bytes) with an
// exposed overhead below `bound`, or nothing (none below the bound, or more than 21 tensors open
// at one cut). `max_states` caps the states kept per cut (options.dp_states when 0). With
// `pinned`, a pinned operator's only choice is its pinned strategy (the revision after the gate:
// the operators the forward has run, issue 43); `exact` then means the optimum over the others.
std::optional<OperatorDpResult> OperatorDp(const CostEvaluator& eval, double r, double budget,
                                           double bound, const MitigationOptions& options,
                                           int max_states = 0, const Pinned* pinned = nullptr);

}  // namespace bgl::plan
