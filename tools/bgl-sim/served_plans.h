// Served plans: the plans a run carried out (bench_unmodified.py --sim-graphs writes
// MODEL.plans.json), per iteration and per planned forward: the strategy of every operator and
// the point's issue order, in the fields of the planner's plan JSON (plan_format.h PlanToJson).
// bgl-sim --plans replays them (policy "plans"), so that a comparison with the run isolates the
// cost model from the planner's choices. Immutable once read: safe to share between threads.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "base/status.h"
#include "governor/planner/assignment.h"
#include "governor/planner/dual_batch.h"
#include "tools/bgl-sim/load_trace.h"

namespace bgl::sim {

// One issued stage of a recorded issue order.
struct ServedIssueItem {
  plan::Chain chain = plan::Chain::kForward;
  int stage = 0;
  int round = 0;
};

// The plan one forward ran under (after any revision at a router).
struct ServedPlan {
  int micro_batch = 0;
  int chunk = 0;
  double load_factor = 1;
  std::vector<std::pair<std::string, plan::Strategy>> operators;  // by operator name
  std::vector<ServedIssueItem> issue_order;                       // empty: none recorded
};

struct ServedPlans {
  std::string source;                               // the file, for errors
  std::vector<std::vector<ServedPlan>> iterations;  // [iteration][plan]
};

// Parses the document (format "bgl-served-plans", version 1):
//   {"format": "bgl-served-plans", "version": 1,
//    "iterations": [{"plans": [{"micro_batch": 0, "chunk": 0, "load_factor": 1.0,
//                               "operators": [{"name": "L0.attn", "strategy": "keep"}, ...],
//                               "issue_order": [{"round": 0, "chain": "F", "stage": 0}, ...]}]}]}
// Other fields of a plan are ignored. Errors are InvalidArgument naming `source` and the field.
Result<ServedPlans> ParseServedPlans(const std::string& text, const std::string& source);
// The same from a file (NotFound when it cannot be read).
Result<ServedPlans> ReadServedPlans(const std::string& path);

// The assignment `p` gives the operators of `g`: every operator named exactly once, no name
// `g` lacks; `where` prefixes errors.
Result<plan::Assignment> ServedAssignment(const ServedPlan& p, const plan::StageGraph& g,
                                          const std::string& where);

// The plans' load factors as a load trace for `ranks` ranks of `micro_batches`: every micro-batch
// of every iteration needs a plan (its forward's). A spike: a load of `normal_max` or more.
Result<LoadTrace> LoadsFromPlans(const ServedPlans& plans, int ranks, int micro_batches,
                                 double normal_max);

}  // namespace bgl::sim
