#include "tools/bgl-sim/point_schedule.h"

#include <algorithm>
#include <array>

namespace bgl::sim {

plan::IssueItem Item(const plan::Chains& chains, int chain, int stage, int round) {
  const plan::ChainStage& s = chains[chain][stage];
  plan::IssueItem item;
  item.chain = static_cast<plan::Chain>(chain);
  item.stage = stage;
  item.round = round;
  item.resource = s.resource;
  item.duration_s = s.duration_s;
  return item;
}

std::vector<PointRef> GroupPoints(const std::vector<plan::Step>& steps) {
  std::vector<PointRef> points;
  int last_forward = -1;
  for (size_t i = 0; i < steps.size();) {
    PointRef p;
    const plan::Step& s = steps[i];
    int backward_index = -1;
    if (s.forward) {
      p.f_mb = s.micro_batch;
      p.f_chunk = s.chunk;
      if (last_forward >= 0) {
        p.o_mb = steps[last_forward].micro_batch;
        p.o_chunk = steps[last_forward].chunk;
      }
      last_forward = static_cast<int>(i);
      // A steady forward pairs with the next backward, unless it is the same unit (the last
      // rank runs a micro-batch's backward right after its forward).
      const bool same_unit = i + 1 < steps.size() && steps[i + 1].micro_batch == s.micro_batch &&
                             steps[i + 1].chunk == s.chunk;
      if (i + 1 < steps.size() && !steps[i + 1].forward && s.phase == plan::Phase::kSteady &&
          !same_unit) {
        backward_index = static_cast<int>(i + 1);
        i += 2;
      } else {
        i += 1;
      }
    } else {
      backward_index = static_cast<int>(i);
      i += 1;
    }
    if (backward_index >= 0) {
      p.b_mb = steps[backward_index].micro_batch;
      p.b_chunk = steps[backward_index].chunk;
      for (size_t j = backward_index + 1; j < steps.size(); ++j) {
        if (!steps[j].forward) {
          p.r_mb = steps[j].micro_batch;
          p.r_chunk = steps[j].chunk;
          break;
        }
      }
    }
    points.push_back(p);
  }
  return points;
}

PointSchedule ScheduleRounds(const std::vector<plan::IssueItem>& items, bool keep_intervals) {
  PointSchedule out;
  double round_start = 0;
  size_t i = 0;
  while (i < items.size()) {
    const int round = items[i].round;
    std::array<double, plan::kResourceCount> busy{};
    double round_end = round_start;
    for (; i < items.size() && items[i].round == round; ++i) {
      const plan::IssueItem& item = items[i];
      double& offset = busy[static_cast<int>(item.resource)];
      const double start = round_start + offset;
      offset += item.duration_s;
      const double end = round_start + offset;
      round_end = std::max(round_end, end);
      if (item.chain == plan::Chain::kForward) out.forward_end_s = std::max(out.forward_end_s, end);
      if (keep_intervals) {
        out.intervals.push_back({0, item.chain, item.stage, item.resource, start, end});
      }
    }
    round_start = round_end;
  }
  out.duration_s = round_start;
  return out;
}

std::vector<plan::IssueItem> LockstepItems(const plan::Chains& chains) {
  std::vector<plan::IssueItem> items;
  size_t longest = 0;
  for (const auto& c : chains) longest = std::max(longest, c.size());
  for (size_t round = 0; round < longest; ++round) {
    for (int c = 0; c < plan::kChainCount; ++c) {
      if (round >= chains[c].size()) continue;
      items.push_back(Item(chains, c, static_cast<int>(round), static_cast<int>(round)));
    }
  }
  return items;
}

plan::Chains ChainsFromItems(const std::vector<plan::IssueItem>& items) {
  plan::Chains chains;
  for (const plan::IssueItem& item : items) {
    auto& chain = chains[static_cast<int>(item.chain)];
    if (static_cast<int>(chain.size()) <= item.stage) chain.resize(item.stage + 1);
    chain[item.stage].resource = item.resource;
    chain[item.stage].duration_s = item.duration_s;
  }
  return chains;
}

std::vector<plan::IssueItem> DualBatchItems(const plan::Chains& chains) {
  const plan::DualBatchSchedule dp = plan::SolveDualBatch(chains);
  std::vector<plan::IssueItem> items;
  for (size_t r = 0; r < dp.rounds.size(); ++r) {
    for (int c = 0; c < plan::kChainCount; ++c) {
      const int stage = dp.rounds[r].stage[c];
      if (stage >= 0) items.push_back(Item(chains, c, stage, static_cast<int>(r)));
    }
  }
  return items;
}

PointSchedule ScheduleSerial(const plan::Chains& chains, bool keep_intervals) {
  PointSchedule out;
  std::array<double, plan::kResourceCount> free{};
  double stream = 0;  // the main stream: compute and all-to-all one after another
  auto place = [&](plan::Chain chain, int stage, double ready, bool main) {
    const plan::ChainStage& s = chains[static_cast<int>(chain)][stage];
    double& resource = free[static_cast<int>(s.resource)];
    const double start = std::max({ready, resource, main ? stream : 0.0});
    const double end = start + s.duration_s;
    resource = end;
    if (main) stream = end;
    out.duration_s = std::max(out.duration_s, end);
    if (keep_intervals) out.intervals.push_back({0, chain, stage, s.resource, start, end});
    return end;
  };
  const auto& f = chains[static_cast<int>(plan::Chain::kForward)];
  for (size_t i = 0; i < f.size(); ++i) place(plan::Chain::kForward, static_cast<int>(i), 0, true);
  out.forward_end_s = stream;
  // Offloads of the previous forward run on the D2H engine from the start.
  double ready = 0;
  const auto& o = chains[static_cast<int>(plan::Chain::kOffload)];
  for (size_t i = 0; i < o.size(); ++i) {
    ready = place(plan::Chain::kOffload, static_cast<int>(i), ready, false);
  }
  // Reloads start at once on the H2D engine; recomputes join the main stream after the forward.
  ready = 0;
  const auto& r = chains[static_cast<int>(plan::Chain::kRecover)];
  for (size_t i = 0; i < r.size(); ++i) {
    ready =
        place(plan::Chain::kRecover, static_cast<int>(i), ready, !plan::IsHostCopy(r[i].resource));
  }
  const auto& b = chains[static_cast<int>(plan::Chain::kBackward)];
  for (size_t i = 0; i < b.size(); ++i) place(plan::Chain::kBackward, static_cast<int>(i), 0, true);
  return out;
}

}  // namespace bgl::sim
