// Conversions between the planner's values (bgl::plan) and the wire messages (bagualu.v1), and
// between bgl::Status and grpc::Status: the one place both the daemon and the clients use.
#pragma once

#include <grpcpp/support/status.h>

#include "bagualu/v1/governor.pb.h"
#include "base/status.h"
#include "governor/planner/planner.h"

namespace bgl::gov {

// Plan -> wire. `graph` (optional) labels the issue items, as bgl-plan prints them.
void PlanToProto(const plan::Plan& plan, const plan::StageGraph* graph, bagualu::v1::Plan* out);
// Wire -> Plan. Unknown enum values become the closest safe value (keep / steady).
plan::Plan PlanFromProto(const bagualu::v1::Plan& in);
// The planner's warm-up counters -> wire (PlanResponse.warm_up, ProcessRow.warm_up).
void WarmUpStatsToProto(const plan::PlannerCacheStats& stats, bagualu::v1::WarmUpStats* out);

// A scheduling point -> the fields of a PlanRequest (session_id and gate are left alone).
void PointToProto(const plan::SchedulePoint& point, bagualu::v1::PlanRequest* out);
// A PlanRequest -> a scheduling point; errors name the field (enum out of range, ...).
Result<plan::SchedulePoint> PointFromProto(const bagualu::v1::PlanRequest& in);

// Status mapping in both directions; the message is kept unchanged.
grpc::Status ToGrpcStatus(const Status& status);
Status FromGrpcStatus(const grpc::Status& status);

}  // namespace bgl::gov
