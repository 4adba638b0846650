// Fused dual-batch execution (paper V-B, docs/algorithms.md sec. 5): the four chains F, B, O, R
// of a scheduling point F_x B_y, compacted into stages, and the DP over chain prefixes that finds
// the issue order minimising the overlapped time on compute, comm, D2H and H2D.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "governor/planner/assignment.h"
#include "governor/planner/deadline.h"

namespace bgl::plan {

enum class Resource : uint8_t { kCompute, kComm, kD2H, kH2D };
constexpr int kResourceCount = 4;
const char* ResourceName(Resource r);
// The host link's engines: what offloads and reloads occupy.
constexpr bool IsHostCopy(Resource r) { return r == Resource::kD2H || r == Resource::kH2D; }

// F: forward of x; B: backward of y; O: offloads of x-1; R: reloads/recomputes of y+1.
enum class Chain : uint8_t { kForward, kBackward, kOffload, kRecover };
constexpr int kChainCount = 4;
const char* ChainName(Chain c);

// A run of work on one resource that the DP treats as one unit. `first` and `last` are operator
// indices (F, B, R) or tensor indices (O) of the work it covers, in chain order.
struct ChainStage {
  Resource resource = Resource::kCompute;
  double duration_s = 0;
  int first = -1;
  int last = -1;
};

using Chains = std::array<std::vector<ChainStage>, kChainCount>;

// One round: the stage issued from each chain (-1: chain not advanced) and its duration.
struct IssueRound {
  std::array<int, kChainCount> stage{-1, -1, -1, -1};
  double time_s = 0;
};

// One issued stage of the dual-batch order. first/last: operator indices of the graph (chains
// F, B, R; R's reloads and O name tensor indices instead).
struct IssueItem {
  Chain chain = Chain::kForward;
  int stage = 0;
  int round = 0;
  Resource resource = Resource::kCompute;
  double duration_s = 0;
  int first = -1;
  int last = -1;
};

// The DP's answer.
struct DualBatchSchedule {
  std::vector<IssueRound> rounds;
  std::vector<IssueItem> issue_order;  // the rounds flattened, for callers
  double overlapped_s = 0;  // sum of round times: the point's makespan under the round model
  double serial_s = 0;      // every stage one after another
};

// Round time: max over resources of the summed durations of the issued stages on it.
double RoundTime(const Chains& chains, const std::array<int, kChainCount>& stage);

// The most chain-prefix states the DP visits (9 bytes each). The shipped models need a few
// thousand; a layer graph whose chains would need more gets the better of the lockstep and serial
// orders instead.
inline constexpr size_t kMaxDualBatchStates = size_t{1} << 20;

// Optimal issue order under the round model. States are chain prefixes; each transition advances
// a non-empty subset of chains by one stage, so order inside a chain is kept by construction.
// Past kMaxDualBatchStates, the better of LockstepSchedule and SerialSchedule. `deadline` (may be
// null) is checked once per state.
DualBatchSchedule SolveDualBatch(const Chains& chains, const Deadline* deadline = nullptr);

// The same chains in lockstep: round i issues stage i of every chain.
DualBatchSchedule LockstepSchedule(const Chains& chains);
// Without fusion: F's stages one per round (O's offloads beside them on D2H), then R (reloads
// beside recomputes), then B's stages one per round.
DualBatchSchedule SerialSchedule(const Chains& chains);

// The micro-batches of one scheduling point, each with its assignment and load (null: absent).
struct PointUnits {
  const Assignment* forward = nullptr;
  double forward_r = 1;
  const Assignment* backward = nullptr;
  double backward_r = 1;
  const Assignment* offload = nullptr;  // x - 1, its offloads run now
  double offload_r = 1;
  const Assignment* recover = nullptr;  // y + 1, its reloads and recomputes run now
  double recover_r = 1;
  double offload_chunk_bytes = 64.0 * (1 << 20);
};

// Compacts the point's work into chains: F and B split at communication operators, O chunked,
// R per layer (reloads then recompute), last layer first as the backward needs it.
Chains BuildChains(const CostEvaluator& eval, const PointUnits& units);

}  // namespace bgl::plan
