#include "governor/planner/plan_format.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <string_view>

#include "base/units.h"

namespace bgl::plan {

std::string IssueLabel(const IssueItem& item, const StageGraph& g) {
  if (item.first < 0) return "";
  const bool tensors = item.chain == Chain::kOffload || item.resource == Resource::kH2D;
  auto name = [&](int i) {
    return tensors ? g.tensors.at(static_cast<size_t>(i)).name
                   : g.ops.at(static_cast<size_t>(i)).name;
  };
  std::string label = item.chain == Chain::kOffload     ? "offload "
                      : item.resource == Resource::kH2D ? "reload "
                      : item.chain == Chain::kRecover   ? "recompute "
                                                        : "";
  label += name(item.first);
  if (item.last != item.first) label += ".." + name(item.last);
  return label;
}

std::string FormatPlanTable(const Plan& plan, const StagePlanner& planner) {
  const StageGraph& g = planner.graph();
  const CostEvaluator& eval = planner.evaluator();
  std::ostringstream out;
  char line[256];
  out << "phase " << PhaseName(plan.phase) << ", forward micro-batch " << plan.micro_batch
      << " chunk " << plan.chunk << ", load factor " << plan.load_factor << "\n";
  out << "budget " << FormatBytes(plan.budget_bytes) << " (free " << FormatBytes(plan.free_bytes)
      << " over k=" << plan.k << "), M0 " << FormatBytes(plan.m0_bytes) << ", keep-all "
      << FormatBytes(plan.keep_all_bytes) << " -> planned " << FormatBytes(plan.predicted_bytes)
      << " on device, " << FormatBytes(plan.host_bytes) << " on host\n";
  if (plan.infeasible) out << "PRESSURE: free memory is below k x M0; evict before this forward\n";
  if (plan.fallback_full_recompute) out << "fallback: full recompute of the chunk\n";
  if (plan.first_answer) out << "first answer: the full search refines it in the background\n";
  if (plan.refined) out << "refined: the background full search's plan\n";
  if (plan.warm) out << "warm: the warm-up's full search planned this key before it was met\n";
  if (plan.nearest) {
    out << "nearest: a cold key served a neighbouring key's full-search plan that fits; its own "
           "full search refines it in the background\n";
  }
  out << "exposed overhead " << FormatSeconds(plan.overhead_s) << "; point serial "
      << FormatSeconds(plan.serial_s) << ", dual-batch overlapped "
      << FormatSeconds(plan.overlapped_s) << (plan.cache_hit ? " (cache hit)" : "") << "\n\n";
  std::snprintf(line, sizeof line, "%-24s %-18s %-10s %12s %10s %10s  %s\n", "operator", "kind",
                "strategy", "saved", "fwd", "bwd", "tensors");
  out << line;
  for (size_t o = 0; o < g.ops.size() && o < plan.strategies.size(); ++o) {
    const Operator& op = g.ops[o];
    double saved = 0;
    std::string tensors;
    for (int t : op.saves) {
      saved += g.tensors[t].Bytes(plan.load_factor);
      tensors += (tensors.empty() ? "" : " ") +
                 g.tensors[t].name.substr(g.tensors[t].name.find('.') + 1) + "[" +
                 PlacementName(eval.TensorPlacement(plan.strategies, t)) + "]";
    }
    std::snprintf(line, sizeof line, "%-24s %-18s %-10s %12s %10s %10s  %s\n", op.name.c_str(),
                  OpKindName(op.kind), StrategyName(plan.strategies[o]), FormatBytes(saved).c_str(),
                  FormatSeconds(op.ForwardTime(plan.load_factor)).c_str(),
                  FormatSeconds(op.BackwardTime(plan.load_factor)).c_str(), tensors.c_str());
    out << line;
  }
  if (!plan.issue_order.empty()) {
    out << "\nissue order (round: chain stage on resource, duration)\n";
    for (const IssueItem& item : plan.issue_order) {
      std::snprintf(line, sizeof line, "%5d: %s%-3d %-8s %10s  %s\n", item.round,
                    ChainName(item.chain), item.stage, ResourceName(item.resource),
                    FormatSeconds(item.duration_s).c_str(), IssueLabel(item, g).c_str());
      out << line;
    }
  }
  return out.str();
}

nlohmann::json PlanToJson(const Plan& plan, const StageGraph& g) {
  nlohmann::json j;
  j["phase"] = PhaseName(plan.phase);
  j["micro_batch"] = plan.micro_batch;
  j["chunk"] = plan.chunk;
  j["load_factor"] = plan.load_factor;
  j["budget_bytes"] = plan.budget_bytes;
  j["free_bytes"] = plan.free_bytes;
  j["k"] = plan.k;
  j["infeasible"] = plan.infeasible;
  j["m0_bytes"] = plan.m0_bytes;
  j["keep_all_bytes"] = plan.keep_all_bytes;
  j["predicted_bytes"] = plan.predicted_bytes;
  j["host_bytes"] = plan.host_bytes;
  j["bandwidth_share"] = plan.bandwidth_share;
  j["overhead_s"] = plan.overhead_s;
  j["serial_s"] = plan.serial_s;
  j["overlapped_s"] = plan.overlapped_s;
  j["fallback_full_recompute"] = plan.fallback_full_recompute;
  j["deferred"] = plan.deferred;
  j["cache_hit"] = plan.cache_hit;
  j["first_answer"] = plan.first_answer;
  j["refined"] = plan.refined;
  j["warm"] = plan.warm;
  j["nearest"] = plan.nearest;
  auto& ops = j["operators"] = nlohmann::json::array();
  for (size_t o = 0; o < plan.strategies.size() && o < g.ops.size(); ++o) {
    ops.push_back({{"name", g.ops[o].name},
                   {"kind", OpKindName(g.ops[o].kind)},
                   {"strategy", StrategyName(plan.strategies[o])}});
  }
  auto& order = j["issue_order"] = nlohmann::json::array();
  for (const IssueItem& item : plan.issue_order) {
    order.push_back({{"round", item.round},
                     {"chain", ChainName(item.chain)},
                     {"stage", item.stage},
                     {"resource", ResourceName(item.resource)},
                     {"duration_s", item.duration_s},
                     {"first", item.first},
                     {"last", item.last},
                     {"label", IssueLabel(item, g)}});
  }
  return j;
}

namespace {

// A JSON object written in place; keys must come in the order nlohmann's (sorted) dump gives.
class JsonWriter {
 public:
  explicit JsonWriter(std::string& out) : out_(out) {}
  void Open() {
    out_ += '{';
    first_ = true;
  }
  void Close() { out_ += '}'; }
  void Key(const char* key) {
    if (!first_) out_ += ',';
    first_ = false;
    out_ += '"';
    out_ += key;
    out_ += "\":";
  }
  void Str(const char* key, std::string_view v) {
    Key(key);
    String(v);
  }
  void Int(const char* key, int64_t v) {
    Key(key);
    char buf[24];
    const char* end = std::to_chars(buf, buf + sizeof buf, v).ptr;
    out_.append(buf, static_cast<size_t>(end - buf));
  }
  void Bool(const char* key, bool v) {
    Key(key);
    out_ += v ? "true" : "false";
  }
  // As nlohmann writes a double: null where not finite, else the shortest text that reads back
  // the same, with ".0" where that text reads as an integer.
  void Double(const char* key, double v) {
    Key(key);
    if (!std::isfinite(v)) {
      out_ += "null";
      return;
    }
    char buf[32];
    const char* end = std::to_chars(buf, buf + sizeof buf, v).ptr;
    const size_t at = out_.size();
    out_.append(buf, static_cast<size_t>(end - buf));
    if (out_.find_first_of(".eE", at) == std::string::npos) out_ += ".0";
  }
  void String(std::string_view v) {
    out_ += '"';
    for (const char c : v) {
      switch (c) {
        case '"':
          out_ += "\\\"";
          break;
        case '\\':
          out_ += "\\\\";
          break;
        case '\b':
          out_ += "\\b";
          break;
        case '\f':
          out_ += "\\f";
          break;
        case '\n':
          out_ += "\\n";
          break;
        case '\r':
          out_ += "\\r";
          break;
        case '\t':
          out_ += "\\t";
          break;
        default:
          if (static_cast<unsigned char>(c) < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
            out_ += buf;
          } else {
            out_ += c;
          }
      }
    }
    out_ += '"';
  }
  void Comma() { out_ += ','; }
  void Raw(char c) { out_ += c; }

