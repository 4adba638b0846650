// The planner's C API (include/bgl/planner.h): JSON in, JSON out, errors through a thread-local
// message. No exception crosses the boundary.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "bgl/planner.h"
#include "governor/planner/pipeline_schedule.h"
#include "governor/planner/plan_format.h"
#include "governor/planner/planner.h"

struct bgl_planner {
  std::unique_ptr<bgl::plan::StagePlanner> planner;
};

namespace {

thread_local std::string last_error;

using bgl::plan::StagePlanner;
using nlohmann::json;

char* Fail(const std::string& message) {
  last_error = message;
  return nullptr;
}

char* Dup(const std::string& text) {
  char* out = static_cast<char*>(std::malloc(text.size() + 1));
  if (!out) return Fail("out of host memory");
  std::memcpy(out, text.c_str(), text.size() + 1);
  last_error.clear();
  return out;
}

bool ParseObject(const char* text, const char* what, json& out) {
  if (!text) {
    last_error = std::string(what) + ": NULL";
    return false;
  }
  // Nesting is checked on the text: a deep document would overflow the stack when copied.
  if (bgl::Status s = bgl::plan::CheckJsonNesting(text, bgl::plan::kDefaultMaxJsonDepth, what);
      !s.ok()) {
    last_error = s.message();
    return false;
  }
  out = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (out.is_discarded() || !out.is_object()) {
    last_error = std::string(what) + ": not a JSON object";
    return false;
  }
  return true;
}

json StepsJson(const std::vector<bgl::plan::Step>& steps) {
  json out = json::array();
  for (const auto& s : steps) {
    out.push_back({{"forward", s.forward},
                   {"micro_batch", s.micro_batch},
                   {"chunk", s.chunk},
                   {"phase", bgl::plan::PhaseName(s.phase)}});
  }
  return out;
}

// The optional fields of one JSON object (options_json, point_json), read by name: each Read
// fails with the field's name when its type is wrong, and Done refuses a field no Read or Known
// named, so the reads are the one list of an object's fields. Not thread-safe (one call's use).
class Fields {
 public:
  Fields(const json& doc, const char* what) : doc_(doc), what_(what) {}

  // `key` into `out` where the object has it (null counts as absent).
  template <typename T>
  Fields& Read(const char* key, T& out) {
    names_.push_back(key);
    if (!ok_ || !doc_.contains(key) || doc_[key].is_null()) return *this;
    try {
      out = doc_[key].get<T>();
    } catch (const json::exception&) {
      last_error = std::string(what_) + ": field '" + key + "' has the wrong type";
      ok_ = false;
    }
    return *this;
  }
  // A field read elsewhere (its own parser).
  Fields& Known(const char* key) {
    names_.push_back(key);
    return *this;
  }
  // True when every read succeeded and the object has no field it did not name; else false with
  // last_error naming the field.
  bool Done() {
    if (!ok_) return false;
    for (const auto& [key, value] : doc_.items()) {
      if (std::none_of(names_.begin(), names_.end(),
                       [&](const char* name) { return key == name; })) {
        last_error = std::string(what_) + ": unknown field '" + key + "'";
        return false;
      }
    }
    return true;
  }

 private:
  const json& doc_;
  const char* what_;
  std::vector<const char*> names_;
  bool ok_ = true;
};

}  // namespace

