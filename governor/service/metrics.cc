#include "governor/service/metrics.h"

#include <prometheus/text_serializer.h>

namespace bgl::gov {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;

Metrics::Metrics() : registry_(std::make_shared<prometheus::Registry>()) {
  auto& r = *registry_;
  plans_ = &BuildCounter().Name("bagualu_plans_total").Help("Plans answered").Register(r).Add({});
  plans_in_progress_ = &BuildGauge()
                            .Name("bagualu_plans_in_progress")
                            .Help("Plan requests the planner is working on now")
                            .Register(r)
                            .Add({});
  cache_hits_ = &BuildCounter()
                     .Name("bagualu_plan_cache_hits_total")
                     .Help("Plans served from the plan cache")
                     .Register(r)
                     .Add({});
  registrations_ = &BuildCounter()
                        .Name("bagualu_registrations_total")
                        .Help("Sessions registered")
                        .Register(r)
                        .Add({});
  reaped_ = &BuildCounter()
                 .Name("bagualu_sessions_reaped_total")
                 .Help("Sessions removed because their process died")
                 .Register(r)
                 .Add({});
  ooms_avoided_ = &BuildCounter()
                       .Name("bagualu_ooms_avoided_total")
                       .Help("Allocations that succeeded after pressure eviction, as reported")
                       .Register(r)
                       .Add({});
  sessions_ = &BuildGauge().Name("bagualu_sessions").Help("Live sessions").Register(r).Add({});
  // Gauges, not counters: sums over the live sessions, which fall when a session ends.
  warm_keys_ = &BuildGauge()
                    .Name("bagualu_warm_keys")
                    .Help("Plan-cache entries holding warm-up plans, over the live sessions")
                    .Register(r)
                    .Add({});
  warm_hits_ = &BuildGauge()
                    .Name("bagualu_warm_hits")
                    .Help("Points served by a warm-up plan, over the live sessions")
                    .Register(r)
                    .Add({});
  warm_shared_hits_ = &BuildGauge()
                           .Name("bagualu_warm_shared_hits")
                           .Help("Of bagualu_warm_hits, plans another session of the job warmed")
                           .Register(r)
                           .Add({});
  warm_cpu_ = &BuildGauge()
                   .Name("bagualu_warm_cpu_seconds")
                   .Help("CPU time of the warm-up threads, over the live sessions")
                   .Register(r)
                   .Add({});
  plan_latency_ = &BuildHistogram()
                       .Name("bagualu_plan_latency_seconds")
                       .Help("Time to answer a Plan request inside the daemon")
                       .Register(r)
                       .Add({}, prometheus::Histogram::BucketBoundaries{
                                    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
                                    1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1});
  invalid_ = &BuildCounter()
                  .Name("bagualu_invalid_requests_total")
                  .Help("Requests rejected by validation (INVALID_ARGUMENT, RESOURCE_EXHAUSTED)")
                  .Register(r);
  gpu_in_use_ = &BuildGauge()
                     .Name("bagualu_gpu_in_use_bytes")
                     .Help("Activation bytes in use on the GPU, as reported by its sessions")
                     .Register(r);
  gpu_capacity_ = &BuildGauge()
                       .Name("bagualu_gpu_capacity_bytes")
                       .Help("Device memory the GPU's sessions may use")
                       .Register(r);
  gpu_reserved_ = &BuildGauge()
                       .Name("bagualu_gpu_reserved_bytes")
                       .Help("Bytes reserved by the allocators on the GPU")
                       .Register(r);
  gpu_budget_ = &BuildGauge()
                     .Name("bagualu_gpu_budget_bytes")
                     .Help("Sum of the latest per-session activation budgets on the GPU")
                     .Register(r);
  host_grant_ = &BuildGauge()
                     .Name("bagualu_host_grant_bytes")
                     .Help("Pinned host bytes the node grants the session (issue 14)")
                     .Register(r);
  host_used_ = &BuildGauge()
                    .Name("bagualu_host_used_bytes")
                    .Help(
                        "Pinned host bytes the session's offloads hold, as reported (else the "
                        "last plan's)")
                    .Register(r);
  link_offload_ = &BuildGauge()
                       .Name("bagualu_link_offload_sessions")
                       .Help("Sessions on the host link whose current plan offloads or reloads")
                       .Register(r);
}

void Metrics::SetNode(const std::vector<SessionHostFigures>& sessions,
                      const std::vector<std::pair<int, int>>& links) {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<std::map<std::string, std::string>, std::pair<prometheus::Gauge*, prometheus::Gauge*>>
      seen;
  for (const SessionHostFigures& s : sessions) {
    std::map<std::string, std::string> labels{{"session", s.session_id},
                                              {"gpu", std::to_string(s.gpu)},
                                              {"job", s.job_id},
                                              {"link", std::to_string(s.link)}};
    auto it = session_gauges_.find(labels);
    std::pair<prometheus::Gauge*, prometheus::Gauge*> g =
        it != session_gauges_.end()
            ? it->second
            : std::pair{&host_grant_->Add(labels), &host_used_->Add(labels)};
    g.first->Set(static_cast<double>(s.grant_bytes));
    g.second->Set(static_cast<double>(s.used_bytes));
    seen.emplace(std::move(labels), g);
  }
  for (const auto& [labels, g] : session_gauges_) {
    if (seen.count(labels) == 0) {
      host_grant_->Remove(g.first);
      host_used_->Remove(g.second);
    }
  }
  session_gauges_ = std::move(seen);
  std::map<int, prometheus::Gauge*> seen_links;
  for (const auto& [link, n] : links) {
    auto it = link_gauges_.find(link);
    prometheus::Gauge* g = it != link_gauges_.end()
                               ? it->second
                               : &link_offload_->Add({{"link", std::to_string(link)}});
    g->Set(n);
    seen_links[link] = g;
  }
  for (const auto& [link, g] : link_gauges_) {
    if (seen_links.count(link) == 0) link_offload_->Remove(g);
  }
  link_gauges_ = std::move(seen_links);
}

void Metrics::OnPlanStarted() { plans_in_progress_->Increment(); }

void Metrics::OnPlanEnded() { plans_in_progress_->Decrement(); }

void Metrics::OnPlan(double seconds, bool cache_hit) {
  plans_->Increment();
  if (cache_hit) cache_hits_->Increment();
  plan_latency_->Observe(seconds);
}

void Metrics::OnInvalidRequest(const std::string& method) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = invalid_by_method_.find(method);
  if (it == invalid_by_method_.end()) {
    it = invalid_by_method_.emplace(method, &invalid_->Add({{"method", method}})).first;
  }
  it->second->Increment();
}

