#include "tools/bgl-top/frame_json.h"

namespace bgl::top {
namespace {

nlohmann::json Counts(const google::protobuf::Map<std::string, int64_t>& counts) {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [key, n] : counts) out[key] = n;
  return out;
}

}  // namespace

nlohmann::json FrameToJson(const bagualu::v1::WatchResponse& frame, const History& history,
                           SortKey sort, bool reverse, const std::string& address) {
  nlohmann::json gpus = nlohmann::json::array();
  for (const auto& gpu : frame.gpus()) {
    nlohmann::json samples = nlohmann::json::array();
    for (const Sample& s : history.Of(gpu.gpu_uuid())) {
      samples.push_back({{"unix_ms", s.unix_ms},
                         {"in_use_bytes", s.in_use_bytes},
                         {"load_factor", s.load_factor},
                         {"spike", s.spike()}});
    }
    gpus.push_back({{"gpu_uuid", gpu.gpu_uuid()},
                    {"gpu_index", gpu.gpu_index()},
                    {"capacity_bytes", gpu.capacity_bytes()},
                    {"in_use_bytes", gpu.in_use_bytes()},
                    {"reserved_bytes", gpu.reserved_bytes()},
                    {"budget_bytes", gpu.budget_bytes()},
                    {"load_factor", gpu.load_factor()},
                    {"strategy_counts", Counts(gpu.strategy_counts())},
                    {"plan_cache_hits", gpu.plan_cache_hits()},
                    {"plan_cache_misses", gpu.plan_cache_misses()},
                    {"ooms_avoided", gpu.ooms_avoided()},
                    {"processes", gpu.processes_size()},
                    {"history", std::move(samples)}});
  }
  nlohmann::json processes = nlohmann::json::array();
  for (const ProcessRef& ref : SortedProcesses(frame, sort, reverse)) {
    const auto& r = *ref.row;
    const auto& s = r.session();
    nlohmann::json in_effect = nullptr;  // null: the process reports none
    if (r.has_in_effect()) {
      const auto& e = r.in_effect();
      in_effect = {{"micro_batches", e.micro_batches()},
                   {"planned_bytes", e.planned_bytes()},
                   {"actual_bytes", e.actual_bytes()},
                   {"planned_host_bytes", e.planned_host_bytes()},
                   {"actual_host_bytes", e.actual_host_bytes()},
                   {"strategy_counts", Counts(e.strategy_counts())}};
    }
    nlohmann::json warm_up = nullptr;  // null: the session does not warm up (issue 43)
    if (r.has_warm_up()) {
      const auto& w = r.warm_up();
      warm_up = {{"keys", w.keys()},
                 {"hits", w.hits()},
                 {"shared_hits", w.shared_hits()},
                 {"submitted", w.submitted()},
                 {"done", w.done()},
                 {"complete", w.complete()},
                 {"cpu_s", w.cpu_s()},
                 {"shared_keys", w.shared_keys()}};
    }
    processes.push_back({{"gpu_index", ref.gpu->gpu_index()},
                         {"gpu_uuid", ref.gpu->gpu_uuid()},
                         {"session_id", s.session_id()},
                         {"pid", s.pid()},
                         {"uid", s.uid()},
                         {"user", s.user()},
                         {"job_id", s.job_id()},
                         {"pipeline_rank", s.pipeline_rank()},
                         {"model", s.model()},
                         {"in_use_bytes", r.in_use_bytes()},
                         {"peak_bytes", r.peak_bytes()},
                         {"reserved_bytes", r.reserved_bytes()},
                         {"budget_bytes", r.budget_bytes()},
                         {"load_factor", r.load_factor()},
                         {"strategy_counts", Counts(r.strategy_counts())},
                         {"ooms_avoided", r.ooms_avoided()},
                         {"oom_count", r.oom_count()},
                         {"plans", r.plans()},
                         {"host_grant_bytes", s.host_grant_bytes()},
                         {"host_used_bytes", s.host_used_bytes()},
                         {"bandwidth_share", r.bandwidth_share()},
                         {"offloading", r.offloading()},
                         {"in_effect", std::move(in_effect)},
                         {"warm_up", std::move(warm_up)},
                         {"link", s.link()}});
  }
  nlohmann::json links = nlohmann::json::array();
  for (const auto& l : frame.links()) {
    links.push_back({{"link", l.link()},
                     {"gpus", std::vector<int>(l.gpus().begin(), l.gpus().end())},
                     {"sessions", l.sessions()},
                     {"offloading_sessions", l.offloading_sessions()},
                     {"host_grant_bytes", l.host_grant_bytes()},
                     {"host_used_bytes", l.host_used_bytes()}});
  }
  return {{"governor", address},
          {"unix_ms", frame.unix_ms()},
          {"sort", SortKeyName(sort)},
          {"reverse", reverse},
          {"gpus", std::move(gpus)},
          {"processes", std::move(processes)},
          {"host_budget_bytes", frame.host_budget_bytes()},
          {"links", std::move(links)}};
}

}  // namespace bgl::top
