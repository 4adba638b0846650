// Policies: how a system manages activation memory (the paper's baselines and BaGuaLu's ablation
// levels), and the execution model that turns a scheduling point's work into time.
#pragma once

#include <string>
#include <vector>

#include "base/status.h"

namespace bgl::sim {

// The activation-memory policies the simulator compares.
enum class Policy {
  kStaticUnder,  // selective recompute sized for normal load, same on every stage; OOM -> over
  kStaticOver,   // full recompute of every layer: memory independent of the load
  kKuaiLike,     // Megatron-Kuai: per-operator recompute + offload chosen once, per stage
  kAdaPipeLike,  // AdaPipe: per-stage recompute chosen once
  kL1,           // BaGuaLu ablation: coarse layer-level recompute, same on every stage
  kL2,           // + fine-grained static mitigation (recompute, offload, FP8) per stage
  kL3,           // + dynamic per-micro-batch planning (StagePlanner, program order)
  kL4,           // + fused dual-batch execution (StagePlanner with the DP): full BaGuaLu
  kPlans,  // the plans a run was served (--plans, served_plans.h), replayed: the cost model alone
};

// How a scheduling point's chains (F, B, O, R) are issued.
enum class ExecModel {
  kSerial,    // Megatron 1F1B: forward then backward; copies overlap, recompute does not
  kLockstep,  // program order, chains advance one stage per round (the planner's L3)
  kDualBatch  // the planner's DP order (paper V-B)
};

const char* PolicyName(Policy p);
const char* PolicyDescription(Policy p);
const char* ExecModelName(ExecModel e);
Result<ExecModel> ParseExecModel(const std::string& name);
// True for the policies whose plans differ per micro-batch (the StagePlanner's, or a run's).
bool IsDynamic(Policy p);
// The execution model a policy runs under unless overridden.
ExecModel DefaultExecModel(Policy p);

// Parses a comma-separated list of names; "all", "baselines" and "ablation" expand to groups
// ("bagualu" is L4); "plans" (with --plans) is in none of them.
Result<std::vector<Policy>> ParsePolicies(const std::string& text);
std::vector<Policy> AllPolicies();

}  // namespace bgl::sim