void Metrics::OnRegister() { registrations_->Increment(); }
void Metrics::OnReaped(int n) { reaped_->Increment(n); }
void Metrics::OnOomsAvoided(int64_t n) {
  if (n > 0) ooms_avoided_->Increment(static_cast<double>(n));
}
void Metrics::SetSessions(size_t n) { sessions_->Set(static_cast<double>(n)); }

void Metrics::SetGpu(int index, const std::string& uuid, const GpuFigures& f) {
  const std::map<std::string, std::string> labels{{"gpu", std::to_string(index)}, {"uuid", uuid}};
  gpu_in_use_->Add(labels).Set(static_cast<double>(f.in_use_bytes));
  gpu_capacity_->Add(labels).Set(static_cast<double>(f.capacity_bytes));
  gpu_reserved_->Add(labels).Set(static_cast<double>(f.reserved_bytes));
  gpu_budget_->Add(labels).Set(static_cast<double>(f.budget_bytes));
}

void Metrics::SetWarmUp(const WarmUpFigures& f) {
  warm_keys_->Set(static_cast<double>(f.keys));
  warm_hits_->Set(static_cast<double>(f.hits));
  warm_shared_hits_->Set(static_cast<double>(f.shared_hits));
  warm_cpu_->Set(f.cpu_s);
}

std::string Metrics::Text() const {
  prometheus::TextSerializer serializer;
  return serializer.Serialize(registry_->Collect());
}

}  // namespace bgl::gov
