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

DualBatchSchedule SolveDualBatch(const Chains& chains, const Deadline* deadline) {
  DualBatchSchedule result;
  std::array<int, kChainCount> len{};
  std::array<size_t, kChainCount> stride{};
  size_t states = 1;
  for (int c = kChainCount - 1; c >= 0; --c) {
    if (chains[c].size() >= kMaxDualBatchStates) {
      states = kMaxDualBatchStates + 1;
      break;
    }
    len[c] = static_cast<int>(chains[c].size());
    stride[c] = states;
    states *= static_cast<size_t>(len[c] + 1);
    if (states > kMaxDualBatchStates) break;
  }
  if (states > kMaxDualBatchStates) {
    DualBatchSchedule lockstep = LockstepSchedule(chains);
    DualBatchSchedule serial = SerialSchedule(chains);
    return lockstep.overlapped_s <= serial.overlapped_s ? lockstep : serial;
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
    if (deadline != nullptr) deadline->Check();
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
  // Walk back from the full state, then reverse into issue order. A state never reached (a
  // non-finite duration) ends the walk instead of looping on mask 0.
  size_t index = states - 1;
  while (index != 0) {
    const unsigned mask = how[index];
    if (mask == 0) break;
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

void AddRound(const Chains& chains, DualBatchSchedule& s, std::array<int, kChainCount> stage) {
  IssueRound round;
  round.stage = stage;
  round.time_s = RoundTime(chains, stage);
  s.overlapped_s += round.time_s;
  s.rounds.push_back(round);
}

double SerialTime(const Chains& chains) {
  double total = 0;
  for (const auto& chain : chains) {
    for (const auto& s : chain) total += s.duration_s;
  }
  return total;
}

}  // namespace

DualBatchSchedule LockstepSchedule(const Chains& chains) {
  DualBatchSchedule s;
  s.serial_s = SerialTime(chains);
  size_t longest = 0;
  for (const auto& c : chains) longest = std::max(longest, c.size());
  for (size_t i = 0; i < longest; ++i) {
    std::array<int, kChainCount> stage{-1, -1, -1, -1};
    for (int c = 0; c < kChainCount; ++c) {
      if (i < chains[c].size()) stage[c] = static_cast<int>(i);
    }
    AddRound(chains, s, stage);
  }
  return s;
}

DualBatchSchedule SerialSchedule(const Chains& chains) {
  DualBatchSchedule s;
  s.serial_s = SerialTime(chains);
  const auto& f = chains[static_cast<int>(Chain::kForward)];
  const auto& o = chains[static_cast<int>(Chain::kOffload)];
  const auto& r = chains[static_cast<int>(Chain::kRecover)];
  const auto& b = chains[static_cast<int>(Chain::kBackward)];
  size_t next_o = 0;
  for (size_t i = 0; i < f.size(); ++i) {
    std::array<int, kChainCount> stage{static_cast<int>(i), -1, -1, -1};
    if (next_o < o.size()) stage[2] = static_cast<int>(next_o++);
    AddRound(chains, s, stage);
  }
  for (size_t i = 0; i < r.size();) {
    std::array<int, kChainCount> stage{-1, -1, -1, static_cast<int>(i++)};
    if (next_o < o.size()) stage[2] = static_cast<int>(next_o++);
    AddRound(chains, s, stage);
  }
  for (size_t i = 0; i < b.size(); ++i) {
    std::array<int, kChainCount> stage{-1, static_cast<int>(i), -1, -1};
    if (next_o < o.size()) stage[2] = static_cast<int>(next_o++);
    AddRound(chains, s, stage);
  }
  while (next_o < o.size()) AddRound(chains, s, {-1, -1, static_cast<int>(next_o++), -1});
  return s;
}

namespace {

// Appends `duration` on `resource` to the chain, merging with the last stage when it uses the
// same resource: consecutive compute operators gain nothing from being split.
void Append(std::vector<ChainStage>& chain, Resource resource, double duration, int index) {
  if (duration <= 0) return;
  if (!chain.empty() && chain.back().resource == resource) {
    chain.back().duration_s += duration;
    chain.back().last = index;
    return;
  }
  chain.push_back({resource, duration, index, index});
}

}  // namespace

Chains BuildChains(const CostEvaluator& eval, const PointUnits& u) {
  const StageGraph& g = eval.graph();
  const HardwareProfile& hw = eval.hw();
  Chains chains;
  const int n = static_cast<int>(g.ops.size());
  const int n_tensors = static_cast<int>(g.tensors.size());
  // FP8 casts run right after the producer in forward; uncasts before the first saver's backward.
  // The host backend's fixed cost of an offloaded tensor (copy_host_s) sits at the same places:
  // its offload is issued when it is saved, its reload taken before its first saver's backward.
  std::vector<double> cast(n, 0.0), uncast(n, 0.0);
  auto fp8_work = [&](const Assignment& a, double r) {
    std::fill(cast.begin(), cast.end(), 0.0);
    std::fill(uncast.begin(), uncast.end(), 0.0);
    for (int t = 0; t < n_tensors; ++t) {
      const SavedTensor& tensor = g.tensors[t];
      if (tensor.savers.empty()) continue;
      const Placement placement = eval.TensorPlacement(a, t);
      if (placement == Placement::kFp8) {
        const double time = hw.fp8_cast.Time(tensor.Bytes(r));
        if (tensor.producer >= 0) cast[tensor.producer] += time;
        uncast[tensor.savers.front()] += time;
      } else if (placement == Placement::kHost && hw.copy_host_s > 0) {
        cast[tensor.producer >= 0 ? tensor.producer : tensor.savers.front()] += hw.copy_host_s;
        uncast[tensor.savers.front()] += hw.copy_host_s;
      }
    }
  };
  if (u.forward) {
    fp8_work(*u.forward, u.forward_r);
    for (int o = 0; o < n; ++o) {
      const Operator& op = g.ops[o];
      Append(chains[0], op.IsComm() ? Resource::kComm : Resource::kCompute,
             g.forward_window_scale * op.ForwardTime(u.forward_r), o);
      Append(chains[0], Resource::kCompute, cast[o], o);
    }
  }
  if (u.backward) {
    fp8_work(*u.backward, u.backward_r);
    for (int o = n - 1; o >= 0; --o) {
      const Operator& op = g.ops[o];
      Append(chains[1], Resource::kCompute, uncast[o], o);
      Append(chains[1], op.IsComm() ? Resource::kComm : Resource::kCompute,
             g.backward_window_scale * op.BackwardTime(u.backward_r), o);
    }
  }
  if (u.offload) {
    double pending = 0;
    int first = -1;
    for (int t = 0; t < n_tensors; ++t) {
      if (eval.TensorPlacement(*u.offload, t) != Placement::kHost) continue;
      pending += g.tensors[t].Bytes(u.offload_r);
      if (first < 0) first = t;
      if (pending >= u.offload_chunk_bytes) {
        chains[2].push_back({Resource::kD2H, hw.offload.Time(pending), first, t});
        pending = 0;
        first = -1;
      }
    }
    if (pending > 0) {
      int last = n_tensors - 1;
      while (last > first && eval.TensorPlacement(*u.offload, last) != Placement::kHost) --last;
      chains[2].push_back({Resource::kD2H, hw.offload.Time(pending), first, last});
    }
  }
  if (u.recover) {
    const auto rerun = eval.RecomputeClosure(*u.recover);
    // Reloads of a layer come before its recompute; the last layer first, as backward needs it.
    std::vector<double> reload(g.layers, 0.0);
    std::vector<int> reload_first(g.layers, -1), reload_last(g.layers, -1);
    for (int t = 0; t < n_tensors; ++t) {
      const SavedTensor& tensor = g.tensors[t];
      if (tensor.savers.empty() || eval.TensorPlacement(*u.recover, t) != Placement::kHost)
        continue;
      const int layer = g.ops[tensor.savers.front()].layer;
      reload[layer] += tensor.Bytes(u.recover_r);
      if (reload_first[layer] < 0) reload_first[layer] = t;
      reload_last[layer] = t;
    }
    std::vector<std::vector<int>> rerun_by_layer(g.layers);
    for (int o = 0; o < n; ++o) {
      if (rerun[o]) rerun_by_layer[g.ops[o].layer].push_back(o);
    }
    for (int layer = g.layers - 1; layer >= 0; --layer) {
      if (reload[layer] > 0) {
        chains[3].push_back({Resource::kH2D, hw.reload.Time(reload[layer]), reload_first[layer],
                             reload_last[layer]});
      }
      for (int o : rerun_by_layer[layer]) {
        Append(chains[3], g.ops[o].IsComm() ? Resource::kComm : Resource::kCompute,
               hw.RerunTime(g.ops[o].ForwardTime(u.recover_r)), o);
      }
    }
  }
  return chains;
}

}  // namespace bgl::plan
