// bgl-governor-bench: Plan round trip over the daemon's unix socket against the embedded call
// (same process, same points), then load runs with N concurrent clients for a bounded time.
// Usage: bgl-governor-bench --address unix:///PATH --daemon-pid PID [--iterations N]
//                           [--clients 8,64] [--seconds 30] [--model FILE]
// Prints one markdown table per part. Local socket only; never run by ctest.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "governor/client/embedded_governor.h"
#include "governor/client/remote_governor.h"

namespace {

using Clock = std::chrono::steady_clock;
using bgl::gov::Registration;

double Percentile(std::vector<double>& v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
}

long RssKiB(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::atol(line.c_str() + 6);
  }
  return -1;
}

bgl::plan::SchedulePoint Point(int i, int mbs) {
  bgl::plan::SchedulePoint p;
  p.forward_micro_batch = i % mbs;
  p.load_factor = 1.0 + 0.1 * (i % 7);
  return p;
}

// Times `iterations` plans through `gov` (microseconds each).
std::vector<double> Time(bgl::gov::Governor& gov, const std::string& id, int mbs, int iterations,
                         int* errors) {
  std::vector<double> us;
  us.reserve(static_cast<size_t>(iterations));
  for (int i = 0; i < iterations; ++i) {
    const auto t0 = Clock::now();
    auto plan = gov.Plan(id, Point(i, mbs));
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    if (!plan.ok()) ++*errors;
  }
  return us;
}

}  // namespace

int main(int argc, char** argv) {
  std::string address = bgl::gov::GovernorAddressFromEnv(), model = BGL_MODELS_DIR "/tiny-moe.json";
  int pid = -1, iterations = 20000, seconds = 30;
  std::vector<int> clients = {8, 64};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--address") address = value;
    else if (flag == "--daemon-pid") pid = std::atoi(value.c_str());
    else if (flag == "--iterations") iterations = std::atoi(value.c_str());
    else if (flag == "--seconds") seconds = std::max(1, std::min(120, std::atoi(value.c_str())));
    else if (flag == "--model") model = value;
    else if (flag == "--clients") {
      clients.clear();
      std::stringstream ss(value);
      std::string part;
      while (std::getline(ss, part, ',')) clients.push_back(std::atoi(part.c_str()));
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  if (address.rfind("unix:", 0) != 0) {
    std::fprintf(stderr, "bgl-governor-bench: only local unix sockets\n");
    return 2;
  }
  std::ifstream in(model);
  std::stringstream text;
  text << in.rdbuf();
  Registration reg;
  reg.model_json = text.str();
  reg.capacity_bytes = int64_t{8} << 30;

  bgl::gov::RemoteOptions options;
  options.address = address;
  options.deadline = std::chrono::milliseconds(1000);
  bgl::gov::RemoteGovernor remote(options);
  bgl::gov::EmbeddedGovernor embedded;
  auto r = remote.Register(reg);
  auto e = embedded.Register(reg);
  if (!r.ok() || !e.ok()) {
    std::fprintf(stderr, "register failed: %s\n",
                 (!r.ok() ? r.status() : e.status()).message().c_str());
    return 1;
  }
  const int mbs = r->micro_batches;
  int errors = 0;
  Time(remote, r->session_id, mbs, 1000, &errors);  // warm up both (caches, connection)
  Time(embedded, e->session_id, mbs, 1000, &errors);
  auto remote_us = Time(remote, r->session_id, mbs, iterations, &errors);
  auto embedded_us = Time(embedded, e->session_id, mbs, iterations, &errors);
  std::printf("| path | plans | p50 us | p99 us | max us | errors |\n|---|---|---|---|---|---|\n");
  for (auto [name, v] : {std::pair{"unix socket (RemoteGovernor)", &remote_us},
                         {"embedded (EmbeddedGovernor)", &embedded_us}}) {
    const double max = *std::max_element(v->begin(), v->end());
    const double p50 = Percentile(*v, 0.5), p99 = Percentile(*v, 0.99);
    std::printf("| %s | %d | %.1f | %.1f | %.1f | %d |\n", name, iterations, p50, p99, max,
                errors);
  }

  std::printf("\n| clients | seconds | plans/s | p50 us | p99 us | errors | daemon RSS before KiB | "
              "after KiB |\n|---|---|---|---|---|---|---|---|\n");
  for (int n : clients) {
    const long rss_before = pid > 0 ? RssKiB(pid) : -1;
    std::atomic<long> total_errors{0};
    std::vector<std::vector<double>> lat(static_cast<size_t>(n));
    std::vector<std::thread> threads;
    const auto end = Clock::now() + std::chrono::seconds(seconds);
    for (int c = 0; c < n; ++c) {
      threads.emplace_back([&, c] {
        bgl::gov::RemoteGovernor gov(options);
        auto info = gov.Register(reg);
        if (!info.ok()) {
          total_errors++;
          return;
        }
        for (int i = 0; Clock::now() < end; ++i) {
          const auto t0 = Clock::now();
          auto plan = gov.Plan(info->session_id, Point(i + c, mbs));
          lat[static_cast<size_t>(c)].push_back(
              std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
          if (!plan.ok()) total_errors++;
        }
        (void)gov.Unregister(info->session_id);
      });
    }
    for (auto& t : threads) t.join();
    std::vector<double> all;
    for (auto& v : lat) all.insert(all.end(), v.begin(), v.end());
    const long rss_after = pid > 0 ? RssKiB(pid) : -1;
    const double p50 = Percentile(all, 0.5), p99 = Percentile(all, 0.99);
    std::printf("| %d | %d | %.0f | %.1f | %.1f | %ld | %ld | %ld |\n", n, seconds,
                static_cast<double>(all.size()) / seconds, p50, p99, total_errors.load(),
                rss_before, rss_after);
  }
  return 0;
}
