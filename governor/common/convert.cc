#include "governor/common/convert.h"

#include <cmath>

#include "governor/planner/plan_format.h"

namespace bgl::gov {
namespace {

namespace pb = bagualu::v1;

pb::Phase PhaseToProto(plan::Phase p) {
  switch (p) {
    case plan::Phase::kWarmup:
      return pb::PHASE_WARMUP;
    case plan::Phase::kSteady:
      return pb::PHASE_STEADY;
    case plan::Phase::kCooldown:
      return pb::PHASE_COOLDOWN;
  }
  return pb::PHASE_UNSPECIFIED;
}

plan::Phase PhaseFromProto(int p) {
  if (p == pb::PHASE_WARMUP) return plan::Phase::kWarmup;
  if (p == pb::PHASE_COOLDOWN) return plan::Phase::kCooldown;
  return plan::Phase::kSteady;
}

// The proto's strategy numbers are the planner's: plans go out as static_cast<int>(strategy).
static_assert(pb::STRATEGY_KEEP == static_cast<int>(plan::Strategy::kKeep));
static_assert(pb::STRATEGY_RECOMPUTE == static_cast<int>(plan::Strategy::kRecompute));
static_assert(pb::STRATEGY_OFFLOAD == static_cast<int>(plan::Strategy::kOffload));
static_assert(pb::STRATEGY_FP8 == static_cast<int>(plan::Strategy::kFp8));

plan::Strategy StrategyFromProto(int s) {
  switch (s) {
    case pb::STRATEGY_RECOMPUTE:
      return plan::Strategy::kRecompute;
    case pb::STRATEGY_OFFLOAD:
      return plan::Strategy::kOffload;
    case pb::STRATEGY_FP8:
      return plan::Strategy::kFp8;
    default:
      return plan::Strategy::kKeep;
  }
}

plan::Chain ChainFromProto(int c) {
  if (c >= 0 && c <= 3) return static_cast<plan::Chain>(c);
  return plan::Chain::kForward;
}

plan::Resource ResourceFromProto(int r) {
  if (r >= 0 && r <= 3) return static_cast<plan::Resource>(r);
  return plan::Resource::kCompute;
}

}  // namespace

void PlanToProto(const plan::Plan& p, const plan::StageGraph* graph, pb::Plan* out) {
  out->set_phase(PhaseToProto(p.phase));
  out->set_micro_batch(p.micro_batch);
  out->set_chunk(p.chunk);
  out->set_load_factor(p.load_factor);
  out->set_budget_bytes(p.budget_bytes);
  out->set_free_bytes(p.free_bytes);
  out->set_k(p.k);
  out->set_infeasible(p.infeasible);
  out->set_m0_bytes(p.m0_bytes);
  out->set_keep_all_bytes(p.keep_all_bytes);
  out->set_predicted_bytes(p.predicted_bytes);
  out->set_host_bytes(p.host_bytes);
  out->mutable_strategies()->Reserve(static_cast<int>(p.strategies.size()));
  for (plan::Strategy s : p.strategies) {
    out->add_strategies(static_cast<pb::Strategy>(static_cast<int>(s)));
  }
  for (const plan::IssueItem& item : p.issue_order) {
    pb::IssueItem* o = out->add_issue_order();
    o->set_chain(static_cast<pb::Chain>(static_cast<int>(item.chain)));
    o->set_stage(item.stage);
    o->set_round(item.round);
    o->set_resource(static_cast<pb::Resource>(static_cast<int>(item.resource)));
    o->set_duration_s(item.duration_s);
    o->set_first(item.first);
    o->set_last(item.last);
    if (graph != nullptr) o->set_label(plan::IssueLabel(item, *graph));
  }
  out->set_overhead_s(p.overhead_s);
  out->set_serial_s(p.serial_s);
  out->set_overlapped_s(p.overlapped_s);
  out->set_fallback_full_recompute(p.fallback_full_recompute);
  out->set_deferred(p.deferred);
  out->set_cache_hit(p.cache_hit);
  out->set_first_answer(p.first_answer);
  out->set_refined(p.refined);
  out->set_warm(p.warm);
  out->set_nearest(p.nearest);
  out->set_bandwidth_share(p.bandwidth_share);
}

void WarmUpStatsToProto(const plan::PlannerCacheStats& stats, pb::WarmUpStats* out) {
  out->set_keys(stats.warm_keys);
  out->set_hits(stats.warm_hits);
  out->set_shared_hits(stats.warm_shared_hits);
  out->set_submitted(stats.warm_submitted);
  out->set_done(stats.warm_done);
  out->set_complete(stats.warm_complete);
  out->set_cpu_s(stats.warm_cpu_s);
  out->set_shared_keys(stats.warm_shared_keys);
}

plan::Plan PlanFromProto(const pb::Plan& in) {
  plan::Plan p;
  p.phase = PhaseFromProto(in.phase());
  p.micro_batch = in.micro_batch();
  p.chunk = in.chunk();
  p.load_factor = in.load_factor();
  p.budget_bytes = in.budget_bytes();
  p.free_bytes = in.free_bytes();
  p.k = in.k();
  p.infeasible = in.infeasible();
  p.m0_bytes = in.m0_bytes();
  p.keep_all_bytes = in.keep_all_bytes();
  p.predicted_bytes = in.predicted_bytes();
  p.host_bytes = in.host_bytes();
  p.strategies.reserve(static_cast<size_t>(in.strategies_size()));
  for (int s : in.strategies()) p.strategies.push_back(StrategyFromProto(s));
  p.issue_order.reserve(static_cast<size_t>(in.issue_order_size()));
  for (const pb::IssueItem& o : in.issue_order()) {
    plan::IssueItem item;
    item.chain = ChainFromProto(o.chain());
    item.stage = o.stage();
    item.round = o.round();
    item.resource = ResourceFromProto(o.resource());
    item.duration_s = o.duration_s();
    item.first = o.first();
    item.last = o.last();
    p.issue_order.push_back(item);
  }
  p.overhead_s = in.overhead_s();
  p.serial_s = in.serial_s();
  p.overlapped_s = in.overlapped_s();
  p.fallback_full_recompute = in.fallback_full_recompute();
  p.deferred = in.deferred();
  p.cache_hit = in.cache_hit();
  p.first_answer = in.first_answer();
  p.refined = in.refined();
  p.warm = in.warm();
  p.nearest = in.nearest();
  p.bandwidth_share = in.bandwidth_share() > 0 ? in.bandwidth_share() : 1.0;
  return p;
}

void PointToProto(const plan::SchedulePoint& point, pb::PlanRequest* out) {
  out->set_phase(point.phase ? PhaseToProto(*point.phase) : pb::PHASE_UNSPECIFIED);
  if (point.forward_micro_batch >= 0) {
    out->set_forward_micro_batch(point.forward_micro_batch);
  } else {
    out->clear_forward_micro_batch();
  }
  out->set_forward_chunk(point.forward_chunk);
  if (point.backward_micro_batch >= 0) {
    out->set_backward_micro_batch(point.backward_micro_batch);
  } else {
    out->clear_backward_micro_batch();
  }
  out->set_backward_chunk(point.backward_chunk);
  out->set_load_factor(point.load_factor);
  if (point.bytes_in_use >= 0) {
    out->set_bytes_in_use(point.bytes_in_use);
  } else {
    out->clear_bytes_in_use();
  }
}

Result<plan::SchedulePoint> PointFromProto(const pb::PlanRequest& in) {
  plan::SchedulePoint point;
  switch (in.phase()) {
    case pb::PHASE_UNSPECIFIED:
      break;
    case pb::PHASE_WARMUP:
    case pb::PHASE_STEADY:
    case pb::PHASE_COOLDOWN:
      point.phase = PhaseFromProto(in.phase());
      break;
    default:
      return InvalidArgument("phase: unknown value " + std::to_string(in.phase()));
  }
  if (in.has_forward_micro_batch()) {
    if (in.forward_micro_batch() < 0) {
      return InvalidArgument("forward_micro_batch: must be non-negative when set, got " +
                             std::to_string(in.forward_micro_batch()));
    }
    point.forward_micro_batch = in.forward_micro_batch();
  }
  point.forward_chunk = in.forward_chunk();
  if (in.has_backward_micro_batch()) {
    if (in.backward_micro_batch() < 0) {
      return InvalidArgument("backward_micro_batch: must be non-negative when set, got " +
                             std::to_string(in.backward_micro_batch()));
    }
    point.backward_micro_batch = in.backward_micro_batch();
  }
  point.backward_chunk = in.backward_chunk();
  if (!in.has_forward_micro_batch() && in.forward_chunk() != 0) {
    return InvalidArgument("forward_chunk: set without forward_micro_batch");
  }
  if (!in.has_backward_micro_batch() && in.backward_chunk() != 0) {
    return InvalidArgument("backward_chunk: set without backward_micro_batch");
  }
  point.load_factor = in.load_factor() == 0 ? 1.0 : in.load_factor();
  if (!std::isfinite(point.load_factor) || point.load_factor <= 0 || point.load_factor > 64) {
    return InvalidArgument("load_factor: must be in (0, 64] (0 means 1), got " +
                           std::to_string(in.load_factor()));
  }
  if (in.has_bytes_in_use()) {
    if (in.bytes_in_use() < 0 || in.bytes_in_use() > (int64_t{1} << 50)) {
      return InvalidArgument("bytes_in_use: must be in [0, 2^50], got " +
                             std::to_string(in.bytes_in_use()));
    }
    point.bytes_in_use = in.bytes_in_use();
  }
  return point;
}

grpc::Status ToGrpcStatus(const Status& s) {
  switch (s.code()) {
    case StatusCode::kOk:
      return grpc::Status::OK;
    case StatusCode::kInvalidArgument:
      return {grpc::StatusCode::INVALID_ARGUMENT, s.message()};
    case StatusCode::kNotFound:
      return {grpc::StatusCode::NOT_FOUND, s.message()};
    case StatusCode::kFailedPrecondition:
      return {grpc::StatusCode::FAILED_PRECONDITION, s.message()};
    case StatusCode::kResourceExhausted:
      return {grpc::StatusCode::RESOURCE_EXHAUSTED, s.message()};
    case StatusCode::kUnavailable:
      return {grpc::StatusCode::UNAVAILABLE, s.message()};
    case StatusCode::kInternal:
      return {grpc::StatusCode::INTERNAL, s.message()};
  }
  return {grpc::StatusCode::UNKNOWN, s.message()};
}

Status FromGrpcStatus(const grpc::Status& s) {
  switch (s.error_code()) {
    case grpc::StatusCode::OK:
      return OkStatus();
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::OUT_OF_RANGE:
      return {StatusCode::kInvalidArgument, s.error_message()};
    case grpc::StatusCode::NOT_FOUND:
      return {StatusCode::kNotFound, s.error_message()};
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::PERMISSION_DENIED:
    case grpc::StatusCode::UNAUTHENTICATED:
      return {StatusCode::kFailedPrecondition, s.error_message()};
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return {StatusCode::kResourceExhausted, s.error_message()};
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
    case grpc::StatusCode::CANCELLED:
      return {StatusCode::kUnavailable, s.error_message()};
    default:
      return {StatusCode::kInternal, s.error_message()};
  }
}

}  // namespace bgl::gov
