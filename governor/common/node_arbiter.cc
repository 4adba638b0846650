#include "governor/common/node_arbiter.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>
#include <string>

#include "base/units.h"

namespace bgl::gov {

std::vector<int64_t> WaterFill(const std::vector<int64_t>& requests, int64_t budget,
                               int64_t floor) {
  const size_t n = requests.size();
  std::vector<int64_t> grants(n, 0);
  if (n == 0) return grants;
  std::vector<int64_t> demand(n);
  for (size_t i = 0; i < n; ++i) {
    demand[i] = requests[i] <= 0 ? budget : std::max(requests[i], floor);
  }
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return demand[a] < demand[b]; });
  int64_t remaining = budget;
  for (size_t k = 0; k < n; ++k) {
    const int64_t left = static_cast<int64_t>(n - k);
    const size_t i = order[k];
    if (demand[i] <= remaining / left) {
      grants[i] = demand[i];
      remaining -= demand[i];
      continue;
    }
    // Every session from here on demands more than the level: they share what is left.
    const int64_t level = remaining / left;
    int64_t extra = remaining % left;
    std::vector<size_t> rest(order.begin() + static_cast<std::ptrdiff_t>(k), order.end());
    std::sort(rest.begin(), rest.end());
    for (size_t j : rest) {
      grants[j] = level + (extra > 0 ? 1 : 0);
      if (extra > 0) --extra;
    }
    break;
  }
  return grants;
}

Result<NodeArbiter> NodeArbiter::Create(NodeConfig config) {
  if (config.host_budget_bytes < 0) {
    return InvalidArgument("host_budget_bytes: must be non-negative, got " +
                           std::to_string(config.host_budget_bytes));
  }
  if (config.host_floor_bytes < 0) {
    return InvalidArgument("host_floor_bytes: must be non-negative, got " +
                           std::to_string(config.host_floor_bytes));
  }
  if (config.max_sessions < 1 || config.max_sessions > 1 << 20) {
    return InvalidArgument("max_sessions: must be in [1, 1048576], got " +
                           std::to_string(config.max_sessions));
  }
  if (config.host_floor_bytes > config.host_budget_bytes / config.max_sessions) {
    return InvalidArgument("host_budget_bytes: " + std::to_string(config.host_budget_bytes) +
                           " is below host_floor_bytes (" +
                           std::to_string(config.host_floor_bytes) + ") times max_sessions (" +
                           std::to_string(config.max_sessions) + ")");
  }
  std::set<int> seen;
  for (size_t i = 0; i < config.links.size(); ++i) {
    const NodeLink& link = config.links[i];
    const std::string field = "links[" + std::to_string(i) + "]";
    if (link.gpus.empty()) return InvalidArgument("links: " + field + " lists no GPU");
    for (int gpu : link.gpus) {
      if (gpu < 0) {
        return InvalidArgument("links: " + field + " names GPU " + std::to_string(gpu) +
                               " (GPU indices are non-negative)");
      }
      if (!seen.insert(gpu).second) {
        return InvalidArgument("links: GPU " + std::to_string(gpu) +
                               " is in more than one link (again in " + field + ")");
      }
    }
    if (!std::isfinite(link.peak_bytes_per_s) || link.peak_bytes_per_s < 0) {
      return InvalidArgument(field + ".peak_bytes_per_s: must be finite and non-negative");
    }
  }
  return NodeArbiter(std::move(config));
}

NodeArbiter::NodeArbiter(NodeConfig config) : config_(std::move(config)) {
  for (size_t i = 0; i < config_.links.size(); ++i) {
    for (int gpu : config_.links[i].gpus) link_of_gpu_[gpu] = static_cast<int>(i);
  }
}

int NodeArbiter::LinkOf(int gpu) const {
  auto it = link_of_gpu_.find(gpu);
  return it != link_of_gpu_.end() ? it->second : OwnLink(gpu);
}

Result<int64_t> NodeArbiter::Register(uint64_t session, int gpu, int64_t requested_bytes) {
  if (requested_bytes < 0) {
    return InvalidArgument("host_request_bytes: must be non-negative, got " +
                           std::to_string(requested_bytes));
  }
  if (requested_bytes > config_.host_budget_bytes) {
    return InvalidArgument(
        "host_request_bytes: " + FormatBytes(static_cast<double>(requested_bytes), true) +
        " is over the node's host budget (host_budget_bytes " +
        FormatBytes(static_cast<double>(config_.host_budget_bytes), true) + ")");
  }
  if (gpu < 0) return InvalidArgument("gpu: must be non-negative, got " + std::to_string(gpu));
  if (sessions_.count(session) != 0) {
    return InvalidArgument("session: " + std::to_string(session) + " is already registered");
  }
  if (static_cast<int>(sessions_.size()) >= config_.max_sessions) {
    return Status(StatusCode::kResourceExhausted,
                  "host_request_bytes: the node's host budget is shared by max_sessions = " +
                      std::to_string(config_.max_sessions) +
                      " sessions, all registered; none can be granted more");
  }
  SessionState s;
  s.gpu = gpu;
  s.link = LinkOf(gpu);
  s.requested = requested_bytes;
  sessions_.emplace(session, s);
  Rebalance();
  return sessions_.at(session).grant;
}

