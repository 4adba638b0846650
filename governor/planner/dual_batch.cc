#include "governor/planner/dual_batch.h"

#include <algorithm>
#include <limits>

namespace bgl::plan {

const char* ResourceName(Resource r) {
  switch (r) {
    case Resource::kCompute:
      return "compute";
    case Resource::kComm:
      return "comm";
    case Resource::kD2H:
      return "d2h";
    case Resource::kH2D:
      return "h2d";
  }
  return "?";
}

const char* ChainName(Chain c) {
  switch (c) {
    case Chain::kForward:
      return "F";
    case Chain::kBackward:
      return "B";
    case Chain::kOffload:
      return "O";
    case Chain::kRecover:
      return "R";
  }
  return "?";
}

double RoundTime(const Chains& chains, const std::array<int, kChainCount>& stage) {
  std::array<double, kResourceCount> load{};
  for (int c = 0; c < kChainCount; ++c) {
    if (stage[c] < 0) continue;
    const ChainStage& s = chains[c][stage[c]];
    load[static_cast<int>(s.resource)] += s.duration_s;
  }
  return *std::max_element(load.begin(), load.end());
}

DualBatchSchedule SolveDualBatch(const Chains& chains) {
  DualBatchSchedule result;
  std::array<int, kChainCount> len{};
  std::array<size_t, kChainCount> stride{};
  size_t states = 1;
  for (int c = kChainCount - 1; c >= 0; --c) {
    len[c] = static_cast<int>(chains[c].size());
    stride[c] = states;
    states *= static_cast<size_t>(len[c] + 1);
  }
  for (const auto& chain : chains) {
    for (const auto& s : chain) result.serial_s += s.duration_s;
  }
  constexpr double kInf = std::numeric_limits<double>::infinity();
  std::vector<double> best(states, kInf);
  std::vector<uint8_t> how(states, 0);
  best[0] = 0;
  // Transitions only increase the index, so one pass in index order relaxes every state.
  std::array<int, kChainCount> pos{};
  for (size_t index = 0; index < states; ++index) {
    size_t rest = index;
    for (int c = 0; c < kChainCount; ++c) {
      pos[c] = static_cast<int>(rest / stride[c]);
      rest %= stride[c];
    }
    if (best[index] == kInf) continue;
    for (unsigned mask = 1; mask < (1u << kChainCount); ++mask) {
      std::array<int, kChainCount> issued{-1, -1, -1, -1};
      size_t next = index;
      bool valid = true;
      for (int c = 0; c < kChainCount && valid; ++c) {
        if (!(mask & (1u << c))) continue;
        if (pos[c] >= len[c]) valid = false;
        issued[c] = pos[c];
        next += stride[c];
      }
      if (!valid) continue;
      const double t = best[index] + RoundTime(chains, issued);
      if (t < best[next]) {
        best[next] = t;
        how[next] = static_cast<uint8_t>(mask);
      }
    }
  }
  result.overlapped_s = best[states - 1];
  // Walk back from the full state, then reverse into issue order.
  size_t index = states - 1;
  while (index != 0) {
    const unsigned mask = how[index];
    size_t prev = index;
    for (int c = 0; c < kChainCount; ++c) {
      if (mask & (1u << c)) prev -= stride[c];
    }
    IssueRound round;
    size_t rest = prev;
    for (int c = 0; c < kChainCount; ++c) {
      const int p = static_cast<int>(rest / stride[c]);
      rest %= stride[c];
      if (mask & (1u << c)) round.stage[c] = p;
    }
    round.time_s = RoundTime(chains, round.stage);
    result.rounds.push_back(round);
    index = prev;
  }
  std::reverse(result.rounds.begin(), result.rounds.end());
  return result;
}

namespace {

// Appends `duration` on `resource` to the chain, merging with the last stage when it uses the
// same resource: consecutive compute operators gain nothing from being split.
void Append(std::vector<ChainStage>& chain, Resource resource, double duration,
            const std::string& label) {
  if (duration <= 0) return;
  if (!chain.empty() && chain.back().resource == resource) {
    chain.back().duration_s += duration;
    const auto dots = chain.back().label.find("..");
    const std::string first =
        dots == std::string::npos ? chain.back().label : chain.back().label.substr(0, dots);
    chain.back().label = first + ".." + label;
    return;
  }
  chain.push_back({resource, duration, label});
}

}  // namespace

Chains BuildChains(const CostEvaluator& eval, const PointUnits& u) {
  const StageGraph& g = eval.graph();
  const HardwareProfile& hw = eval.hw();
  Chains chains;
  const int n = static_cast<int>(g.ops.size());
  if (u.forward) {
    for (int o = 0; o < n; ++o) {
      const Operator& op = g.ops[o];
      double t = op.ForwardTime(u.forward_r);
      if (!op.IsComm()) {
        // FP8 casts of the tensors this operator produces run right after it.
        for (size_t ti = 0; ti < g.tensors.size(); ++ti) {
          if (g.tensors[ti].producer == o &&
              eval.TensorPlacement(*u.forward, static_cast<int>(ti)) == Placement::kFp8) {
            t += hw.fp8_cast.Time(g.tensors[ti].Bytes(u.forward_r));
          }
        }
      }
      Append(chains[0], op.IsComm() ? Resource::kComm : Resource::kCompute, t, op.name);
    }
  }
  if (u.backward) {
    for (int o = n - 1; o >= 0; --o) {
      const Operator& op = g.ops[o];
      double t = op.BackwardTime(u.backward_r);
      if (!op.IsComm()) {
        for (int ti : op.saves) {
          if (eval.TensorPlacement(*u.backward, ti) == Placement::kFp8 &&
              g.tensors[ti].savers.front() == o) {
            t += hw.fp8_cast.Time(g.tensors[ti].Bytes(u.backward_r));
          }
        }
      }
      Append(chains[1], op.IsComm() ? Resource::kComm : Resource::kCompute, t, op.name);
    }
  }
  if (u.offload) {
    double pending = 0;
    std::string first, last;
    for (size_t ti = 0; ti < g.tensors.size(); ++ti) {
      if (eval.TensorPlacement(*u.offload, static_cast<int>(ti)) != Placement::kHost) continue;
      pending += g.tensors[ti].Bytes(u.offload_r);
      if (first.empty()) first = g.tensors[ti].name;
      last = g.tensors[ti].name;
      if (pending >= u.offload_chunk_bytes) {
        chains[2].push_back({Resource::kD2H, hw.offload.Time(pending), first + ".." + last});
        pending = 0;
        first.clear();
      }
    }
    if (pending > 0) {
      chains[2].push_back({Resource::kD2H, hw.offload.Time(pending), first + ".." + last});
    }
  }
  if (u.recover) {
    const auto rerun = eval.RecomputeClosure(*u.recover);
    for (int layer = g.layers - 1; layer >= 0; --layer) {
      double reload = 0;
      std::string names;
      for (size_t ti = 0; ti < g.tensors.size(); ++ti) {
        const SavedTensor& t = g.tensors[ti];
        if (t.savers.empty() || g.ops[t.savers.front()].layer != layer) continue;
        if (eval.TensorPlacement(*u.recover, static_cast<int>(ti)) == Placement::kHost) {
          reload += t.Bytes(u.recover_r);
          names = names.empty() ? t.name : names;
        }
      }
      if (reload > 0) {
        chains[3].push_back({Resource::kH2D, hw.reload.Time(reload), "reload " + names + ".."});
      }
      for (int o = 0; o < n; ++o) {
        if (!rerun[o] || g.ops[o].layer != layer) continue;
        Append(chains[3], g.ops[o].IsComm() ? Resource::kComm : Resource::kCompute,
               g.ops[o].ForwardTime(u.recover_r), "recompute " + g.ops[o].name);
      }
    }
  }
  return chains;
}

}  // namespace bgl::plan
