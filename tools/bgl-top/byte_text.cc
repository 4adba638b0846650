#include "tools/bgl-top/byte_text.h"

#include <cmath>
#include <cstdio>
#include <iterator>

namespace bgl::top {

std::string ShortBytes(int64_t bytes) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = static_cast<double>(bytes);
  size_t unit = 0;
  while (std::abs(value) >= 1000 && unit + 1 < std::size(kUnits)) {
    value /= 1024;
    ++unit;
  }
  char buf[32];
  if (unit == 0) {
    std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(bytes));
  } else {
    const int decimals = std::abs(value) >= 100 ? 0 : (std::abs(value) >= 10 ? 1 : 2);
    std::snprintf(buf, sizeof buf, "%.*f %s", decimals, value, kUnits[unit]);
  }
  return buf;
}

}  // namespace bgl::top
