// Static mitigation plans: the one assignment a static policy applies to every micro-batch of a
// stage, sized once for a design load factor (how Megatron-Kuai, AdaPipe and the ablation's
// static levels provision activation memory).
#pragma once

#include <vector>

#include "governor/planner/assignment.h"
#include "governor/planner/pipeline_schedule.h"
#include "tools/bgl-sim/policy.h"

namespace bgl::sim {

// Most micro-batches (units of one chunk) whose activations a stage holds at once.
int MaxLiveUnits(const std::vector<plan::Step>& steps);

// The memory a static plan may give one micro-batch: the activation capacity shared evenly by the
// most micro-batches a stage holds at once.
double StaticUnitBudget(double activation_capacity, const std::vector<plan::Step>& steps);

// Full recompute of the first `layers` layers of the chunk; the rest keep everything.
plan::Assignment LayerRecompute(const plan::CostEvaluator& eval, int layers);

// The assignment `policy` chooses for a stage whose micro-batches may use `unit_budget` bytes at
// load factor `design_load`. Static policies only (not L3/L4). Falls back to full recompute when
// nothing lighter fits.
plan::Assignment StaticAssignment(Policy policy, const plan::CostEvaluator& eval,
                                  double design_load, double unit_budget);

// Forward FLOPs of the operators an assignment reruns in backward, at load factor r.
double RecomputeFlops(const plan::CostEvaluator& eval, const plan::Assignment& a, double r);

}  // namespace bgl::sim
