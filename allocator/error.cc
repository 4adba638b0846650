#include "allocator/error.h"

#include <cstdio>

#include "base/units.h"

namespace bgl::alloc {
namespace {
thread_local std::string t_last_error;
}  // namespace

void report_error(bool log, const std::string& message) {
  t_last_error = message;
  if (log) std::fprintf(stderr, "bgl_alloc: %s\n", message.c_str());
}

const char* status_name(int status) {
  static const char* const kNames[kStatusCount] = {"ok",
                                                   "invalid_argument",
                                                   "out_of_memory",
                                                   "foreign_pointer",
                                                   "double_free",
                                                   "wrong_size",
                                                   "wrong_device",
                                                   "backend",
                                                   "not_initialized",
                                                   "buffer_too_small",
                                                   "already_initialized",
                                                   "unknown_handle",
                                                   "duplicate",
                                                   "invalid_state",
                                                   "conflict",
                                                   "pinned_exhausted",
                                                   "callback",
                                                   "internal"};
  return status >= 0 && status < kStatusCount ? kNames[status] : nullptr;
}

const std::string& last_error() { return t_last_error; }
void clear_last_error() { t_last_error.clear(); }

std::string format_bytes(std::size_t bytes) {
  return FormatBytes(static_cast<double>(bytes), true);
}

}  // namespace bgl::alloc
