// libFuzzer target: call sequences over the planner's C ABI (bgl/planner.h), as the PyTorch
// package drives it through ctypes. Per input a fresh planner over one of the shipped models
// (models/tiny-moe.json and the captured Mixtral graph of tests/unit/planner/data/, read once
// at start; BGL_FUZZ_MODELS, a space-separated list of paths, overrides them), options from the
// input (issue policy, allowed strategies, capacity); then up to 64 calls chosen by the input:
// plan (a point whose micro-batches, chunks, phase, load and bytes in use are mostly valid),
// plan after a gate, report, reset, describe, stats, schedule, calibrated profile. State does not
// survive an input (the planner is destroyed; warm-up and anytime refinement are off, so no
// thread outlives it).
//
// Findings: a crash or sanitizer report; a NULL or -1 with no message in
// bgl_planner_last_error(); a returned document that is not JSON.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "bgl/planner.h"
#include "fuzz/fuzz_util.h"

namespace {

std::vector<std::string>& Models() {
  static std::vector<std::string> models = [] {
    std::vector<std::string> out;
    const char* env = std::getenv("BGL_FUZZ_MODELS");
    std::istringstream list(env != nullptr && *env ? env
                                                   : BGL_SOURCE_DIR
                                "/models/tiny-moe.json " BGL_SOURCE_DIR
                                "/tests/unit/planner/data/hf-mixtral.json");
    std::string path;
    while (list >> path) {
      std::ifstream in(path);
      std::stringstream ss;
      ss << in.rdbuf();
      if (!ss.str().empty()) out.push_back(ss.str());
    }
    if (out.empty()) {
      std::fprintf(stderr, "planner_capi_fuzz: no model file could be read\n");
      std::abort();
    }
    return out;
  }();
  return models;
}

void Fail(const char* what) {
  std::fprintf(stderr, "planner_capi_fuzz: %s\n", what);
  __builtin_trap();
}

// A NULL result must say why; a document must be JSON.
void Text(char* out) {
  if (out == nullptr) {
    const char* e = bgl_planner_last_error();
    if (e == nullptr || *e == '\0') Fail("NULL with no message");
    return;
  }
  if (!nlohmann::json::accept(out)) Fail("a result that is not JSON");
  bgl_planner_free_string(out);
}

void Code(int rc) {
  if (rc != 0 && *bgl_planner_last_error() == '\0') Fail("an error code with no message");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  bgl::fuzz::Choices in(data, size);
  const auto& models = Models();
  const std::string& model = models[static_cast<size_t>(in.In(0, 63)) % models.size()];
  static const char* kPolicies[] = {"dual-batch", "lockstep", "serial", "bogus"};
  nlohmann::json options = {{"capacity_bytes", int64_t{1} << in.In(20, 40)},
                            {"issue_policy", kPolicies[in.In(0, 3)]},
                            {"allow_offload", in.Byte() % 2 == 0},
                            {"allow_fp8", in.Byte() % 2 == 0},
                            {"allow_recompute", in.Byte() % 2 == 0},
                            {"anytime_min_ops", 0},
                            {"warm_up", false},
                            {"budget_step_bytes", int64_t{1} << in.In(12, 26)}};
  bgl_planner* p = bgl_planner_create(model.c_str(), options.dump().c_str());
  if (p == nullptr) {
    if (*bgl_planner_last_error() == '\0') Fail("create: NULL with no message");
    return 0;
  }
  static const char* kPhases[] = {"warmup", "steady", "cooldown", "other"};
  for (int i = 0; i < 64 && in.more(); ++i) {
    switch (in.Byte() % 9) {
      case 0:
      case 1: {
        nlohmann::json point = {{"phase", kPhases[in.In(0, 3)]},
                                {"forward_chunk", in.Mostly(0, 1)},
                                {"backward_chunk", in.Mostly(0, 1)},
                                {"load_factor", static_cast<double>(in.In(0, 800)) / 100.0}};
        if (in.Byte() % 4 != 0) point["forward_micro_batch"] = in.Mostly(0, 15);
        if (in.Byte() % 2 != 0) point["backward_micro_batch"] = in.Mostly(0, 15);
        if (in.Byte() % 2 != 0) point["bytes_in_use"] = in.Mostly(0, int64_t{1} << 31);
        Text(bgl_planner_plan(p, point.dump().c_str()));
        break;
      }
      case 2:
        Text(bgl_planner_plan_after_gate(
            p, static_cast<int>(in.Mostly(0, 15)), static_cast<int>(in.Mostly(0, 1)),
            static_cast<int>(in.Mostly(0, 7)), static_cast<double>(in.In(0, 800)) / 100.0));
        break;
      case 3:
        Code(bgl_planner_report(p, static_cast<int>(in.Mostly(0, 15)),
                                static_cast<int>(in.Mostly(0, 1)), in.Mostly(0, int64_t{1} << 31)));
        break;
      case 4:
        bgl_planner_reset_iteration(p);
        break;
      case 5:
        Text(bgl_planner_describe(p));
        break;
      case 6:
        Text(bgl_planner_stats(p));
        break;
      case 7:
        Text(bgl_planner_schedule(
            static_cast<int>(in.Mostly(1, 8)), static_cast<int>(in.Mostly(0, 7)),
            static_cast<int>(in.Mostly(1, 16)), static_cast<int>(in.Mostly(1, 3))));
        break;
      default: {
        static const char* kGpus[] = {"h100", "h200", "host", "nope"};
        const nlohmann::json cal = {
            {"rooflines",
             {{"offload", {{"launch_floor_us", in.In(0, 50)}, {"peak_GBps", in.In(0, 100)}}}}}};
        Text(bgl_planner_calibrated_profile(cal.dump().c_str(), kGpus[in.In(0, 3)]));
        break;
      }
    }
  }
  bgl_planner_destroy(p);
  return 0;
}
