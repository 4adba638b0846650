// libFuzzer target: the byte-size rule (bgl::ParseBytes: flags, YAML, BGL_ALLOC_CONF, model
// files, bgl_parse_bytes of the Python package). An error Result is a clean refusal; a value must
// be non-negative, and FormatBytes must print it.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "base/units.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto bytes = bgl::ParseBytes(text, "fuzz");
  if (!bytes.ok()) {
    if (bytes.status().message().empty()) __builtin_trap();  // a refusal must say why
    return 0;
  }
  if (*bytes < 0) __builtin_trap();  // documented: non-negative
  (void)bgl::FormatBytes(static_cast<double>(*bytes));
  return 0;
}
