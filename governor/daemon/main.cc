// bgl-governord: the node-local governor daemon. Hosts one planner per training process, serves
// the bagualu.v1.Governor service on a unix socket (peer credentials via SO_PEERCRED) and
// optionally TCP, grpc.health.v1 and reflection, and Prometheus metrics. SIGHUP reloads the
// configuration; SIGTERM/SIGINT drain within drain_timeout_ms.
#include <grp.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <malloc.h>
#include <prometheus/exposer.h>
#include <signal.h>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>

#include "base/units.h"
#include "governor/daemon/config.h"
#include "governor/daemon/log.h"
#include "governor/daemon/systemd_notify.h"
#include "governor/service/governor_core.h"
#include "governor/service/grpc_service.h"
#include "governor/service/metrics.h"
#include "governor/service/unix_listener.h"

namespace bgl::gov {
namespace {

constexpr const char* kServiceName = "bagualu.v1.Governor";

const char* kUsage =
    "usage: bgl-governord [--listen unix:///PATH] [--config FILE] [--metrics-port N]\n"
    "                     [--tcp-listen HOST:PORT] [--socket-group G] [--admin-group G]\n"
    "                     [--KEY VALUE ...]\n"
    "Configuration: YAML file, then BGL_GOVERNOR_<KEY> environment variables, then flags.\n"
    "Keys: listen tcp_listen socket_mode socket_group admin_group metrics_address metrics_port\n"
    "      max_sessions max_sessions_per_uid max_model_json_bytes max_snapshot_json_bytes\n"
    "      max_json_depth max_operators_per_layer max_layers_per_chunk plan_timeout_ms\n"
    "      max_watch_streams max_watch_streams_per_uid reap_interval_ms drain_timeout_ms\n"
    "      log_level host_budget_bytes host_budget_fraction host_floor_bytes\n"
    "      node_max_sessions node_gpus links (e.g. --links '0,1,2,3;4,5,6,7')\n"
    "      calibration (a calibration file: the machine's measured rooflines)\n";

struct Flags {
  std::string config_file;
  ConfigOverrides overrides;
};

// "--metrics-port 5" and "--metrics-port=5"; dashes and underscores are interchangeable.
Result<Flags> ParseFlags(int argc, char** argv) {
  Flags flags;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") return Status(StatusCode::kNotFound, "help");
    if (arg.rfind("--", 0) != 0) return InvalidArgument("unexpected argument '" + arg + "'");
    std::string key = arg.substr(2), value;
    const size_t eq = key.find('=');
    if (eq != std::string::npos) {
      value = key.substr(eq + 1);
      key = key.substr(0, eq);
    }
    const std::string typed = "--" + key;  // as the user spelled it, for messages
    std::replace(key.begin(), key.end(), '-', '_');
    const bool known = key == "config" || std::find(ConfigKeys().begin(), ConfigKeys().end(),
                                                    key) != ConfigKeys().end();
    if (!known) return InvalidArgument("unknown flag '" + typed + "'");
    if (eq == std::string::npos) {
      if (i + 1 >= argc) return InvalidArgument(typed + ": missing value");
      value = argv[++i];
    }
    if (key == "config") {
      flags.config_file = value;
    } else {
      flags.overrides[key] = value;
    }
  }
  return flags;
}

int64_t GroupId(const std::string& name) {
  if (name.empty()) return -1;
  struct group gr {};
  struct group* found = nullptr;
  std::vector<char> buf(16384);
  if (getgrnam_r(name.c_str(), &gr, buf.data(), buf.size(), &found) != 0 || found == nullptr) {
    return -2;
  }
  return gr.gr_gid;
}

bool ProcessAlive(int32_t pid) { return kill(pid, 0) == 0 || errno == EPERM; }

// How often free heap memory is handed back to the kernel (see ReturnFreeMemory).
constexpr std::chrono::seconds kTrimInterval{5};

// glibc keeps what a request freed in the arena of the thread that served it (one arena per
// gRPC thread, up to 8 per core) instead of returning it: after a fuzz run of large requests
// (4 MiB model JSON parsed into trees, 16 MiB snapshots) the daemon kept 60-80 MiB of free,
// fragmented heap in 14 arenas with no session left, while the bytes in use were back at their
// start (retention, not a leak: LeakSanitizer finds none). So the daemon uses at most
// kMallocArenas arenas (set before any thread starts) and malloc_trim returns free pages of
// each every kTrimInterval; the walk holds one arena's lock at a time (a few ms at most) and
// never a lock of the daemon's. At debug level it logs the heap figures.
constexpr int kMallocArenas = 2;

void LimitMallocArenas() {
#if defined(__GLIBC__)
  mallopt(M_ARENA_MAX, kMallocArenas);
#endif
}

void ReturnFreeMemory() {
#if defined(__GLIBC__)
  malloc_trim(0);
  const struct mallinfo2 mi = mallinfo2();
  Log(LogLevel::kDebug, "heap: " + FormatBytes(static_cast<double>(mi.uordblks + mi.hblkhd)) +
                            " in use, " + FormatBytes(static_cast<double>(mi.fordblks)) +
                            " free in the arenas");
#endif
}

// Background work: reaping dead sessions, publishing gauges, pinging the watchdog, returning
// free memory to the kernel.
class Housekeeper {
 public:
  Housekeeper(GovernorCore* core, std::atomic<int>* reap_interval_ms)
      : core_(core), reap_interval_ms_(reap_interval_ms) {
    thread_ = std::thread([this] { Loop(); });
  }
  ~Housekeeper() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  void Loop() {
    using Clock = std::chrono::steady_clock;
    const auto watchdog = WatchdogPingInterval();
    auto next_reap = Clock::now(), next_publish = Clock::now(), next_ping = Clock::now();
    auto next_trim = Clock::now() + kTrimInterval;
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      lock.unlock();
      const auto now = Clock::now();
      if (now >= next_reap) {
        if (int n = core_->Reap(ProcessAlive); n > 0) {
          Log(LogLevel::kInfo, "reaped " + std::to_string(n) + " session(s) of exited processes");
        }
        next_reap = now + std::chrono::milliseconds(reap_interval_ms_->load());
      }
      if (now >= next_publish) {
        core_->PublishMetrics();
        NotifySystemd("STATUS=serving " + std::to_string(core_->session_count()) + " sessions");
        next_publish = now + std::chrono::seconds(1);
      }
      if (watchdog.count() > 0 && now >= next_ping) {
        NotifySystemd("WATCHDOG=1");
        next_ping = now + watchdog;
      }
      if (now >= next_trim) {
        ReturnFreeMemory();
        next_trim = Clock::now() + kTrimInterval;
      }
      lock.lock();
      cv_.wait_for(lock, std::chrono::milliseconds(10), [&] { return stop_; });
    }
  }