 private:
  std::string& out_;
  bool first_ = true;
};

}  // namespace

std::string PlanToJsonText(const Plan& plan, const StageGraph& g) {
  std::string out;
  const size_t n = std::min(plan.strategies.size(), g.ops.size());
  out.reserve(512 + 96 * n + 160 * plan.issue_order.size());
  JsonWriter w(out);
  w.Open();
  w.Double("bandwidth_share", plan.bandwidth_share);
  w.Int("budget_bytes", plan.budget_bytes);
  w.Bool("cache_hit", plan.cache_hit);
  w.Int("chunk", plan.chunk);
  w.Bool("deferred", plan.deferred);
  w.Bool("fallback_full_recompute", plan.fallback_full_recompute);
  w.Bool("first_answer", plan.first_answer);
  w.Int("free_bytes", plan.free_bytes);
  w.Int("host_bytes", plan.host_bytes);
  w.Bool("infeasible", plan.infeasible);
  w.Key("issue_order");
  w.Raw('[');
  for (size_t i = 0; i < plan.issue_order.size(); ++i) {
    const IssueItem& item = plan.issue_order[i];
    if (i > 0) w.Comma();
    JsonWriter o(out);
    o.Open();
    o.Str("chain", ChainName(item.chain));
    o.Double("duration_s", item.duration_s);
    o.Int("first", item.first);
    o.Str("label", IssueLabel(item, g));
    o.Int("last", item.last);
    o.Str("resource", ResourceName(item.resource));
    o.Int("round", item.round);
    o.Int("stage", item.stage);
    o.Close();
  }
  w.Raw(']');
  w.Int("k", plan.k);
  w.Int("keep_all_bytes", plan.keep_all_bytes);
  w.Double("load_factor", plan.load_factor);
  w.Int("m0_bytes", plan.m0_bytes);
  w.Int("micro_batch", plan.micro_batch);
  w.Bool("nearest", plan.nearest);
  w.Key("operators");
  w.Raw('[');
  for (size_t o = 0; o < n; ++o) {
    if (o > 0) w.Comma();
    JsonWriter op(out);
    op.Open();
    op.Str("kind", OpKindName(g.ops[o].kind));
    op.Str("name", g.ops[o].name);
    op.Str("strategy", StrategyName(plan.strategies[o]));
    op.Close();
  }
  w.Raw(']');
  w.Double("overhead_s", plan.overhead_s);
  w.Double("overlapped_s", plan.overlapped_s);
  w.Str("phase", PhaseName(plan.phase));
  w.Int("predicted_bytes", plan.predicted_bytes);
  w.Bool("refined", plan.refined);
  w.Double("serial_s", plan.serial_s);
  w.Bool("warm", plan.warm);
  w.Close();
  return out;
}

std::string CurveToCsv(const IterationCurve& planned, const IterationCurve& keep_all) {
  std::ostringstream out;
  out << "step,time_s,planned_bytes,keep_all_time_s,keep_all_bytes\n";
  for (size_t i = 0; i < planned.points.size(); ++i) {
    out << planned.points[i].step << "," << planned.points[i].time_s << ","
        << static_cast<int64_t>(planned.points[i].bytes);
    if (i < keep_all.points.size()) {
      out << "," << keep_all.points[i].time_s << ","
          << static_cast<int64_t>(keep_all.points[i].bytes);
    }
    out << "\n";
  }
  return out.str();
}

}  // namespace bgl::plan
