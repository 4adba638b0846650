#include "governor/daemon/log.h"

#include <atomic>
#include <cstdio>

namespace bgl::gov {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
}

void SetLogLevel(const std::string& level) {
  LogLevel l = LogLevel::kInfo;
  if (level == "debug") l = LogLevel::kDebug;
  if (level == "warning") l = LogLevel::kWarning;
  if (level == "error") l = LogLevel::kError;
  g_level.store(static_cast<int>(l));
}

void Log(LogLevel level, const std::string& message) {
  if (static_cast<int>(level) < g_level.load()) return;
  static const char* kNames[] = {"debug", "info", "warning", "error"};
  std::fprintf(stderr, "bgl-governord: %s: %s\n", kNames[static_cast<int>(level)],
               message.c_str());
}

}  // namespace bgl::gov
