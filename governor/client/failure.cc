#include "governor/client/failure.h"

#include <string>

#include "governor/common/convert.h"

namespace bgl::gov {

Failure ClassifyFailure(const grpc::Status& s) {
  const std::string& msg = s.error_message();
  switch (s.error_code()) {
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::OUT_OF_RANGE:
      return Failure::kRefused;
    case grpc::StatusCode::NOT_FOUND:
      return msg.rfind("session_id", 0) == 0 ? Failure::kLostSession : Failure::kNotPlanned;
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return msg.rfind("sessions", 0) == 0 ? Failure::kQuota : Failure::kExhausted;
    default:
      return Failure::kOutage;
  }
}

std::string_view FailureName(Failure failure) {
  switch (failure) {
    case Failure::kRefused:
      return "refused";
    case Failure::kLostSession:
      return "lost_session";
    case Failure::kNotPlanned:
      return "not_planned";
    case Failure::kQuota:
      return "quota";
    case Failure::kExhausted:
      return "exhausted";
    case Failure::kOutage:
      return "outage";
  }
  return "outage";
}

Status FailureStatus(Failure failure, const grpc::Status& s) {
  switch (failure) {
    case Failure::kRefused:
    case Failure::kNotPlanned:
    case Failure::kExhausted:
      return FromGrpcStatus(s);
    case Failure::kLostSession:
      return {StatusCode::kUnavailable, "governor: the daemon lost the session (" +
                                            s.error_message() + "); registering again"};
    case Failure::kQuota:
    case Failure::kOutage:
      break;
  }
  return {StatusCode::kUnavailable, "governor: daemon unavailable (code " +
                                        std::to_string(static_cast<int>(s.error_code())) + ": " +
                                        s.error_message() + "); retrying with backoff"};
}

bool AnswerInProcess(const Status& status) {
  switch (status.code()) {
    case StatusCode::kUnavailable:
    case StatusCode::kNotFound:
    case StatusCode::kResourceExhausted:
      return true;
    default:
      return false;
  }
}

bool RetryRegistration(Failure failure) {
  return failure != Failure::kRefused && failure != Failure::kExhausted;
}

}  // namespace bgl::gov
