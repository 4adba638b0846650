// Error reporting: the calling thread's last error message, optionally echoed to stderr.
#pragma once

#include <string>

#include "allocator/export.h"

namespace bgl::alloc {

// Result of an allocator or enforcer operation: the C ABI's bgl_status (bgl/alloc.h), value for
// value (allocator/c_api.cc checks each one).
enum class Status : int {
  kOk = 0,
  kInvalidArgument = 1,
  kOutOfMemory = 2,
  kForeignPointer = 3,
  kDoubleFree = 4,
  kWrongSize = 5,
  kWrongDevice = 6,
  kBackendError = 7,
  kNotInitialized = 8,
  kBufferTooSmall = 9,
  kAlreadyInitialized = 10,
  // Enforcer (bgl/enforce.h).
  kUnknownHandle = 11,
  kDuplicate = 12,
  kInvalidState = 13,
  kConflict = 14,
  kPinnedExhausted = 15,
  kCallbackError = 16,
  kInternal = 17,  // an unexpected failure (a C++ exception) the message describes
};
inline constexpr int kStatusCount = 18;

// The C ABI's name of a status ("ok", "out_of_memory", ...; bgl_status_name); null for a value
// that is none.
BGL_ALLOC_INTERNAL const char* status_name(int status);

// Stores `message` as the thread's last error; writes "bgl_alloc: <message>" to stderr when
// `log` is true.
BGL_ALLOC_INTERNAL void report_error(bool log, const std::string& message);
// The thread's last error ("" when none).
BGL_ALLOC_INTERNAL const std::string& last_error();
BGL_ALLOC_INTERNAL void clear_last_error();

// "1.50 GiB (1610612736 bytes)": bgl::FormatBytes with the exact count (base/units.h).
BGL_ALLOC_INTERNAL std::string format_bytes(std::size_t bytes);

}  // namespace bgl::alloc
