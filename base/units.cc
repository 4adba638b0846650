#include "base/units.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>

namespace bgl {

std::string Status::ToString() const {
  static const char* kNames[] = {
      "OK",       "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED",
      "INTERNAL", "UNAVAILABLE"};
  return std::string(kNames[static_cast<int>(code_)]) + (ok() ? "" : ": " + message_);
}

namespace {

// A unit's multiplier: binary (KiB = 2^10 ...) or decimal (KB = 10^3 ...), by its position.
struct Unit {
  const char* name;  // upper case
  int64_t scale;
};
constexpr Unit kUnits[] = {
    {"B", 1},
    {"KIB", int64_t{1} << 10},
    {"MIB", int64_t{1} << 20},
    {"GIB", int64_t{1} << 30},
    {"TIB", int64_t{1} << 40},
    {"KB", 1'000},
    {"MB", 1'000'000},
    {"GB", 1'000'000'000},
    {"TB", 1'000'000'000'000},
};

std::string_view Trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

}  // namespace

Result<int64_t> ParseBytes(std::string_view text, std::string_view what) {
  const std::string_view s = Trim(text);
  // Built by appending: g++ 12 at -O3 (Release) flags `"'" + std::string(text) + "'"` with a
  // false -Werror=restrict inside std::operator+.
  std::string prefix(what);
  prefix += ": ";
  std::string quoted;
  quoted.reserve(text.size() + 2);
  quoted += '\'';
  quoted.append(text);
  quoted += '\'';
  if (!s.empty() && s[0] == '-') {
    return InvalidArgument(prefix + "size must be non-negative, got " + quoted);
  }
  // The number: digits with at most one decimal point (no sign, exponent, hex, inf or nan).
  size_t end = 0;
  int digits = 0, points = 0;
  for (; end < s.size(); ++end) {
    if (std::isdigit(static_cast<unsigned char>(s[end]))) {
      ++digits;
    } else if (s[end] == '.' && points == 0) {
      ++points;
    } else {
      break;
    }
  }
  const std::string_view number = s.substr(0, end);
  const std::string_view unit = Trim(s.substr(end));
  const std::string not_a_size =
      prefix + quoted + " is not a size (write bytes or a number with B, KiB, MiB, GiB, TiB " +
      "(powers of 1024) or KB, MB, GB, TB (powers of 1000), such as 64GiB or 512MB)";
  if (digits == 0) return InvalidArgument(not_a_size);
  std::string upper;
  for (char c : unit) upper += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (upper == "K" || upper == "M" || upper == "G" || upper == "T") {
    static constexpr std::string_view kLetters = "KMGT";
    const int power = static_cast<int>(kLetters.find(upper[0])) + 1;
    const std::string n(number);
    return InvalidArgument(prefix + quoted + " is ambiguous: write " + n + upper + "iB (2^" +
                           std::to_string(10 * power) + " bytes each) or " + n + upper + "B (10^" +
                           std::to_string(3 * power) + ")");
  }
  int64_t scale = upper.empty() ? 1 : 0;
  for (const Unit& u : kUnits) {
    if (upper == u.name) scale = u.scale;
  }
  if (scale == 0) return InvalidArgument(not_a_size);
  const std::string out_of_range =
      prefix + "size " + quoted + " is out of range (at most 8 EiB - 1 bytes)";
  if (points == 0) {  // exact integer arithmetic: no rounding for large byte counts
    int64_t value = 0;
    const auto [ptr, ec] = std::from_chars(number.data(), number.data() + number.size(), value);
    if (ec != std::errc() || ptr != number.data() + number.size() ||
        value > std::numeric_limits<int64_t>::max() / scale) {
      return InvalidArgument(out_of_range);
    }
    return value * scale;
  }
  // A fraction ("1.5GiB"), rounded to whole bytes.
  const long double bytes = std::strtold(std::string(number).c_str(), nullptr) * scale;
  if (!std::isfinite(bytes) || bytes >= 9.2e18L) return InvalidArgument(out_of_range);
  return static_cast<int64_t>(std::llround(bytes));
}

std::string FormatBytes(double bytes, bool exact) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int unit = 0;
  double value = bytes;
  while (std::fabs(value) >= 1000 && unit < 5) {
    value /= 1024;
    ++unit;
  }
  char buf[64];
  const double magnitude = std::fabs(value);
  const char* format = unit == 0 || magnitude >= 100 ? "%.0f %s"
                       : magnitude >= 10             ? "%.1f %s"
                                                     : "%.2f %s";
  std::snprintf(buf, sizeof buf, format, value, kUnits[unit]);
  std::string text = buf;
  if (exact && unit > 0) {
    std::snprintf(buf, sizeof buf, " (%.0f bytes)", bytes);
    text += buf;
  }
  return text;
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
