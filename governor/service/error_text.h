// Bounded error messages. Errors name the field first ("model_json: unknown field 'x'") and may
// quote what the caller sent; a quoted value can be megabytes, and gRPC carries the message in
// a header (grpc-message, 8 KiB by default on the client), so past that the caller would get a
// transport error instead of the status naming the field. BoundErrorMessage keeps the text
// before any quote (the field name) intact, cuts each long quoted value to its first bytes plus
// its length, escapes bytes that are not printable ASCII, and caps the whole message.
// Pure functions: thread-safe.
#pragma once

#include <grpcpp/support/status.h>

#include <cstddef>
#include <string>
#include <string_view>

namespace bgl::gov {

inline constexpr size_t kMaxErrorMessageBytes = 1024;  // the whole message, after escaping
inline constexpr size_t kMaxQuotedValueBytes = 64;     // one quoted value before it is cut

std::string BoundErrorMessage(std::string_view message, size_t max = kMaxErrorMessageBytes);
// The same status with its message bounded (OK is returned as is).
grpc::Status BoundErrorStatus(const grpc::Status& status);

}  // namespace bgl::gov
