// libFuzzer target: BGL_ALLOC_CONF ("key:value,key:value"), read by libbgl_alloc.so, the
// LD_PRELOAD shim and bgl-replay. parse_config's false (with a message) is a clean refusal.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "allocator/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  bgl::alloc::Config config;
  std::string error;
  if (!bgl::alloc::parse_config(text, &config, &error) && error.empty()) {
    __builtin_trap();  // a refusal must say why
  }
  return 0;
}
