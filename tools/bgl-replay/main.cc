// bgl-replay --trace FILE [--backend host] [--conf K:V,...] [--device N] [--repeat N] [--json]
// Replays an allocation trace and prints peak live, peak reserved, their ratio, ns/op, OOMs.
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>

#include "base/units.h"
#include "tools/bgl-replay/replay.h"

namespace {

void usage() {
  std::fprintf(stderr,
               "usage: bgl-replay --trace FILE [--backend host|cuda-vmm|cuda-async|auto]\n"
               "                  [--conf BGL_ALLOC_CONF-style options] [--device N]\n"
               "                  [--repeat N] [--json]\n"
               "FILE: PyTorch memory snapshot JSON (device_traces) or CSV with columns\n"
               "thread,time,action,pointer,size,stream (RMM logging adaptor format).\n");
}

}  // namespace

int main(int argc, char** argv) {
  using namespace bgl::alloc;
  std::string trace_path, backend = "host", conf;
  int device = 0, repeat = 3;
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bgl-replay: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--trace")
      trace_path = value();
    else if (a == "--backend")
      backend = value();
    else if (a == "--conf")
      conf = value();
    else if (a == "--device" || a == "--repeat") {
      const std::string v = value();
      char* end = nullptr;
      errno = 0;
      const long n = std::strtol(v.c_str(), &end, 10);
      const long max = a == "--device" ? 63 : 1000000;
      if (v.empty() || *end != '\0' || errno != 0 || n < (a == "--device" ? 0 : 1) || n > max) {
        std::fprintf(stderr, "bgl-replay: %s: expected an integer in [%d, %ld], got '%s'\n",
                     a.c_str(), a == "--device" ? 0 : 1, max, v.c_str());
        return 2;
      }
      (a == "--device" ? device : repeat) = static_cast<int>(n);
    } else if (a == "--json")
      json = true;
    else if (a == "-h" || a == "--help") {
      usage();
      return 0;
    } else {
      std::fprintf(stderr, "bgl-replay: unknown argument '%s'\n", a.c_str());
      usage();
      return 2;
    }
  }
  if (trace_path.empty()) {
    usage();
    return 2;
  }
  Config config;
  config.capacity = std::size_t{1} << 40;  // host: a large simulated device unless configured
  config.pool.log = false;
  std::string error;
  if (!parse_config("backend:" + backend + (conf.empty() ? "" : "," + conf), &config, &error)) {
    std::fprintf(stderr, "bgl-replay: %s\n", error.c_str());
    return 2;
  }
  replay::Trace trace;
  if (!replay::load_trace(trace_path, device, &trace, &error)) {
    std::fprintf(stderr, "bgl-replay: %s\n", error.c_str());
    return 2;  // bad input
  }
  if (trace.ops.empty()) {
    std::fprintf(stderr, "bgl-replay: %s: no allocation events to replay (device %d)\n",
                 trace_path.c_str(), device);
    return 2;
  }
  replay::ReplayResult r;
  if (!replay::run_replay(trace, config, repeat, &r, &error)) {
    std::fprintf(stderr, "bgl-replay: %s\n", error.c_str());
    return 1;
  }
  if (json) {
    nlohmann::json j = {{"trace", trace_path},
                        {"backend", backend},
                        {"conf", conf},
                        {"ops", r.ops},
                        {"skipped", trace.skipped},
                        {"peak_live_bytes", r.peak_live},
                        {"peak_reserved_bytes", r.peak_reserved},
                        {"peak_allocated_bytes", r.peak_allocated},
                        {"reserved_over_live", r.ratio},
                        {"ns_per_op", r.ns_per_op},
                        {"first_ns_per_op", r.first_ns_per_op},
                        {"warm_ns_per_op", r.warm_ns_per_op},
                        {"ooms", r.ooms},
                        {"maps", r.maps},
                        {"unmaps", r.unmaps}};
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("trace          %s (%zu ops, %zu skipped)\n", trace_path.c_str(), r.ops,
                trace.skipped);
    std::printf("backend        %s%s%s\n", backend.c_str(), conf.empty() ? "" : " ", conf.c_str());
    std::printf("peak live      %s\n",
                bgl::FormatBytes(static_cast<double>(r.peak_live), true).c_str());
    std::printf("peak reserved  %s\n",
                bgl::FormatBytes(static_cast<double>(r.peak_reserved), true).c_str());
    std::printf("ratio          %.4f\n", r.ratio);
    std::printf("ns/op          %.1f (first pass %.1f, warm %.1f)\n", r.ns_per_op,
                r.first_ns_per_op, r.warm_ns_per_op);
    std::printf("ooms           %zu\n", r.ooms);
    std::printf("maps/unmaps    %llu/%llu\n", static_cast<unsigned long long>(r.maps),
                static_cast<unsigned long long>(r.unmaps));
  }
  return r.ooms == 0 ? 0 : 3;
}
