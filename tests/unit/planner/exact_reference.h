// An exact reference for Algorithm 2 at real sizes (issue 23), written from docs/algorithms.md
// sec. 2 without the planner's code: its own cost of an assignment (placements from the savers'
// strategies, conflicts, the recompute closure, the FP8 and copy rooflines, the exposed copy
// time beyond the forward and backward) and an exact search for the cheapest conflict-free
// assignment within the budget (and host limit).
//
// The search: the chunk splits into parts, operators joined by the tensors other than block
// inputs they make, save or read (one part per layer in the shipped graphs). A block input is
// always retained, so the recompute closure stays inside a part, and every term of the cost (bytes,
// recompute and FP8 seconds, D2H and H2D seconds, host bytes) adds up over parts; only the copy
// windows (max(0, D2H - forward), max(0, H2D - backward)) are the chunk's. Per part, a
// label-setting DP over its operators, last to first, gives the Pareto front of those terms: a
// tensor's placement is final once its producer is decided (its savers run at or after it), and
// so is whether its producer reruns; labels that agree on what the undecided operators can still
// change (per open tensor: the strategy its decided savers agreed on, and whether a rerun operator
// reads it) are compared by dominance. The fronts are then combined part by part, partial sums
// kept on their Pareto front. A label or a partial sum is cut when a lower bound of every
// assignment through it reaches the incumbent: the fractional knapsack of what the rest of its
// part must save, and a Lagrangian bound of the other parts (the budget priced per byte and the
// copy windows by weights in [0, 1], each part's least priced cost found by the same DP with one
// label per signature; weak duality). Parts of the same shape share their work. Nothing is
// thinned, so the answer is the proven optimum, or the search reports that it gave up (more than
// `max_labels` labels and partial sums).
// Plain functions: call from any thread.
#pragma once

#include <cstdint>
#include <vector>

#include "governor/planner/assignment.h"
#include "governor/planner/hardware.h"
#include "governor/planner/stage_graph.h"

namespace bgl::plan::reference {

// The cost of one assignment, computed from the specification.
struct Cost {
  double device_bytes = 0, host_bytes = 0;
  double recompute_s = 0, fp8_s = 0, d2h_s = 0, h2d_s = 0;
  double exposed_s = 0;
  bool conflict = false;
};
Cost Evaluate(const StageGraph& g, const HardwareProfile& hw, double r, const Assignment& a);

struct Options {
  bool allow_recompute = true, allow_offload = true, allow_fp8 = true;
  double host_limit_bytes = -1;
  int64_t max_labels = 20'000'000;  // over all cuts; past it the search gives up
  // Per operator: -1 free, else the Strategy (as an int) it must take (the operators a forward
  // already ran, for the downgrade after the gate); empty: none pinned.
  std::vector<int> pinned;
};

struct Optimum {
  bool proven = false;  // false: gave up (too many labels)
  bool feasible = false;
  double exposed_s = 0;
  Assignment assignment;
  int64_t labels = 0;
};

// The optimum. `incumbent` (may be empty) is any assignment: when it is feasible its cost is the
// starting bound (the search then only looks for cheaper ones, and returns it when none is).
Optimum Solve(const StageGraph& g, const HardwareProfile& hw, double r, double budget,
              const Options& options, const Assignment& incumbent = {});

}  // namespace bgl::plan::reference