extern "C" {

bgl_planner* bgl_planner_create(const char* model_json, const char* options_json) {
  try {
    json model;
    if (!ParseObject(model_json, "model_json", model)) return nullptr;
    auto config = bgl::plan::ModelConfigFromJson(model, "model_json");
    if (!config.ok()) return reinterpret_cast<bgl_planner*>(Fail(config.status().message()));
    json options = json::object();
    if (options_json && !ParseObject(options_json, "options_json", options)) return nullptr;
    std::string gpu = config->gpu;
    bgl::plan::PlannerOptions po;
    bool dual_batch = true, offload = true, fp8 = true, recompute = true;
    std::string issue;
    Fields fields(options, "options_json");
    fields.Read("gpu", gpu)
        .Read("capacity_bytes", po.capacity_bytes)
        .Read("pipeline_rank", po.pipeline_rank)
        .Read("dual_batch", dual_batch)
        .Read("issue_policy", issue)
        .Read("allow_offload", offload)
        .Read("allow_fp8", fp8)
        .Read("allow_recompute", recompute)
        .Known("calibration")
        .Read("budget_step_bytes", po.budget_step_bytes)
        .Read("load_bucket", po.load_bucket)
        .Read("schedule_load_class", po.schedule_load_class)
        .Read("anytime_min_ops", po.anytime_min_ops)
        .Read("warm_up", po.warm_up)
        .Read("warm_spike_bound", po.warm_spike_bound)
        .Read("warm_max_keys", po.warm_max_keys)
        .Read("warm_nice", po.warm_nice)
        .Read("refine_nice", po.refine_nice)
        .Read("gate_search_share", po.gate_search_share);
    if (!fields.Done()) return nullptr;
    if (!options.contains("issue_policy") || options["issue_policy"].is_null()) {
      issue = dual_batch ? "dual-batch" : "serial";
    }
    if (issue == "dual-batch")
      po.issue_policy = bgl::plan::IssuePolicy::kDualBatch;
    else if (issue == "lockstep")
      po.issue_policy = bgl::plan::IssuePolicy::kLockstep;
    else if (issue == "serial")
      po.issue_policy = bgl::plan::IssuePolicy::kSerial;
    else {
      return reinterpret_cast<bgl_planner*>(
          Fail("options_json: field 'issue_policy' must be dual-batch, lockstep or serial, not '" +
               issue + "'"));
    }
    po.mitigation.allow_offload = offload;
    po.mitigation.allow_fp8 = fp8;
    po.mitigation.allow_recompute = recompute;
    auto hw = bgl::plan::HardwareProfileByName(gpu);
    if (!hw.ok()) return reinterpret_cast<bgl_planner*>(Fail(hw.status().message()));
    if (options.contains("calibration") && !options["calibration"].is_null()) {
      bgl::Status s = bgl::plan::ApplyCalibration(options["calibration"], *hw);
      if (!s.ok()) return reinterpret_cast<bgl_planner*>(Fail(s.message()));
    }
    auto planner = StagePlanner::Create(*config, *hw, po);
    if (!planner.ok()) return reinterpret_cast<bgl_planner*>(Fail(planner.status().message()));
    last_error.clear();
    return new bgl_planner{std::move(*planner)};
  } catch (const std::exception& e) {
    return reinterpret_cast<bgl_planner*>(Fail(std::string("internal error: ") + e.what()));
  }
}

void bgl_planner_destroy(bgl_planner* planner) { delete planner; }

char* bgl_planner_calibrated_profile(const char* calibration_json, const char* gpu) {
  try {
    json doc;
    if (!ParseObject(calibration_json, "calibration", doc)) return nullptr;
    auto hw = bgl::plan::HardwareProfileByName(gpu != nullptr ? gpu : "h200");
    if (!hw.ok()) return Fail(hw.status().message());
    if (bgl::Status s = bgl::plan::ApplyCalibration(doc, *hw); !s.ok()) return Fail(s.message());
    const bgl::plan::HardwareProfile& p = *hw;
    auto roof = [](const bgl::plan::Roofline& r) {
      return json{{"launch_floor_us", r.launch_floor_s * 1e6},
                  {"peak_GBps", r.peak_bytes_per_s / 1e9}};
    };
    json out = {{"gpu", p.name},
                {"peak_tflops", p.peak_flops / 1e12},
                {"matmul_efficiency", p.matmul_efficiency},
                {"hbm_GBps", p.hbm_bytes_per_s / 1e9},
                {"memory_efficiency", p.memory_efficiency},
                {"memory_GiB", static_cast<double>(p.memory_bytes) / (1024.0 * 1024 * 1024)},
                {"kernel_launch_us", p.kernel_launch_s * 1e6},
                {"intra_node_GBps", p.intra_node_bytes_per_s / 1e9},
                {"inter_node_GBps", p.inter_node_bytes_per_s / 1e9},
                {"gpus_per_node", p.gpus_per_node},
                {"copy_overlap", p.copy_overlap},
                {"copy_host_us", p.copy_host_s * 1e6},
                {"rerun_host_us", p.rerun_host_s * 1e6},
                {"rooflines",
                 {{"offload", roof(p.offload)},
                  {"reload", roof(p.reload)},
                  {"fp8_cast", roof(p.fp8_cast)}}}};
    if (!p.emulated_link.empty()) {
      out["emulated_link"] = {{"stands_for", p.emulated_link},
                              {"compute_scale", p.emulated_compute_scale}};
    }
    return Dup(out.dump());
  } catch (const std::exception& e) {
    return Fail(std::string("internal error: ") + e.what());
  }
}

char* bgl_planner_describe(bgl_planner* handle) {
  if (!handle) return Fail("planner: NULL handle");
  try {
    const StagePlanner& p = *handle->planner;
    const auto& g = p.graph();
    json j;
    j["model"] = p.config().name;
    j["activation_capacity_bytes"] = static_cast<int64_t>(p.activation_capacity());
    j["m0_bytes"] = static_cast<int64_t>(p.m0());
    j["keep_all_bytes"] = static_cast<int64_t>(g.KeepAllBytes(1.0));
    j["micro_batches"] = p.config().MicroBatches();
    j["chunks"] = p.config().Chunks();
    j["layers_per_chunk"] = g.layers;
    auto& ops = j["operators"] = json::array();
    for (const auto& o : g.ops) {
      ops.push_back({{"name", o.name},
                     {"kind", bgl::plan::OpKindName(o.kind)},
                     {"layer", o.layer},
                     {"saves", o.saves},
                     {"inputs", o.inputs},
                     {"forward_s", o.forward_s},
                     {"backward_s", o.backward_s},
                     {"scales_with_load", o.scales_with_load}});
    }
    auto& tensors = j["tensors"] = json::array();
    for (const auto& t : g.tensors) {
      tensors.push_back({{"name", t.name},
                         {"bytes", t.bytes},
                         {"dtype", bgl::plan::DTypeName(t.dtype)},
                         {"producer", t.producer},
                         {"savers", t.savers},
                         {"scales_with_load", t.scales_with_load},
                         {"block_input", t.block_input}});
    }
    j["steps"] = StepsJson(p.steps());
    return Dup(j.dump());
  } catch (const std::exception& e) {
    return Fail(std::string("internal error: ") + e.what());
  }
}

char* bgl_planner_schedule(int pipeline_stages, int pipeline_rank, int micro_batches, int chunks) {
  auto steps = bgl::plan::BuildSchedule(pipeline_stages, pipeline_rank, micro_batches, chunks);
  if (!steps.ok()) return Fail(steps.status().message());
  return Dup(StepsJson(*steps).dump());
}

char* bgl_planner_plan(bgl_planner* handle, const char* point_json) {
  if (!handle) return Fail("planner: NULL handle");
  try {
    json doc;
    if (!ParseObject(point_json, "point_json", doc)) return nullptr;
    bgl::plan::SchedulePoint point;
    std::string phase;
    Fields fields(doc, "point_json");
    fields.Read("phase", phase)
        .Read("forward_micro_batch", point.forward_micro_batch)
        .Read("forward_chunk", point.forward_chunk)
        .Read("backward_micro_batch", point.backward_micro_batch)
        .Read("backward_chunk", point.backward_chunk)
        .Read("load_factor", point.load_factor)
        .Read("bytes_in_use", point.bytes_in_use)
        .Read("host_limit_bytes", point.host_limit_bytes)
        .Read("bandwidth_share", point.bandwidth_share);
    if (!fields.Done()) return nullptr;
    if (!phase.empty()) {
      auto parsed = bgl::plan::ParsePhase(phase);
      if (!parsed.ok()) return Fail(parsed.status().message());
      point.phase = *parsed;
    }
    auto plan = handle->planner->PlanPoint(point);
    if (!plan.ok()) return Fail(plan.status().message());
    return Dup(bgl::plan::PlanToJsonText(*plan, handle->planner->graph()));
  } catch (const std::exception& e) {
    return Fail(std::string("internal error: ") + e.what());
  }
}

char* bgl_planner_plan_after_gate(bgl_planner* handle, int micro_batch, int chunk, int gate_layer,
                                  double observed_load_factor) {
  if (!handle) return Fail("planner: NULL handle");
  try {
    auto plan =
        handle->planner->PlanAfterGate(micro_batch, chunk, gate_layer, observed_load_factor);
    if (!plan.ok()) return Fail(plan.status().message());
    return Dup(bgl::plan::PlanToJsonText(*plan, handle->planner->graph()));
  } catch (const std::exception& e) {
    return Fail(std::string("internal error: ") + e.what());
  }
}

int bgl_planner_report(bgl_planner* handle, int micro_batch, int chunk, int64_t actual_bytes) {
  if (!handle) {
    last_error = "planner: NULL handle";
    return -1;
  }
  bgl::Status s = handle->planner->Report(micro_batch, chunk, actual_bytes);
  if (!s.ok()) {
    last_error = s.message();
    return -1;
  }
  last_error.clear();
  return 0;
}

int bgl_planner_warm_up(bgl_planner* handle, int64_t host_limit_bytes, double bandwidth_share) {
  if (!handle) {
    last_error = "planner: NULL handle";
    return -1;
  }
  try {
    bgl::Status s = handle->planner->StartWarmup(host_limit_bytes, bandwidth_share);
    if (!s.ok()) {
      last_error = s.message();
      return -1;
    }
  } catch (const std::exception& e) {
    last_error = std::string("internal error: ") + e.what();
    return -1;
  }
  last_error.clear();
  return 0;
}

void bgl_planner_reset_iteration(bgl_planner* handle) {
  if (handle) handle->planner->ResetIteration();
}

char* bgl_planner_stats(bgl_planner* handle) {
  if (!handle) return Fail("planner: NULL handle");
  try {
    handle->planner->ApplyRefinements();
    const bgl::plan::PlannerCacheStats s = handle->planner->cache_stats();
    json j = {{"cache_hits", s.mitigation.hits},
              {"cache_misses", s.mitigation.misses},
              {"cache_evictions", s.mitigation.evictions},
              {"cache_entries", s.mitigation.entries},
              {"first_answers", s.first_answers},
              {"refined", s.refined},
              {"refine_cpu_s", s.refine_cpu_s},
              {"warm_keys", s.warm_keys},
              {"warm_enumerated", s.warm_enumerated},
              {"warm_submitted", s.warm_submitted},
              {"warm_done", s.warm_done},
              {"warm_hits", s.warm_hits},
              {"warm_rounds", s.warm_rounds},
              {"warm_complete", s.warm_complete},
              {"warm_cpu_s", s.warm_cpu_s},
              {"gate_searches", s.gate_searches},
              {"gate_searches_cut", s.gate_searches_cut},
              {"gate_search_s", s.gate_search_s}};
    last_error.clear();
    return Dup(j.dump());
  } catch (const std::exception& e) {
    return Fail(std::string("internal error: ") + e.what());
  }
}

const char* bgl_planner_last_error(void) { return last_error.c_str(); }

void bgl_planner_free_string(char* text) { std::free(text); }

}  // extern "C"
