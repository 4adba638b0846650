#include "tools/bgl-sim/served_plans.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "governor/planner/json_limits.h"

namespace bgl::sim {
namespace {

constexpr const char* kFormat = "bgl-served-plans";
constexpr int kMaxMicroBatches = 100'000;
constexpr int kMaxChunks = 1024;
constexpr int kMaxStage = 1'000'000;

Status Bad(const std::string& where, const std::string& what) {
  return InvalidArgument(where + ": " + what);
}

// An integer field in [lo, hi]; `fallback` when absent and `optional`.
Status ReadInt(const nlohmann::json& obj, const char* key, const std::string& where, int lo, int hi,
               bool optional, int fallback, int& out) {
  if (!obj.contains(key)) {
    if (optional) {
      out = fallback;
      return OkStatus();
    }
    return Bad(where, std::string("'") + key + "' missing");
  }
  const nlohmann::json& v = obj[key];
  if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > hi) {
    return Bad(where + "." + key, "must be an integer in [" + std::to_string(lo) + ", " +
                                      std::to_string(hi) + "], got " + v.dump().substr(0, 40));
  }
  out = static_cast<int>(v.get<int64_t>());
  return OkStatus();
}

Result<plan::Strategy> ParseStrategy(const nlohmann::json& v, const std::string& where) {
  if (v.is_string()) {
    for (plan::Strategy s : plan::kAllStrategies) {
      if (v.get<std::string>() == plan::StrategyName(s)) return s;
    }
  }
  return Bad(where,
             "unknown strategy " + v.dump().substr(0, 40) + " (keep, recompute, offload, fp8)");
}

Result<plan::Chain> ParseChain(const nlohmann::json& v, const std::string& where) {
  if (v.is_string()) {
    for (plan::Chain c : {plan::Chain::kForward, plan::Chain::kBackward, plan::Chain::kOffload,
                          plan::Chain::kRecover}) {
      if (v.get<std::string>() == plan::ChainName(c)) return c;
    }
  }
  return Bad(where, "unknown chain " + v.dump().substr(0, 40) + " (F, B, O, R)");
}

Result<ServedPlan> ParsePlan(const nlohmann::json& j, const std::string& where) {
  if (!j.is_object()) return Bad(where, "must be an object");
  ServedPlan p;
  BGL_RETURN_IF_ERROR(
      ReadInt(j, "micro_batch", where, 0, kMaxMicroBatches - 1, false, 0, p.micro_batch));
  BGL_RETURN_IF_ERROR(ReadInt(j, "chunk", where, 0, kMaxChunks - 1, true, 0, p.chunk));
  if (j.contains("load_factor")) {
    const nlohmann::json& v = j["load_factor"];
    if (!v.is_number() || !(v.get<double>() > 0) || v.get<double>() > 64) {
      return Bad(where + ".load_factor",
                 "must be a number in (0, 64], got " + v.dump().substr(0, 40));
    }
    p.load_factor = v.get<double>();
  }
  if (!j.contains("operators") || !j["operators"].is_array() || j["operators"].empty()) {
    return Bad(where + ".operators", "must be a non-empty array of {name, strategy}");
  }
  const nlohmann::json& ops = j["operators"];
  for (size_t i = 0; i < ops.size(); ++i) {
    const std::string at = where + ".operators[" + std::to_string(i) + "]";
    if (!ops[i].is_object() || !ops[i].contains("name") || !ops[i]["name"].is_string() ||
        ops[i]["name"].get<std::string>().empty() || !ops[i].contains("strategy")) {
      return Bad(at, "must be an object with a 'name' string and a 'strategy'");
    }
    auto s = ParseStrategy(ops[i]["strategy"], at + ".strategy");
    if (!s.ok()) return s.status();
    p.operators.emplace_back(ops[i]["name"].get<std::string>(), *s);
  }
  if (j.contains("issue_order")) {
    const nlohmann::json& order = j["issue_order"];
    if (!order.is_array()) return Bad(where + ".issue_order", "must be an array");
    for (size_t i = 0; i < order.size(); ++i) {
      const std::string at = where + ".issue_order[" + std::to_string(i) + "]";
      if (!order[i].is_object() || !order[i].contains("chain")) {
        return Bad(at, "must be an object with 'chain', 'stage' and 'round'");
      }
      ServedIssueItem item;
      auto c = ParseChain(order[i]["chain"], at + ".chain");
      if (!c.ok()) return c.status();
      item.chain = *c;
      BGL_RETURN_IF_ERROR(ReadInt(order[i], "stage", at, 0, kMaxStage, false, 0, item.stage));
      BGL_RETURN_IF_ERROR(ReadInt(order[i], "round", at, 0, kMaxStage, false, 0, item.round));
      p.issue_order.push_back(item);
    }
  }
  return p;
}

}  // namespace

