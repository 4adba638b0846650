// Metrics: the daemon's Prometheus metrics (prefix bagualu_), updated by the service and
// served by prometheus-cpp's exposer. Thread-safe.
#pragma once

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace bgl::gov {

// Per-GPU figures published as gauges labelled {gpu, uuid}.
struct GpuFigures {
  int64_t capacity_bytes = 0;
  int64_t in_use_bytes = 0;
  int64_t reserved_bytes = 0;
  int64_t budget_bytes = 0;
};

// One session's pinned host grant and use (issue 14), published as gauges labelled
// {session, gpu, job, link}.
struct SessionHostFigures {
  std::string session_id;
  int gpu = 0;
  std::string job_id;
  int link = 0;
  int64_t grant_bytes = 0;
  int64_t used_bytes = 0;
};

// The warm-up's figures summed over the live sessions that warm up (issue 43).
struct WarmUpFigures {
  uint64_t keys = 0;
  uint64_t hits = 0;
  uint64_t shared_hits = 0;
  double cpu_s = 0;
};

class Metrics {
 public:
  Metrics();
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  void OnPlan(double seconds, bool cache_hit);
  // A plan's planner work starts and ends (bagualu_plans_in_progress).
  void OnPlanStarted();
  void OnPlanEnded();
  void OnInvalidRequest(const std::string& method);
  void OnRegister();
  void OnReaped(int n);
  void OnOomsAvoided(int64_t n);
  void SetSessions(size_t n);
  void SetGpu(int index, const std::string& uuid, const GpuFigures& figures);
  // Replaces the per-session host gauges and the per-link offloading-session gauges (links as
  // (link, offloading sessions)); sessions and links no longer listed are dropped.
  void SetNode(const std::vector<SessionHostFigures>& sessions,
               const std::vector<std::pair<int, int>>& links);
  // Sets the warm-up gauges (bagualu_warm_*).
  void SetWarmUp(const WarmUpFigures& figures);
  // The registry in Prometheus text format (tests, debugging).
  std::string Text() const;

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Counter* plans_;
  prometheus::Gauge* plans_in_progress_;
  prometheus::Counter* cache_hits_;
  prometheus::Counter* registrations_;
  prometheus::Counter* reaped_;
  prometheus::Counter* ooms_avoided_;
  prometheus::Gauge* sessions_;
  prometheus::Histogram* plan_latency_;
  prometheus::Family<prometheus::Counter>* invalid_;
  prometheus::Family<prometheus::Gauge>* gpu_in_use_;
  prometheus::Family<prometheus::Gauge>* gpu_capacity_;
  prometheus::Family<prometheus::Gauge>* gpu_reserved_;
  prometheus::Family<prometheus::Gauge>* gpu_budget_;
  std::mutex mu_;  // guards the label lookups below (Family::Add is itself locked)
  std::map<std::string, prometheus::Counter*> invalid_by_method_;
  prometheus::Family<prometheus::Gauge>* host_grant_;
  prometheus::Family<prometheus::Gauge>* host_used_;
  prometheus::Family<prometheus::Gauge>* link_offload_;
  // Gauges published by the last SetNode, by label set (guarded by mu_).
  std::map<std::map<std::string, std::string>, std::pair<prometheus::Gauge*, prometheus::Gauge*>>
      session_gauges_;
  std::map<int, prometheus::Gauge*> link_gauges_;
  prometheus::Gauge* warm_keys_;
  prometheus::Gauge* warm_hits_;
  prometheus::Gauge* warm_shared_hits_;
  prometheus::Gauge* warm_cpu_;
};

}  // namespace bgl::gov
