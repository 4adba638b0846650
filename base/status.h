// Status and Result: error values shared by the planner and its hosts. Errors name what is
// wrong (a field, a value) so a caller can show them to users unchanged.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <variant>

namespace bgl {

// The kind of failure, mirroring the gRPC codes the daemon maps them to.
enum class StatusCode {
  kOk,
  kInvalidArgument,
  kNotFound,
  kFailedPrecondition,
  kResourceExhausted,
  kInternal,
  kUnavailable
};

// A success or an error code with a message.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status OkStatus() { return {}; }
inline Status InvalidArgument(std::string msg) {
  return {StatusCode::kInvalidArgument, std::move(msg)};
}
inline Status FailedPrecondition(std::string msg) {
  return {StatusCode::kFailedPrecondition, std::move(msg)};
}
inline Status NotFound(std::string msg) { return {StatusCode::kNotFound, std::move(msg)}; }

// A value or the Status that explains why there is none.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}          // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {}  // NOLINT: implicit by design

  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() { return *value_; }
  const T& operator*() const { return *value_; }

 private:
  std::optional<T> value_;
  Status status_;
};

}  // namespace bgl

// Returns early with the error of a Status-valued expression.
#define BGL_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::bgl::Status bgl_status_ = (expr);        \
    if (!bgl_status_.ok()) return bgl_status_; \
  } while (0)
