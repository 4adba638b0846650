#include "allocator/config.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <string>

#include "base/units.h"

namespace bgl::alloc {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

bool parse_double(std::string_view s, double* out) {
  std::string str(s);
  if (str.empty()) return false;
  char* end = nullptr;
  double v = std::strtod(str.c_str(), &end);
  if (end != str.c_str() + str.size() || !std::isfinite(v)) return false;
  *out = v;
  return true;
}

bool parse_uint(std::string_view s, std::size_t* out) {
  if (s.empty()) return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size();
}

bool parse_bool(std::string_view s, bool* out) {
  if (s == "1" || s == "true" || s == "True" || s == "on" || s == "yes") {
    *out = true;
  } else if (s == "0" || s == "false" || s == "False" || s == "off" || s == "no") {
    *out = false;
  } else {
    return false;
  }
  return true;
}

// The size of `key` by the project's one rule (bgl::ParseBytes); on failure `why` gets its
// message, which names the key and says what is wrong (for instance that "8G" is ambiguous).
bool parse_size(std::string_view key, std::string_view text, std::size_t* out, std::string* why) {
  const bgl::Result<int64_t> bytes = bgl::ParseBytes(text, "key '" + std::string(key) + "'");
  if (!bytes.ok()) {
    *why = bytes.status().message();
    return false;
  }
  *out = static_cast<std::size_t>(*bytes);
  return true;
}

}  // namespace

bool parse_config(std::string_view text, Config* c, std::string* error) {
  constexpr std::size_t kMaxCapacity = std::size_t{64} << 40;
  std::string why;  // the size rule's message for a value that is not a size
  auto bad = [&](std::string_view key, std::string_view value, std::string_view expected) {
    *error = "BGL_ALLOC_CONF: " +
             (why.empty() ? "bad value '" + std::string(value) + "' for key '" + std::string(key) +
                                "' (expected " + std::string(expected) + ")"
                          : why);
    return false;
  };
  while (!trim(text).empty()) {
    std::size_t comma = text.find(',');
    std::string_view item = trim(text.substr(0, comma));
    text = comma == std::string_view::npos ? std::string_view() : text.substr(comma + 1);
    if (item.empty()) continue;
    std::size_t colon = item.find(':');
    if (colon == std::string_view::npos) {
      *error = "BGL_ALLOC_CONF: entry '" + std::string(item) + "' is not key:value";
      return false;
    }
    std::string_view key = trim(item.substr(0, colon));
    std::string_view value = trim(item.substr(colon + 1));
    std::size_t n = 0;
    double d = 0;
    if (key == "backend") {
      if (value != "auto" && value != "host" && value != "cuda-vmm" && value != "cuda-async") {
        return bad(key, value, "auto, host, cuda-vmm or cuda-async");
      }
      c->backend = std::string(value);
    } else if (key == "devices") {
      if (!parse_uint(value, &n) || n < 1 || n > 64) return bad(key, value, "an integer 1..64");
      c->devices = static_cast<int>(n);
    } else if (key == "capacity") {
      // 64 TiB: half of x86-64's 47-bit user address space, far above any device's memory.
      if (!parse_size(key, value, &n, &why) || n == 0 || n > kMaxCapacity) {
        return bad(key, value, "a size such as 8GiB, at most 64TiB");
      }
      c->capacity = n;
    } else if (key == "page_size") {
      if (!parse_size(key, value, &n, &why) || n < 4096 || n > (std::size_t{1} << 30) ||
          (n & (n - 1)) != 0) {
        return bad(key, value, "a power of two from 4KiB to 1GiB, such as 2MiB");
      }
      c->page_size = n;
    } else if (key == "expandable") {
      if (!parse_bool(value, &c->expandable)) return bad(key, value, "true or false");
    } else if (key == "limit") {
      // A fraction (0 < f <= 1) of the physical capacity, or a byte count with a unit.
      bool is_fraction = value.find_first_not_of("0123456789.") == std::string_view::npos &&
                         value.find('.') != std::string_view::npos;
      if (is_fraction) {
        if (!parse_double(value, &d) || d <= 0 || d > 1)
          return bad(key, value, "0 < fraction <= 1");
        c->pool.limit_fraction = d;
        c->pool.limit_bytes = 0;
      } else {
        if (!parse_size(key, value, &n, &why) || n == 0) {
          return bad(key, value, "a fraction such as 0.9 or a size such as 70GiB");
        }
        c->pool.limit_bytes = n;
      }
    } else if (key == "small_max") {
      if (!parse_size(key, value, &n, &why) || n < 512 || n > (std::size_t{64} << 20)) {
        return bad(key, value, "a size between 512 and 64MiB");
      }
      c->pool.small_max = n;
    } else if (key == "round_divisions") {
      if (!parse_uint(value, &n) || n > 64 || (n != 0 && (n & (n - 1)) != 0)) {
        return bad(key, value, "0 or a power of two up to 64");
      }
      c->pool.round_divisions = static_cast<unsigned>(n);
    } else if (key == "defrag") {
      if (!parse_bool(value, &c->pool.defrag)) return bad(key, value, "true or false");
    } else if (key == "defrag_slack") {
      if (!parse_double(value, &d) || d < 0 || d > 10) return bad(key, value, "a number 0..10");
      c->pool.defrag_slack = d;
    } else if (key == "history") {
      if (!parse_uint(value, &n) || n > (std::size_t{1} << 26)) {
        return bad(key, value, "an entry count up to 67108864");
      }
      c->pool.history = n;
    } else if (key == "log") {
      if (!parse_bool(value, &c->pool.log)) return bad(key, value, "true or false");
    } else {
      *error = "BGL_ALLOC_CONF: unknown key '" + std::string(key) +
               "' (known: backend, devices, capacity, page_size, expandable, limit, small_max, "
               "round_divisions, defrag, defrag_slack, history, log)";
      return false;
    }
  }
  return true;
}

}  // namespace bgl::alloc
