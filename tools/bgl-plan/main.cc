// bgl-plan: plans one scheduling point of a model stage and prints the plan as a table or JSON;
// optionally writes the iteration's activation memory curve as CSV.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "base/units.h"
#include "governor/planner/iteration.h"
#include "governor/planner/plan_format.h"

namespace {

constexpr const char* kUsage = R"(usage: bgl-plan --model FILE --capacity SIZE --load R [options]

Plans the first forward of the requested pipeline phase for one stage of the model, replaying the
iteration up to it with every micro-batch at load factor R, and prints the plan: the full
search's, the plan a warm run uses (its key planned by the warm-up or refined after a first miss).

  --model FILE        model description (.json, .yaml or .yml; see models/)
  --capacity SIZE     device memory, in bytes or with a unit (64GiB, 80GB)
  --load R            MoE load factor of the micro-batches (1.0 = balanced; spikes reach 2.6)
  --phase NAME        warmup | steady | cooldown (default: steady, where the peak is)
  --rank P            pipeline rank of the stage (default 0, the one that holds the most)
  --gpu NAME          hardware profile (default: the model file's, else h200)
  --calibration FILE  measured rooflines overriding the profile (JSON)
  --budget-step SIZE  plan-cache budget bucket (default 64MiB; small stages want capacity/64)
  --first-answer      print the first answer a cold plan-cache miss gets instead (the anytime
                      path's quick answer on chunks of 64 operators or more, in the daemon;
                      the embedded planner's on every chunk), before its refinement lands
  --json              print JSON instead of the table
  --curve-csv FILE    write the iteration's activation memory curve (planned and keep-all)
  -h, --help          this text
)";

int Fail(const std::string& message) {
  std::fprintf(stderr, "bgl-plan: %s\n", message.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace bgl;
  using namespace bgl::plan;
  std::string model_path, capacity_text, load_text, phase_text = "steady", gpu, calibration,
                                                    curve_path, budget_step_text;
  int rank = 0;
  bool json = false, first_answer = false;
  std::vector<std::string> args(argv + 1, argv + argc);
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&](std::string& out) -> bool {
      if (i + 1 >= args.size()) return false;
      out = args[++i];
      return true;
    };
    if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      return 0;
    } else if (a == "--json") {
      json = true;
    } else if (a == "--first-answer") {
      first_answer = true;
    } else if (a == "--model" || a == "--capacity" || a == "--load" || a == "--phase" ||
               a == "--gpu" || a == "--calibration" || a == "--curve-csv" || a == "--rank" ||
               a == "--budget-step") {
      std::string v;
      if (!value(v)) return Fail(a + " needs a value\n" + kUsage);
      if (a == "--model")
        model_path = v;
      else if (a == "--capacity")
        capacity_text = v;
      else if (a == "--load")
        load_text = v;
      else if (a == "--phase")
        phase_text = v;
      else if (a == "--gpu")
        gpu = v;
      else if (a == "--calibration")
        calibration = v;
      else if (a == "--curve-csv")
        curve_path = v;
      else if (a == "--budget-step")
        budget_step_text = v;
      else {
        char* end = nullptr;
        rank = static_cast<int>(std::strtol(v.c_str(), &end, 10));
        if (v.empty() || *end) return Fail("--rank: '" + v + "' is not an integer");
      }
    } else {
      return Fail("unknown argument '" + a + "'\n" + kUsage);
    }
  }
  if (model_path.empty()) return Fail(std::string("--model is required\n") + kUsage);
  if (capacity_text.empty()) return Fail(std::string("--capacity is required\n") + kUsage);
  if (load_text.empty()) return Fail(std::string("--load is required\n") + kUsage);

