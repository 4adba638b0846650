// Minimal leveled logging to stderr (journald adds timestamps under systemd).
#pragma once

#include <string>

namespace bgl::gov {

enum class LogLevel { kDebug, kInfo, kWarning, kError };
void SetLogLevel(const std::string& level);
void Log(LogLevel level, const std::string& message);

}  // namespace bgl::gov
