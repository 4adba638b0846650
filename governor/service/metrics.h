// Metrics: the daemon's Prometheus metrics (prefix bagualu_), updated by the service and
// served by prometheus-cpp's exposer. Thread-safe.
#pragma once

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace bgl::gov {

// Per-GPU figures published as gauges labelled {gpu, uuid}.
struct GpuFigures {
  int64_t capacity_bytes = 0;
  int64_t in_use_bytes = 0;
  int64_t reserved_bytes = 0;
  int64_t budget_bytes = 0;
};

class Metrics {
 public:
  Metrics();
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  void OnPlan(double seconds, bool cache_hit);
  void OnInvalidRequest(const std::string& method);
  void OnRegister();
  void OnReaped(int n);
  void OnOomsAvoided(int64_t n);
  void SetSessions(size_t n);
  void SetGpu(int index, const std::string& uuid, const GpuFigures& figures);
  // The registry in Prometheus text format (tests, debugging).
  std::string Text() const;

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Counter* plans_;
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
};

}  // namespace bgl::gov