  GovernorCore* core_;
  std::atomic<int>* reap_interval_ms_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

int Run(int argc, char** argv) {
  auto flags = ParseFlags(argc, argv);
  if (!flags.ok()) {
    if (flags.status().code() == StatusCode::kNotFound) {
      std::fputs(kUsage, stdout);
      return 0;
    }
    std::fprintf(stderr, "bgl-governord: %s\n%s", flags.status().message().c_str(), kUsage);
    return 2;
  }
  LimitMallocArenas();
  auto config = LoadDaemonConfig(flags->config_file, flags->overrides);
  if (!config.ok()) {
    std::fprintf(stderr, "bgl-governord: %s\n", config.status().message().c_str());
    return 2;
  }
  SetLogLevel(config->log_level);
  const int64_t admin_gid = GroupId(config->admin_group);
  if (admin_gid == -2) {
    std::fprintf(stderr, "bgl-governord: admin_group: no such group '%s'\n",
                 config->admin_group.c_str());
    return 2;
  }
  // Signals go to the main thread's sigwait only: block them before any thread starts.
  sigset_t signals;
  sigemptyset(&signals);
  for (int s : {SIGTERM, SIGINT, SIGHUP}) sigaddset(&signals, s);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  auto node = NodeArbiter::Create(NodeConfigOf(*config));
  if (!node.ok()) {
    std::fprintf(stderr, "bgl-governord: %s\n", node.status().message().c_str());
    return 2;
  }
  std::optional<nlohmann::json> calibration;
  if (!config->calibration.empty()) {
    // Checked now, on the profile it names (else h200), so that a bad file stops the daemon
    // instead of every registration.
    auto doc = plan::ReadCalibrationFile(config->calibration);
    if (!doc.ok()) {
      std::fprintf(stderr, "bgl-governord: %s\n", doc.status().message().c_str());
      return 2;
    }
    calibration = std::move(doc).value();
  }
  Metrics metrics;
  GovernorCore core(&metrics, config->limits, std::move(node).value());
  core.SetCalibration(calibration);
  PeerRegistry peers;
  GovernorService service(&core, &peers);
  service.SetAdminGroup(admin_gid);
  service.SetWatchLimits({config->max_watch_streams, config->max_watch_streams_per_uid});

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(32 << 20);
  builder.SetMaxSendMessageSize(32 << 20);
  int tcp_port = 0;
  if (!config->tcp_listen.empty()) {
    builder.AddListeningPort(config->tcp_listen, grpc::InsecureServerCredentials(), &tcp_port);
  }
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || (!config->tcp_listen.empty() && tcp_port == 0)) {
    std::fprintf(stderr, "bgl-governord: tcp_listen: cannot listen on '%s'\n",
                 config->tcp_listen.c_str());
    return 1;
  }
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  const std::string path = UnixSocketPath(config->listen);
  auto listener = UnixListener::Bind(path, config->socket_mode, config->socket_group);
  if (!listener.ok()) {
    std::fprintf(stderr, "bgl-governord: %s\n", listener.status().message().c_str());
    return 1;
  }
  (*listener)->Start(server.get(), &peers);

