// libFuzzer target: bgl-replay traces (PyTorch snapshots' device_traces, RMM-style CSV).
// load_trace is the entry point (false with a message is a clean refusal); a trace it accepts is
// replayed through the host backend's pool, as bgl-replay does, on a small simulated device so an
// out-of-memory answer is frequent and cheap.
#include <cstddef>
#include <cstdint>
#include <string>

#include "allocator/config.h"
#include "fuzz/fuzz_util.h"
#include "tools/bgl-replay/replay.h"
#include "tools/bgl-replay/trace.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bgl::fuzz::ScratchRemover remover(bgl::fuzz::ScratchPath(".trace"));
  bgl::fuzz::WriteInput(remover.path, data, size);
  bgl::alloc::replay::Trace trace;
  std::string error;
  if (!bgl::alloc::replay::load_trace(remover.path, 0, &trace, &error)) {
    if (error.empty()) __builtin_trap();  // a refusal must say why
    return 0;
  }
  bgl::alloc::Config config;
  if (!bgl::alloc::parse_config("backend:host,capacity:64MiB,history:0", &config, &error)) {
    __builtin_trap();
  }
  bgl::alloc::replay::ReplayResult result;
  (void)bgl::alloc::replay::run_replay(trace, config, 1, &result, &error);
  return 0;
}
