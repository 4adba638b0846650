// The step sequence of one pipeline stage: 1F1B and interleaved 1F1B (Megatron's schedule),
// with warmup, steady and cooldown phases (docs/algorithms.md sec. 1).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "base/status.h"

namespace bgl::plan {

enum class Phase { kWarmup, kSteady, kCooldown };
const char* PhaseName(Phase phase);
Result<Phase> ParsePhase(const std::string& name);

// One forward or backward of one micro-batch of one model chunk.
struct Step {
  bool forward = true;
  int micro_batch = 0;
  int chunk = 0;
  Phase phase = Phase::kWarmup;
};

// The stage's steps for pipeline rank `rank` of `pp`, `micro_batches` per iteration and
// `chunks` model chunks per rank (1: plain 1F1B).
Result<std::vector<Step>> BuildSchedule(int pp, int rank, int micro_batches, int chunks);

// Warmup forwards of rank `rank`: min(P-p-1, B) for 1F1B, Megatron's formula when interleaved.
int WarmupForwards(int pp, int rank, int micro_batches, int chunks);

// k of Algorithm 1: forward steps from `index` (inclusive) to the next backward step.
int ForwardsUntilNextBackward(const std::vector<Step>& steps, size_t index);

// Index of the forward step of (micro_batch, chunk), or -1.
int FindForward(const std::vector<Step>& steps, int micro_batch, int chunk);

}  // namespace bgl::plan