  auto config = LoadModelConfig(model_path);
  if (!config.ok()) return Fail(config.status().message());
  auto capacity = ParseBytes(capacity_text, "--capacity");
  if (!capacity.ok()) return Fail(capacity.status().message());
  char* end = nullptr;
  const double load = std::strtod(load_text.c_str(), &end);
  if (*end || !(load > 0) || load > 64) {
    return Fail("--load: '" + load_text + "' must be a number in (0, 64]");
  }
  auto phase = ParsePhase(phase_text);
  if (!phase.ok()) return Fail("--" + phase.status().message());
  auto hw = HardwareProfileByName(gpu.empty() ? config->gpu : gpu);
  if (!hw.ok()) return Fail(hw.status().message());
  if (!calibration.empty()) {
    Status s = ApplyCalibrationFile(calibration, *hw);
    if (!s.ok()) return Fail(s.message());
  }
  PlannerOptions options;
  // The full search on every miss (what a warm key holds), or the first answer on every chunk,
  // never refined (what a cold key gets first).
  options.anytime_min_ops = first_answer ? 1 : 0;
  options.refine_first_answers = false;
  options.capacity_bytes = *capacity;
  options.pipeline_rank = rank;
  if (!budget_step_text.empty()) {
    auto step = ParseBytes(budget_step_text, "--budget-step");
    if (!step.ok()) return Fail(step.status().message());
    if (*step < 4096) {
      return Fail("--budget-step: '" + budget_step_text + "' must be at least 4096 bytes");
    }
    options.budget_step_bytes = *step;
  }
  auto planner = StagePlanner::Create(*config, *hw, options);
  if (!planner.ok()) return Fail(planner.status().message());

  std::vector<double> loads(static_cast<size_t>(config->MicroBatches()), load);
  auto replay = ReplayIteration(**planner, loads);
  if (!replay.ok()) return Fail(replay.status().message());
  const Plan* chosen = nullptr;
  for (const Plan& p : replay->plans) {
    if (p.phase == *phase) {
      chosen = &p;
      break;
    }
  }
  if (!chosen) {
    return Fail("rank " + std::to_string(rank) + " has no " + phase_text +
                " scheduling point with this configuration");
  }
  if (!curve_path.empty()) {
    std::ofstream out(curve_path);
    if (!out) return Fail("--curve-csv: cannot write '" + curve_path + "'");
    out << CurveToCsv(replay->planned, replay->keep_all);
  }
  const StagePlanner& p = **planner;
  if (json) {
    nlohmann::json j;
    j["model"] = config->name;
    j["gpu"] = hw->name;
    j["pipeline_rank"] = rank;
    j["capacity_bytes"] = *capacity;
    j["activation_capacity_bytes"] = static_cast<int64_t>(p.activation_capacity());
    j["iteration_peak_bytes"] = static_cast<int64_t>(replay->planned.peak_bytes);
    j["keep_all_peak_bytes"] = static_cast<int64_t>(replay->keep_all.peak_bytes);
    j["search"] = first_answer ? "first answer" : "full";
    j["plan"] = PlanToJson(*chosen, p.graph());
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  std::printf(
      "model %s on %s, pipeline rank %d of %lld, %lld chunk(s) of %lld layer(s), %lld "
      "micro-batches\n",
      config->name.c_str(), hw->name.c_str(), rank, static_cast<long long>(config->pp),
      static_cast<long long>(config->Chunks()), static_cast<long long>(config->LayersPerChunk()),
      static_cast<long long>(config->MicroBatches()));
  std::printf("capacity %s: weights+grads+optimizer %s, activations %s\n",
              FormatBytes(static_cast<double>(*capacity)).c_str(),
              FormatBytes(config->StaticBytesPerGpu()).c_str(),
              FormatBytes(p.activation_capacity()).c_str());
  std::printf("search: %s\n",
              first_answer ? "the first answer a cold plan-cache miss gets (--first-answer)"
                           : "full (the plan a warm run uses; --first-answer: a cold miss's)");
  std::printf("iteration peak at load %.2f: planned %s, keep-all %s (%s)\n\n", load,
              FormatBytes(replay->planned.peak_bytes).c_str(),
              FormatBytes(replay->keep_all.peak_bytes).c_str(),
              replay->keep_all.peak_bytes > p.activation_capacity() ? "would not fit" : "fits");
  std::fputs(FormatPlanTable(*chosen, p).c_str(), stdout);
  return 0;
}