void NodeArbiter::Unregister(uint64_t session) {
  if (sessions_.erase(session) == 0) return;
  Rebalance();
}

void NodeArbiter::SetUsed(uint64_t session, int64_t used_bytes) {
  auto it = sessions_.find(session);
  if (it == sessions_.end() || used_bytes < 0 || it->second.used == used_bytes) return;
  it->second.used = used_bytes;
  Rebalance();
}

void NodeArbiter::Rebalance() {
  std::vector<int64_t> requests;
  requests.reserve(sessions_.size());
  for (const auto& [id, s] : sessions_) requests.push_back(s.requested);
  std::vector<int64_t> grants =
      WaterFill(requests, config_.host_budget_bytes, config_.host_floor_bytes);
  // Sessions above their share still hold their use: the budget left after every session's
  // max(share, use) is overdrawn by `excess`, taken from the headroom (share - use) of the
  // sessions below their share, in proportion to it (rounded up: the sum never falls short).
  int64_t claimed = 0;
  int64_t headroom = 0;
  size_t i = 0;
  for (const auto& [id, s] : sessions_) {
    claimed += std::max(grants[i], s.used);
    headroom += std::max<int64_t>(grants[i] - s.used, 0);
    ++i;
  }
  const int64_t excess = claimed - config_.host_budget_bytes;
  if (excess > 0 && headroom > 0) {
    i = 0;
    for (const auto& [id, s] : sessions_) {
      const int64_t room = std::max<int64_t>(grants[i] - s.used, 0);
      const auto cut = static_cast<int64_t>(
          (static_cast<__int128>(std::min(excess, headroom)) * room + headroom - 1) / headroom);
      grants[i] -= std::min(cut, room);
      ++i;
    }
  }
  i = 0;
  bool changed = false;
  for (auto& [id, s] : sessions_) {
    changed |= s.grant != grants[i];
    s.grant = grants[i++];
  }
  if (changed) ++version_;
}

int64_t NodeArbiter::Grant(uint64_t session) const {
  auto it = sessions_.find(session);
  return it != sessions_.end() ? it->second.grant : 0;
}

int64_t NodeArbiter::Used(uint64_t session) const {
  auto it = sessions_.find(session);
  return it != sessions_.end() ? it->second.used : 0;
}

std::vector<std::pair<uint64_t, int64_t>> NodeArbiter::Grants() const {
  std::vector<std::pair<uint64_t, int64_t>> out;
  out.reserve(sessions_.size());
  for (const auto& [id, s] : sessions_) out.emplace_back(id, s.grant);
  return out;
}

int NodeArbiter::SessionLink(uint64_t session, int gpu) const {
  auto it = sessions_.find(session);
  return it != sessions_.end() ? it->second.link : OwnLink(gpu);
}

void NodeArbiter::SetOffloading(uint64_t session, bool offloading) {
  auto it = sessions_.find(session);
  if (it != sessions_.end()) it->second.offloading = offloading;
}

int NodeArbiter::OffloadingOnLink(int link) const {
  int n = 0;
  for (const auto& [id, s] : sessions_) n += s.link == link && s.offloading ? 1 : 0;
  return n;
}

double NodeArbiter::BandwidthShare(uint64_t session) const {
  auto it = sessions_.find(session);
  if (it == sessions_.end()) return 1.0;
  int others = 0;
  for (const auto& [id, s] : sessions_) {
    others += id != session && s.link == it->second.link && s.offloading ? 1 : 0;
  }
  return 1.0 / (others + 1);
}

double NodeArbiter::PlanShare(uint64_t session, double own_peak_bytes_per_s) const {
  double share = BandwidthShare(session);
  auto it = sessions_.find(session);
  if (it == sessions_.end()) return share;
  const int link = it->second.link;
  if (link >= 0 && link < static_cast<int>(config_.links.size())) {
    const double peak = config_.links[static_cast<size_t>(link)].peak_bytes_per_s;
    if (peak > 0 && own_peak_bytes_per_s > 0) {
      share = std::clamp(share * peak / own_peak_bytes_per_s, 1.0 / 64, 1.0);
    }
  }
  return share;
}

}  // namespace bgl::gov
