// The scheduling points of a stage's iteration and how their work becomes time: each point F_x B_y
// carries four chains (F, B, O of x-1, R of y+1, paper V-B) issued on the compute, all-to-all,
// D2H and H2D resources under one of the execution models.
#pragma once

#include <vector>

#include "governor/planner/dual_batch.h"
#include "governor/planner/pipeline_schedule.h"
#include "governor/planner/planner.h"

namespace bgl::sim {

// The micro-batch units (micro-batch, chunk) of one point; -1: absent.
struct PointRef {
  int f_mb = -1, f_chunk = 0;
  int b_mb = -1, b_chunk = 0;
  int o_mb = -1, o_chunk = 0;  // the forward before F: its offloads run now
  int r_mb = -1, r_chunk = 0;  // the backward after B: its reloads and recomputes run now
};

// Groups a stage's steps into points as the runtime does: one per warmup forward, per steady F/B
// pair and per cooldown backward. A forward directly followed by its own backward (the last rank)
// is two points: they can never run together.
std::vector<PointRef> GroupPoints(const std::vector<plan::Step>& steps);

// One stage of a chain placed on its resource.
struct Interval {
  int point = 0;
  plan::Chain chain = plan::Chain::kForward;
  int stage = 0;
  plan::Resource resource = plan::Resource::kCompute;
  double start_s = 0;
  double end_s = 0;
};

// A point's placed work, relative to the point's start.
struct PointSchedule {
  double duration_s = 0;
  double forward_end_s = 0;         // the forward's last stage ends (its activations are complete)
  std::vector<Interval> intervals;  // filled when asked for
};

// Round model (lockstep and dual-batch): a round starts when the previous one ends; its stages on
// one resource run one after another, different resources in parallel.
PointSchedule ScheduleRounds(const std::vector<plan::IssueItem>& items, bool keep_intervals);

// The issue item of stage `stage` of chain `chain`, issued in round `round`.
plan::IssueItem Item(const plan::Chains& chains, int chain, int stage, int round);

// Program order: round i issues stage i of every chain (what the planner does without the DP).
std::vector<plan::IssueItem> LockstepItems(const plan::Chains& chains);

// The dual-batch DP's order of `chains` (plan::SolveDualBatch) as issue items.
std::vector<plan::IssueItem> DualBatchItems(const plan::Chains& chains);

// The chains an issue order covers (each chain's stages by index), e.g. to re-issue a plan's
// work under another execution model.
plan::Chains ChainsFromItems(const std::vector<plan::IssueItem>& items);

// Megatron-style serial execution: one main stream runs F, then R's recomputes, then B; offloads
// and reloads run on their copy engines, each chain in order, overlapping the main stream.
PointSchedule ScheduleSerial(const plan::Chains& chains, bool keep_intervals);

}  // namespace bgl::sim
