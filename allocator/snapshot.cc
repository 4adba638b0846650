#include "allocator/snapshot.h"

namespace bgl::alloc {

const char* block_state_name(BlockState s) {
  switch (s) {
    case BlockState::kAllocated:
      return "active_allocated";
    case BlockState::kPendingFree:
      return "active_pending_free";
    default:
      return "inactive";
  }
}

nlohmann::json stats_to_json(const Stats& s) {
  nlohmann::json j;
  auto gauge = [&](const char* name, const Gauge& g) {
    j[std::string(name) + "_current"] = g.current;
    j[std::string(name) + "_peak"] = g.peak;
  };
  gauge("allocated_bytes", s.allocated_bytes);
  gauge("requested_bytes", s.requested_bytes);
  gauge("active_bytes", s.active_bytes);
  gauge("reserved_bytes", s.reserved_bytes);
  gauge("allocations", s.allocations);
  gauge("segments", s.segments);
  j["num_allocs"] = s.num_allocs;
  j["num_frees"] = s.num_frees;
  j["num_maps"] = s.num_maps;
  j["num_unmaps"] = s.num_unmaps;
  j["num_ooms"] = s.num_ooms;
  j["num_steals"] = s.num_steals;
  j["num_syncs"] = s.num_syncs;
  j["num_releases"] = s.num_releases;
  j["num_pressure_calls"] = s.num_pressure_calls;
  j["pressure_bytes_freed"] = s.pressure_bytes_freed;
  j["num_invalid_size"] = s.num_invalid_size;
  j["num_foreign_free"] = s.num_foreign_free;
  j["num_double_free"] = s.num_double_free;
  j["num_wrong_size"] = s.num_wrong_size;
  j["num_wrong_device"] = s.num_wrong_device;
  j["inactive_bytes"] = s.inactive_bytes;
  j["largest_free_block"] = s.largest_free_block;
  j["fragmentation"] = s.fragmentation;
  j["limit_bytes"] = s.limit_bytes;
  j["physical_bytes"] = s.physical_bytes;
  return j;
}

nlohmann::json snapshot_to_json(const std::vector<const Pool*>& pools, const Config& config) {
  using nlohmann::json;
  json segments = json::array();
  json traces = json::array();
  bool overflowed = false;
  std::size_t max_entries = 0;
  for (std::size_t d = 0; d < pools.size(); ++d) {
    json dev_trace = json::array();
    const Pool* pool = pools[d];
    if (pool != nullptr) {
      for (const SegmentInfo& seg : pool->segments()) {
        json blocks = json::array();
        std::size_t allocated = 0, active = 0, requested = 0;
        for (const BlockInfo& b : seg.blocks) {
          if (b.state == BlockState::kAllocated) allocated += b.size;
          if (b.state != BlockState::kFree) active += b.size;
          requested += b.requested;
          blocks.push_back({{"address", b.addr},
                            {"size", b.size},
                            {"requested_size", b.requested},
                            {"state", block_state_name(b.state)},
                            {"frames", json::array()}});
        }
        segments.push_back({{"device", d},
                            {"address", seg.addr},
                            {"total_size", seg.size},
                            {"allocated_size", allocated},
                            {"active_size", active},
                            {"requested_size", requested},
                            {"stream", reinterpret_cast<std::uintptr_t>(seg.stream)},
                            {"segment_type", seg.small ? "small" : "large"},
                            {"segment_pool_id", json::array({0, 0})},
                            {"is_expandable", seg.expandable},
                            {"frames", json::array()},
                            {"blocks", blocks}});
      }
      for (const TraceEntry& e : pool->history()) {
        json t = {{"action", action_name(e.action)},
                  {"size", e.size},
                  {"stream", reinterpret_cast<std::uintptr_t>(e.stream)},
                  {"time_us", e.time_us},
                  {"frames", json::array()}};
        t[e.action == Action::kOom ? "device_free" : "addr"] = e.addr;
        dev_trace.push_back(std::move(t));
      }
      overflowed = overflowed || pool->history_overflowed();
      max_entries = std::max(max_entries, pool->options().history);
    }
    traces.push_back(std::move(dev_trace));
  }
  json settings = {{"backend", config.backend},
                   {"expandable_segments", config.expandable},
                   {"limit_fraction", config.pool.limit_fraction},
                   {"limit_bytes", config.pool.limit_bytes},
                   {"small_max", config.pool.small_max},
                   {"roundup_power2_divisions", config.pool.round_divisions},
                   {"defrag", config.pool.defrag},
                   {"defrag_slack", config.pool.defrag_slack},
                   {"page_size", pools.empty() ? config.page_size : pools[0]->page_size()}};
  return {{"segments", segments},
          {"device_traces", traces},
          {"allocator_settings", settings},
          {"trace_alloc_max_entries", max_entries},
          {"trace_alloc_overflowed", overflowed}};
}

}  // namespace bgl::alloc
