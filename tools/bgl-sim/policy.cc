#include "tools/bgl-sim/policy.h"

#include <algorithm>
#include <sstream>

namespace bgl::sim {
namespace {

struct PolicyInfo {
  Policy policy;
  const char* name;
  const char* description;
};

constexpr PolicyInfo kPolicies[] = {
    {Policy::kStaticUnder, "static-under",
     "selective recompute sized for normal load on every stage; an OOM restarts as static-over"},
    {Policy::kStaticOver, "static-over", "full recompute of every layer"},
    {Policy::kKuaiLike, "kuai-like",
     "per-operator recompute and offload chosen once per stage (Megatron-Kuai)"},
    {Policy::kAdaPipeLike, "adapipe-like", "per-stage recompute chosen once (AdaPipe)"},
    {Policy::kL1, "L1", "ablation baseline: layer-level recompute, same on every stage"},
    {Policy::kL2, "L2", "fine-grained static mitigation (recompute, offload, FP8) per stage"},
    {Policy::kL3, "L3", "dynamic per-micro-batch planning, program order"},
    {Policy::kL4, "L4", "dynamic planning with fused dual-batch execution (BaGuaLu)"},
    {Policy::kPlans, "plans", "the plans a run was served (--plans), replayed"},
};

}  // namespace

const char* PolicyName(Policy p) {
  for (const auto& info : kPolicies) {
    if (info.policy == p) return info.name;
  }
  return "?";
}

const char* PolicyDescription(Policy p) {
  for (const auto& info : kPolicies) {
    if (info.policy == p) return info.description;
  }
  return "?";
}

const char* ExecModelName(ExecModel e) {
  switch (e) {
    case ExecModel::kSerial:
      return "serial";
    case ExecModel::kLockstep:
      return "lockstep";
    case ExecModel::kDualBatch:
      return "dual-batch";
  }
  return "?";
}

Result<ExecModel> ParseExecModel(const std::string& name) {
  for (ExecModel e : {ExecModel::kSerial, ExecModel::kLockstep, ExecModel::kDualBatch}) {
    if (name == ExecModelName(e)) return e;
  }
  return InvalidArgument("--exec: unknown execution model '" + name +
                         "' (known: serial, lockstep, dual-batch)");
}

bool IsDynamic(Policy p) { return p == Policy::kL3 || p == Policy::kL4 || p == Policy::kPlans; }

ExecModel DefaultExecModel(Policy p) {
  return p == Policy::kL4 || p == Policy::kPlans ? ExecModel::kDualBatch : ExecModel::kSerial;
}

std::vector<Policy> AllPolicies() {
  std::vector<Policy> all;
  for (const auto& info : kPolicies) {
    if (info.policy != Policy::kPlans) all.push_back(info.policy);
  }
  return all;
}

Result<std::vector<Policy>> ParsePolicies(const std::string& text) {
  std::vector<Policy> out;
  auto add = [&](Policy p) {
    if (std::find(out.begin(), out.end(), p) == out.end()) out.push_back(p);
  };
  std::stringstream in(text);
  std::string name;
  while (std::getline(in, name, ',')) {
    if (name == "all") {
      for (Policy p : AllPolicies()) add(p);
    } else if (name == "baselines") {
      for (Policy p : {Policy::kStaticUnder, Policy::kStaticOver, Policy::kKuaiLike,
                       Policy::kAdaPipeLike, Policy::kL4}) {
        add(p);
      }
    } else if (name == "ablation") {
      for (Policy p : {Policy::kL1, Policy::kL2, Policy::kL3, Policy::kL4}) add(p);
    } else if (name == "bagualu") {
      add(Policy::kL4);
    } else {
      bool found = false;
      for (const auto& info : kPolicies) {
        if (name == info.name) {
          add(info.policy);
          found = true;
        }
      }
      if (!found) {
        std::string known = "all, baselines, ablation, bagualu";
        for (const auto& info : kPolicies) known += std::string(", ") + info.name;
        return InvalidArgument("--policy: unknown policy '" + name + "' (known: " + known + ")");
      }
    }
  }
  if (out.empty()) return InvalidArgument("--policy: no policy named");
  return out;
}

}  // namespace bgl::sim
