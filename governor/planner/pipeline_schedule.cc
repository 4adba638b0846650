#include "governor/planner/pipeline_schedule.h"

#include <algorithm>

namespace bgl::plan {

const char* PhaseName(Phase phase) {
  switch (phase) {
    case Phase::kWarmup:
      return "warmup";
    case Phase::kSteady:
      return "steady";
    case Phase::kCooldown:
      return "cooldown";
  }
  return "?";
}

Result<Phase> ParsePhase(const std::string& name) {
  if (name == "warmup") return Phase::kWarmup;
  if (name == "steady") return Phase::kSteady;
  if (name == "cooldown") return Phase::kCooldown;
  return InvalidArgument("phase: unknown phase '" + name + "' (warmup, steady, cooldown)");
}

int WarmupForwards(int pp, int rank, int micro_batches, int chunks) {
  if (chunks <= 1) return std::min(pp - rank - 1, micro_batches);
  return std::min((pp - rank - 1) * 2 + (chunks - 1) * pp, micro_batches * chunks);
}

Result<std::vector<Step>> BuildSchedule(int pp, int rank, int micro_batches, int chunks) {
  if (pp < 1) return InvalidArgument("pp must be positive, got " + std::to_string(pp));
  if (rank < 0 || rank >= pp) {
    return InvalidArgument("pipeline_rank " + std::to_string(rank) + " is outside [0, " +
                           std::to_string(pp) + ")");
  }
  if (micro_batches < 1) {
    return InvalidArgument("micro_batches must be positive, got " + std::to_string(micro_batches));
  }
  if (chunks < 1) return InvalidArgument("chunks must be positive, got " + std::to_string(chunks));
  // Every (micro-batch, chunk) has a forward and a backward step: a count past this bound is
  // an error, not gigabytes of steps (planner_capi_fuzz's finding).
  constexpr long long kMaxUnits = 1 << 20;
  if (static_cast<long long>(micro_batches) * chunks > kMaxUnits ||
      static_cast<long long>(pp) * chunks > kMaxUnits) {
    return InvalidArgument("micro_batches x chunks and pp x chunks must be at most " +
                           std::to_string(kMaxUnits) + ", got " + std::to_string(micro_batches) +
                           " x " + std::to_string(chunks) + " and " + std::to_string(pp) + " x " +
                           std::to_string(chunks));
  }
  if (chunks > 1 && micro_batches % pp != 0) {
    return InvalidArgument("interleaved 1F1B needs micro_batches divisible by pp");
  }
  const int total = micro_batches * chunks;
  const int warmup = WarmupForwards(pp, rank, micro_batches, chunks);
  // Megatron's interleaved order: groups of pp micro-batches walk the chunks in turn.
  auto unit = [&](int k, bool forward) {
    Step s;
    s.forward = forward;
    const int group = pp * chunks;
    const int in_group = k % group;
    s.micro_batch = (k / group) * pp + in_group % pp;
    const int chunk = in_group / pp;
    s.chunk = forward ? chunk : chunks - 1 - chunk;
    if (chunks == 1) s.micro_batch = k;
    return s;
  };
  std::vector<Step> steps;
  steps.reserve(2 * static_cast<size_t>(total));
  int f = 0, b = 0;
  for (; f < warmup; ++f) {
    Step s = unit(f, true);
    s.phase = Phase::kWarmup;
    steps.push_back(s);
  }
  while (f < total) {
    Step fs = unit(f++, true);
    fs.phase = Phase::kSteady;
    steps.push_back(fs);
    Step bs = unit(b++, false);
    bs.phase = Phase::kSteady;
    steps.push_back(bs);
  }
  while (b < total) {
    Step s = unit(b++, false);
    s.phase = Phase::kCooldown;
    steps.push_back(s);
  }
  return steps;
}

int ForwardsUntilNextBackward(const std::vector<Step>& steps, size_t index) {
  int k = 0;
  for (size_t i = index; i < steps.size() && steps[i].forward; ++i) ++k;
  return std::max(k, 1);
}

int FindForward(const std::vector<Step>& steps, int micro_batch, int chunk) {
  for (size_t i = 0; i < steps.size(); ++i) {
    if (steps[i].forward && steps[i].micro_batch == micro_batch && steps[i].chunk == chunk) {
      return static_cast<int>(i);
    }
  }
  return -1;
}

}  // namespace bgl::plan