Result<ServedPlans> ParseServedPlans(const std::string& text, const std::string& source) {
  const std::string where = "plans: " + source;
  BGL_RETURN_IF_ERROR(plan::CheckJsonNesting(text, plan::kDefaultMaxJsonDepth, where));
  const nlohmann::json doc = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return Bad(where, "not valid JSON");
  if (!doc.is_object()) return Bad(where, "the top level must be an object");
  if (!doc.contains("format") || doc["format"] != kFormat) {
    return Bad(where + ": format", std::string("must be \"") + kFormat + "\"");
  }
  if (!doc.contains("version") || doc["version"] != 1) {
    return Bad(where + ": version",
               "must be 1, got " + (doc.contains("version") ? doc["version"].dump() : "none"));
  }
  if (!doc.contains("iterations") || !doc["iterations"].is_array() || doc["iterations"].empty()) {
    return Bad(where + ": iterations", "must be a non-empty array");
  }
  ServedPlans out;
  out.source = source;
  const nlohmann::json& its = doc["iterations"];
  for (size_t it = 0; it < its.size(); ++it) {
    const std::string at = where + ": iterations[" + std::to_string(it) + "]";
    if (!its[it].is_object() || !its[it].contains("plans") || !its[it]["plans"].is_array()) {
      return Bad(at, "must be an object with a 'plans' array");
    }
    std::vector<ServedPlan> plans;
    const nlohmann::json& list = its[it]["plans"];
    for (size_t i = 0; i < list.size(); ++i) {
      auto p = ParsePlan(list[i], at + ".plans[" + std::to_string(i) + "]");
      if (!p.ok()) return p.status();
      for (const ServedPlan& q : plans) {
        if (q.micro_batch == p->micro_batch && q.chunk == p->chunk) {
          return Bad(at + ".plans[" + std::to_string(i) + "]",
                     "a second plan for micro-batch " + std::to_string(p->micro_batch) + " chunk " +
                         std::to_string(p->chunk));
        }
      }
      plans.push_back(std::move(*p));
    }
    out.iterations.push_back(std::move(plans));
  }
  return out;
}

Result<ServedPlans> ReadServedPlans(const std::string& path) {
  std::ifstream in(path);
  if (!in) return NotFound("plans: cannot open '" + path + "'");
  std::stringstream buffer;
  buffer << in.rdbuf();
  return ParseServedPlans(buffer.str(), path);
}

Result<plan::Assignment> ServedAssignment(const ServedPlan& p, const plan::StageGraph& g,
                                          const std::string& where) {
  std::map<std::string, size_t> index;
  for (size_t o = 0; o < g.ops.size(); ++o) index[g.ops[o].name] = o;
  plan::Assignment a(g.ops.size(), plan::Strategy::kKeep);
  std::vector<char> named(g.ops.size(), 0);
  for (const auto& [name, strategy] : p.operators) {
    auto found = index.find(name);
    if (found == index.end()) {
      return Bad(where, "operator '" + name + "' is not in the model's stage graph");
    }
    if (named[found->second]) return Bad(where, "operator '" + name + "' named twice");
    named[found->second] = 1;
    a[found->second] = strategy;
  }
  for (size_t o = 0; o < g.ops.size(); ++o) {
    if (!named[o]) return Bad(where, "no strategy for operator '" + g.ops[o].name + "'");
  }
  return a;
}

Result<LoadTrace> LoadsFromPlans(const ServedPlans& plans, int ranks, int micro_batches,
                                 double normal_max) {
  LoadTrace trace;
  for (size_t it = 0; it < plans.iterations.size(); ++it) {
    std::vector<double> loads(static_cast<size_t>(micro_batches), 0.0);
    for (const ServedPlan& p : plans.iterations[it]) {
      if (p.micro_batch >= micro_batches) {
        return Bad("plans: " + plans.source,
                   "iterations[" + std::to_string(it) + "] plans micro-batch " +
                       std::to_string(p.micro_batch) + ", the model has " +
                       std::to_string(micro_batches));
      }
      double& l = loads[static_cast<size_t>(p.micro_batch)];
      l = std::max(l, p.load_factor);
    }
    for (int mb = 0; mb < micro_batches; ++mb) {
      if (loads[static_cast<size_t>(mb)] == 0) {
        return Bad("plans: " + plans.source, "iterations[" + std::to_string(it) +
                                                 "] has no plan for micro-batch " +
                                                 std::to_string(mb));
      }
    }
    const double worst = *std::max_element(loads.begin(), loads.end());
    trace.loads.emplace_back(static_cast<size_t>(ranks), loads);
    trace.spike.push_back(worst >= normal_max ? 1 : 0);
  }
  return trace;
}

}  // namespace bgl::sim
