// NodeArbiter: the node's pinned host memory and host-link bandwidth shared among the sessions of
// one daemon (issue 14). Grants are max-min fair with a floor (water-filling over the sessions'
// requests); a link's bandwidth is split evenly among the sessions on it that offload now. No gRPC:
// the service and bgl-sim's node mode both drive it.
#pragma once

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "base/status.h"

namespace bgl::gov {

// GPUs that share one host link (a PCIe switch or a NUMA node). A plain value.
struct NodeLink {
  std::vector<int> gpus;
  double peak_bytes_per_s = 0;  // 0: the hardware profile's
};

// The node's budget and topology. A plain value.
struct NodeConfig {
  int64_t host_budget_bytes = 0;  // pinned host memory the governor may grant, whole node
  int64_t host_floor_bytes = 0;   // every session's minimum grant
  int max_sessions = 8;           // sessions the budget must cover at the floor
  // GPUs sharing a host link; a GPU in at most one; unlisted GPUs: a link of their own.
  std::vector<NodeLink> links;
};

// Grants and bandwidth shares of the node's sessions. Thread-compatible: the caller locks.
class NodeArbiter {
 public:
  // Errors name the field: "host_budget_bytes" (negative, or below host_floor_bytes *
  // max_sessions), "host_floor_bytes", "max_sessions", "links" (a GPU twice, a negative GPU, an
  // empty link), "links[i].peak_bytes_per_s".
  static Result<NodeArbiter> Create(NodeConfig config);

  // A session asks for `requested_bytes` (0: as much as fair) on `gpu`. Errors name
  // "host_request_bytes" (negative, over the node budget, or max_sessions already registered),
  // "gpu" (negative) or "session" (already registered). Every grant is rebalanced; returns the
  // session's grant.
  Result<int64_t> Register(uint64_t session, int gpu, int64_t requested_bytes);
  // Its grant returns to the node and the others rebalance. Unknown sessions are ignored.
  void Unregister(uint64_t session);
  // The pinned bytes the session holds now (its reports). A session above its fair share gives
  // memory back only as its copies come back: until then its use counts against the budget and
  // the sessions below their share are granted what is left, so the node's pinned memory never
  // exceeds the budget while grants shrink. Unknown sessions and negative values are ignored.
  void SetUsed(uint64_t session, int64_t used_bytes);
  // The current grant (0: unknown session).
  int64_t Grant(uint64_t session) const;
  // The pinned bytes last set by SetUsed (0: unknown session).
  int64_t Used(uint64_t session) const;
  // (session, grant) in session order.
  std::vector<std::pair<uint64_t, int64_t>> Grants() const;
  // The link number of a GPU that no configured link lists (a link of its own), and back.
  static int OwnLink(int gpu) { return -1 - gpu; }
  static int GpuOfOwnLink(int link) { return -1 - link; }
  // Index into config().links, or OwnLink(gpu) for a GPU that is a link of its own.
  int LinkOf(int gpu) const;
  // The link of a registered session (LinkOf(its gpu)); OwnLink(gpu) for an unknown one.
  int SessionLink(uint64_t session, int gpu) const;
  // Whether the session's current point offloads or reloads. Unknown sessions are ignored.
  void SetOffloading(uint64_t session, bool offloading);
  // Sessions on `link` that offload now.
  int OffloadingOnLink(int link) const;
  // 1 / (sessions on its link offloading now, counting itself as offloading); 1.0 alone or
  // unknown.
  double BandwidthShare(uint64_t session) const;
  // The session's share against its own copy roofline (`own_peak_bytes_per_s`, the GPU's
  // calibrated offload peak): BandwidthShare, times the link's measured peak over the GPU's own
  // when the link has one, within [1/64, 1]. What a plan's `bandwidth_share` is.
  double PlanShare(uint64_t session, double own_peak_bytes_per_s) const;
  // Bumps whenever any grant changes.
  uint64_t Version() const { return version_; }
  int sessions() const { return static_cast<int>(sessions_.size()); }
  const NodeConfig& config() const { return config_; }

 private:
  struct SessionState {
    int gpu = 0;
    int link = 0;
    int64_t requested = 0;
    int64_t grant = 0;
    int64_t used = 0;
    bool offloading = false;
  };

  explicit NodeArbiter(NodeConfig config);
  void Rebalance();

  NodeConfig config_;
  std::map<int, int> link_of_gpu_;
  std::map<uint64_t, SessionState> sessions_;
  uint64_t version_ = 0;
};

// Max-min fair grants with a floor: each demand is max(request, floor) (a request of 0 asks for
// the whole budget); every session gets min(demand, fair) with `fair` the largest level the budget
// covers, and the bytes a level leaves over (fewer than the sessions) go one each to the sessions
// not yet satisfied, in order. Exposed for tests and bgl-sim.
std::vector<int64_t> WaterFill(const std::vector<int64_t>& requests, int64_t budget, int64_t floor);

}  // namespace bgl::gov
