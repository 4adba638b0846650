// Failure: what a failed governor RPC means to a client. The rules are docs/operations.md,
// "Failed calls" (one table, gRPC status -> behaviour); the Python package's
// bagualu/planning/remote.py error_kind() is the other copy of the classification, and
// tests/governor_client_cases.json holds the cases both are tested against.
#pragma once

#include <grpcpp/grpcpp.h>

#include <string_view>

#include "base/status.h"

namespace bgl::gov {

enum class Failure {
  kRefused,      // INVALID_ARGUMENT, FAILED_PRECONDITION, OUT_OF_RANGE: the daemon refused it
  kLostSession,  // NOT_FOUND on "session_id...": the daemon does not know the session
  kNotPlanned,   // another NOT_FOUND: a micro-batch the daemon never planned
  kQuota,        // RESOURCE_EXHAUSTED on "sessions...": the uid's session quota
  kExhausted,    // another RESOURCE_EXHAUSTED: over one of the daemon's limits
  kOutage,       // anything else (UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL, ...)
};

Failure ClassifyFailure(const grpc::Status& status);

// "refused", "lost_session", "not_planned", "quota", "exhausted", "outage" (the Python names).
std::string_view FailureName(Failure failure);

// What RemoteGovernor returns for a failed planning call (Plan, PlanAfterGate, Report): the
// daemon's code for refused, not_planned and exhausted, kUnavailable for the others.
Status FailureStatus(Failure failure, const grpc::Status& status);

// Whether a caller answers a failed planning call with its embedded planner (every failure but
// a refusal, which the embedded planner would repeat: that one is the caller's error).
bool AnswerInProcess(const Status& status);

// Whether a failed registration is retried (after the backoff): not when the daemon refused
// the model or it is over a daemon limit, which a retry would meet again.
bool RetryRegistration(Failure failure);

}  // namespace bgl::gov