  std::unique_ptr<prometheus::Exposer> exposer;
  if (config->metrics_port > 0) {
    const std::string bind = config->metrics_address + ":" + std::to_string(config->metrics_port);
    try {
      exposer = std::make_unique<prometheus::Exposer>(bind);
      exposer->RegisterCollectable(metrics.registry());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bgl-governord: metrics_port: cannot listen on %s: %s\n", bind.c_str(),
                   e.what());
      return 1;
    }
  }
  std::atomic<int> reap_interval_ms{config->reap_interval_ms};
  auto housekeeper = std::make_unique<Housekeeper>(&core, &reap_interval_ms);
  health->SetServingStatus(kServiceName, true);
  health->SetServingStatus(true);
  Log(LogLevel::kInfo,
      "serving on " + config->listen +
          (tcp_port ? " and tcp port " + std::to_string(tcp_port) : "") +
          (exposer ? "; metrics on port " + std::to_string(config->metrics_port) : ""));
  Log(LogLevel::kInfo, "node: host budget " + FormatBytes(config->host_budget_bytes, true) +
                           ", floor " + FormatBytes(config->host_floor_bytes) + " per session (" +
                           std::to_string(config->node_max_sessions) + " sessions), " +
                           std::to_string(config->links.size()) + " shared link(s) from " +
                           config->links_source);
  NotifySystemd("READY=1\nSTATUS=serving");

  for (;;) {
    int sig = 0;
    if (sigwait(&signals, &sig) != 0) continue;
    if (sig != SIGHUP) break;
    NotifySystemd("RELOADING=1");
    auto fresh = LoadDaemonConfig(flags->config_file, flags->overrides);
    if (!fresh.ok()) {
      Log(LogLevel::kError,
          "reload failed, keeping the old configuration: " + fresh.status().message());
    } else {
      const int64_t gid = GroupId(fresh->admin_group);
      if (gid == -2) {
        Log(LogLevel::kError,
            "reload failed: admin_group: no such group '" + fresh->admin_group + "'");
      } else {
        core.SetLimits(fresh->limits);
        service.SetWatchLimits({fresh->max_watch_streams, fresh->max_watch_streams_per_uid});
        service.SetAdminGroup(gid);
        reap_interval_ms.store(fresh->reap_interval_ms);
        SetLogLevel(fresh->log_level);
        if (fresh->listen != config->listen || fresh->tcp_listen != config->tcp_listen ||
            fresh->metrics_port != config->metrics_port) {
          Log(LogLevel::kWarning, "listen, tcp_listen and metrics_port change only on restart");
        }
        if (fresh->host_budget_bytes != config->host_budget_bytes ||
            fresh->host_floor_bytes != config->host_floor_bytes ||
            fresh->node_max_sessions != config->node_max_sessions ||
            fresh->links.size() != config->links.size()) {
          Log(LogLevel::kWarning,
              "host_budget_bytes, host_floor_bytes, node_max_sessions and links change only on "
              "restart (grants in force are kept)");
        }
        config = std::move(fresh);
        Log(LogLevel::kInfo, "configuration reloaded (max_sessions_per_uid " +
                                 std::to_string(config->limits.max_sessions_per_uid) + ")");
      }
    }
    NotifySystemd("READY=1");
  }

  Log(LogLevel::kInfo, "draining (deadline " + std::to_string(config->drain_timeout_ms) + " ms)");
  NotifySystemd("STOPPING=1");
  health->SetServingStatus(kServiceName, false);
  health->SetServingStatus(false);
  (*listener)->Stop();
  service.BeginShutdown();
  // Plans in progress end at their next deadline check instead of holding the drain.
  core.CancelPlans();
  // gRPC's Shutdown waits until every connection has closed, so one idle client would hold the
  // drain to its deadline. In-flight unary calls take milliseconds: after a short grace the
  // remaining connections are shut down from our side.
  std::thread disconnect([&peers, grace = std::min(config->drain_timeout_ms, 200)] {
    std::this_thread::sleep_for(std::chrono::milliseconds(grace));
    peers.DisconnectAll();
  });
  server->Shutdown(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(config->drain_timeout_ms));
  disconnect.join();
  housekeeper.reset();
  Log(LogLevel::kInfo, "stopped");
#if defined(__SANITIZE_ADDRESS__)
  // The end-of-process leak check could be cut short by the exit below: run it now (it ends the
  // process with a report when something leaked).
  __lsan_do_leak_check();
#endif
  // gRPC's own teardown (~Server) can wait up to 10 s for a backup poller that a write blocked
  // on a client that stopped reading (a Watch stream) started. Nothing is left to save, so it
  // gets 2 s; past that the process ends at once.
  std::thread([] {
    std::this_thread::sleep_for(std::chrono::seconds(2));
    std::fflush(nullptr);
    _exit(0);
  }).detach();
  return 0;
}

}  // namespace
}  // namespace bgl::gov

int main(int argc, char** argv) { return bgl::gov::Run(argc, argv); }
