#include "tools/bgl-sim/static_plan.h"

#include <algorithm>
#include <set>
#include <utility>

#include "governor/planner/mitigation.h"

namespace bgl::sim {

int MaxLiveUnits(const std::vector<plan::Step>& steps) {
  std::set<std::pair<int, int>> live;
  size_t most = 0;
  for (const plan::Step& s : steps) {
    if (s.forward) {
      live.insert({s.micro_batch, s.chunk});
      most = std::max(most, live.size());
    } else {
      live.erase({s.micro_batch, s.chunk});
    }
  }
  return static_cast<int>(most);
}

double StaticUnitBudget(double activation_capacity, const std::vector<plan::Step>& steps) {
  return activation_capacity / std::max(1, MaxLiveUnits(steps));
}

plan::Assignment LayerRecompute(const plan::CostEvaluator& eval, int layers) {
  const plan::Assignment full = plan::FullRecompute(eval);
  plan::Assignment a(full.size(), plan::Strategy::kKeep);
  for (size_t o = 0; o < a.size(); ++o) {
    if (eval.graph().ops[o].layer < layers) a[o] = full[o];
  }
  return a;
}

namespace {

// The greedy of Algorithm 2, restricted to what the policy may use, once, at the design load.
plan::Assignment Greedy(const plan::CostEvaluator& eval, double r, double budget,
                        const plan::MitigationOptions& options) {
  auto selected = plan::SelectMitigation(eval, r, budget, options);
  if (!selected.ok() || !selected->fits) return plan::FullRecompute(eval);
  return selected->assignment;
}

}  // namespace

plan::Assignment StaticAssignment(Policy policy, const plan::CostEvaluator& eval,
                                  double design_load, double unit_budget) {
  plan::MitigationOptions options;
  switch (policy) {
    case Policy::kStaticOver:
      return plan::FullRecompute(eval);
    case Policy::kStaticUnder:
    case Policy::kAdaPipeLike:
      // Selective recompute: operators chosen by the greedy, recompute only.
      options.allow_offload = false;
      options.allow_fp8 = false;
      return Greedy(eval, design_load, unit_budget, options);
    case Policy::kKuaiLike:
      options.allow_fp8 = false;
      return Greedy(eval, design_load, unit_budget, options);
    case Policy::kL2:
      return Greedy(eval, design_load, unit_budget, options);
    case Policy::kL1: {
      // Coarse: recompute whole layers, as few as fit.
      for (int layers = 0; layers <= eval.graph().layers; ++layers) {
        plan::Assignment a = LayerRecompute(eval, layers);
        if (eval.Evaluate(a, design_load).device_bytes <= unit_budget) return a;
      }
      return plan::FullRecompute(eval);
    }
    case Policy::kL3:
    case Policy::kL4:
    case Policy::kPlans:
      break;
  }
  return plan::FullRecompute(eval);
}

double RecomputeFlops(const plan::CostEvaluator& eval, const plan::Assignment& a, double r) {
  const auto rerun = eval.RecomputeClosure(a);
  double flops = 0;
  for (size_t o = 0; o < rerun.size(); ++o) {
    if (!rerun[o]) continue;
    const plan::Operator& op = eval.graph().ops[o];
    flops += op.scales_with_load ? op.flops * r : op.flops;
  }
  return flops;
}

}  // namespace bgl::sim
