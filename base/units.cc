#include "base/units.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <string>

namespace bgl {

std::string Status::ToString() const {
  static const char* kNames[] = {
      "OK",       "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED",
      "INTERNAL", "UNAVAILABLE"};
  return std::string(kNames[static_cast<int>(code_)]) + (ok() ? "" : ": " + message_);
}

Result<int64_t> ParseBytes(std::string_view text, std::string_view what) {
  std::string s(text);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t pos = 0;
  while (pos < s.size() && std::isspace(static_cast<unsigned char>(s[pos]))) ++pos;
  s = s.substr(pos);
  const std::string error = std::string(what) + ": '" + std::string(text) +
                            "' is not a size (use bytes or a unit such as 64GiB, 512MB)";
  if (s.empty() || s[0] == '-') {
    return InvalidArgument(std::string(what) + ": size must be non-negative, got '" +
                           std::string(text) + "'");
  }
  size_t end = 0;
  double number = 0;
  try {
    number = std::stod(s, &end);
  } catch (...) {
    return InvalidArgument(error);
  }
  std::string unit = s.substr(end);
  while (!unit.empty() && unit[0] == ' ') unit.erase(0, 1);
  std::string upper;
  for (char c : unit) upper += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  double scale = 0;
  if (upper.empty() || upper == "B")
    scale = 1;
  else if (upper == "KB" || upper == "K")
    scale = 1e3;
  else if (upper == "MB" || upper == "M")
    scale = 1e6;
  else if (upper == "GB" || upper == "G")
    scale = 1e9;
  else if (upper == "TB" || upper == "T")
    scale = 1e12;
  else if (upper == "KIB")
    scale = 1024.0;
  else if (upper == "MIB")
    scale = 1024.0 * 1024;
  else if (upper == "GIB")
    scale = 1024.0 * 1024 * 1024;
  else if (upper == "TIB")
    scale = 1024.0 * 1024 * 1024 * 1024;
  else
    return InvalidArgument(error);
  const double bytes = number * scale;
  if (!std::isfinite(bytes) || bytes < 0 || bytes > 9.0e18) {
    return InvalidArgument(std::string(what) + ": size '" + std::string(text) +
                           "' is out of range");
  }
  return static_cast<int64_t>(std::llround(bytes));
}

std::string FormatBytes(double bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  double value = bytes;
  while (std::fabs(value) >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  // Three significant digits without switching to exponent form (1000-1023 of a unit).
  char buf[32];
  const double magnitude = std::fabs(value);
  const char* format = unit == 0 || magnitude >= 100 ? "%.0f %s"
                       : magnitude >= 10             ? "%.1f %s"
                                                     : "%.2f %s";
  std::snprintf(buf, sizeof buf, format, value, kUnits[unit]);
  return buf;
}

std::string FormatSeconds(double seconds) {
  char buf[32];
  if (std::fabs(seconds) < 1e-3)
    std::snprintf(buf, sizeof buf, "%.1f us", seconds * 1e6);
  else if (std::fabs(seconds) < 1)
    std::snprintf(buf, sizeof buf, "%.2f ms", seconds * 1e3);
  else
    std::snprintf(buf, sizeof buf, "%.2f s", seconds);
  return buf;
}

}  // namespace bgl
