// Algorithm 2: greedy per-operator mitigation selection with re-evaluation after each choice,
// roofline-best strategy per operator and conflict rejection; plus deferred planning after the
// MoE gate (paper V-A, docs/algorithms.md sec. 4).
#pragma once

#include <vector>

#include "base/status.h"
#include "governor/planner/assignment.h"

namespace bgl::plan {

// Which strategies the selection may use (static baselines restrict them).
struct MitigationOptions {
  bool allow_recompute = true;
  bool allow_offload = true;
  bool allow_fp8 = true;
  // After the budget is met, a local search switches single operators (or a tensor's savers
  // together) to cheaper strategies while the budget holds.
  bool refine = true;
  // When the greedy's answer has an overhead, a search over per-layer choices (layer_search.h)
  // is run as well and the cheaper of the two answers is taken; the greedy stays the bound.
  bool layer_search = true;
  // A layer whose assignments number at most this many is enumerated exactly; larger layers
  // offer the assignments greedy runs on the layer alone pass through.
  int exact_layer_assignments = 4096;
  // Candidates per layer and partial combinations kept between layers: past it a Pareto front
  // is cut (least memory, then least overhead) and the search is no longer exact.
  int max_layer_states = 1024;
  // Chunks with more operators skip the layer search (its greedy runs per layer would take
  // several times the greedy's own time; a plan deadline would then refuse the plan).
  int max_layer_search_ops = 256;
  // After the greedy and the layer search, the operator DP (operator_dp.h) searches the whole
  // chunk below their answer; exact while its fronts stay under dp_states labels per cut. 2,048
  // (issue 23): against the exact reference on 156 real-sized chunks, 512 left a worst of 2.47x
  // the optimum and a p90 of 1.021, 2,048 a worst of 1.275 and a p90 of 1.003.
  bool operator_dp = true;
  int dp_states = 2048;
  // Chunks with more operators skip the operator DP.
  int max_dp_ops = 1024;
  // The anytime path's first answer (issues 23, 43): the priced candidates (priced_greedy.h),
  // then the operator DP with fronts of fast_dp_states labels below their cost (no greedy, no
  // layer search); the planner sets it on a large chunk's cache miss and refines the answer off
  // the critical path (refiner.h). MitigationResult::first_answer says so. 0.32 ms p99 of CPU
  // time at 32 operators x 4 layers (the DP alone on 4 labels: 0.25 ms; docs/planner.md).
  bool fast = false;
  int fast_dp_states = 4;
  // Issue 43: the first answer starts from the priced candidates (priced_greedy.h), and the
  // operator DP above only searches below their cost. false: the DP alone, as before (kept to
  // measure the two side by side).
  bool fast_priced = true;
  // The full search takes the priced candidates as a bound too, beside the greedy's answer.
  bool priced_bound = true;
  // Pinned host bytes the assignment may offload (the session's grant, issue 14); negative: no
  // limit. Offload candidates that would pass it are unavailable, so less host means more
  // recompute/FP8.
  double host_limit_bytes = -1;

  // Whether `host_bytes` offloaded stays within host_limit_bytes.
  bool HostFits(double host_bytes) const {
    return host_limit_bytes < 0 || host_bytes <= host_limit_bytes;
  }

  // Whether these options let an operator take `s` (keep always).
  bool Permits(Strategy s) const {
    switch (s) {
      case Strategy::kRecompute:
        return allow_recompute;
      case Strategy::kOffload:
        return allow_offload;
      case Strategy::kFp8:
        return allow_fp8;
      case Strategy::kKeep:
        return true;
    }
    return false;
  }
};

// The chosen assignment and how it was reached.
struct MitigationResult {
  Assignment assignment;
  AssignmentCost cost;
  double budget = 0;
  bool fits = false;                     // cost.device_bytes <= budget
  bool fallback_full_recompute = false;  // the greedy ran out of candidates
  int rounds = 0;
  int rejected_conflicts = 0;
  int refinements = 0;             // switches made by the local search
  bool from_layer_search = false;  // the layer search beat the greedy
  bool from_operator_dp = false;   // the operator DP beat both
  bool exact = false;              // proven optimal (the operator DP's fronts were never cut)
  bool first_answer = false;       // the anytime path's quick answer (options.fast), not exact
  // ReplanAfterGate's operator DP: the labels per cut it searched with (0: it did not run), its
  // wall seconds, and whether the search's price (GateSearch) cut its labels or skipped it.
  int search_labels = 0;
  double search_s = 0;
  bool search_cut = false;
};

// What the downgrade's search (ReplanAfterGate's operator DP) may cost. It runs on the training
// thread between the router and the experts, so its time adds to the iteration's as surely as
// exposed copies do: it searches with at most `share` of the best exposed overhead found so far
// (the most it can remove) in CPU time, at `seconds_per_label` per label per cut (the caller's
// measurement of earlier searches at the same gate), and not at all below 16 labels per cut.
// seconds_per_label 0 (the default) or share 0: the full label count, whatever it costs. Where
// nothing found before the search fits, it runs in full at any price. A plain value.
struct GateSearch {
  double share = 0;
  double seconds_per_label = 0;
};

// Every operator with something to drop set to recompute: memory M0.
Assignment FullRecompute(const CostEvaluator& eval);

// Selects strategies so the micro-batch fits `budget` bytes at load factor r: the greedy, then the
// layer search and the operator DP below its answer, the cheapest wins. A budget below M0 is an
// error: nothing can meet it.
Result<MitigationResult> SelectMitigation(const CostEvaluator& eval, double r, double budget,
                                          const MitigationOptions& options = {});

// Deferred planning: once the gate of `gate_layer` has run and the observed load factor is
// known, re-checks `planned` against the budget (and `host_limit_bytes` when >= 0). If it no
// longer fits, the operators not run yet (that layer's MoE block on, and later layers) are
// planned again at the observed load (the priced candidates of priced_greedy.h with the others
// pinned, then the operator DP of operator_dp.h over them below the best so far), and the fixed
// rule is the alternative: the MoE block of that layer and later layers to recompute, then, over
// the host limit, their offloads to recompute. The cheapest that fits wins (issue 43; the rule
// alone before). Earlier operators are already executed.
// `allowed`: the strategies the planner may use (its MitigationOptions' allow_*; the rest of
// those options is not read here). `warm`: full-search plans of the whole chunk at (or near)
// the observed load (the planner's cached plans, issue 43), each a third alternative with the
// operators that ran set back to their plan; may be null. `search`: what the operator DP may
// cost (GateSearch; by default it always runs with its full label count).
MitigationResult ReplanAfterGate(const CostEvaluator& eval, const Assignment& planned,
                                 int gate_layer, double observed_r, double budget,
                                 double host_limit_bytes = -1,
                                 const MitigationOptions& allowed = MitigationOptions(),
                                 const std::vector<Assignment>* warm = nullptr,
                                 const GateSearch& search = GateSearch());

}  // namespace bgl::plan
