// A seeded, structure-aware fuzz of every RPC against the real daemon (built under ASan in the
// sanitizer suite): valid requests with mutated fields (edge and subnormal numbers, deeply nested
// and huge JSON, long and binary strings, thousands of unknown repeated fields, corrupted wire
// bytes), from several connections at once, for a bounded time (BGL_FUZZ_SECONDS, default 40;
// seed BGL_FUZZ_SEED). Every answer must be OK or a refusal naming the field in at most 1 KiB,
// the daemon must keep serving, and once every session is gone its resident memory must be
// within kRssBoundBytes of what it was after warm-up.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <future>
#include <limits>
#include <mutex>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "governor/client/remote_governor.h"
#include "tests/integration/daemon_process.h"

namespace bgl::gov {
namespace {

namespace pb = bagualu::v1;
using testing::DaemonProcess;

// Resident memory the daemon may keep, after a fuzz run, over its size after warm-up with no
// sessions (see docs/operations.md, "Memory").
// Under ASan the sanitizer's allocator (quarantine, per-size-class caches) keeps more: measured
// +9 MiB with glibc (2 arenas, trimmed), +48 MiB under ASan after a 40 s run.
#if defined(__SANITIZE_ADDRESS__)
constexpr int64_t kRssBoundBytes = int64_t{128} << 20;
#else
constexpr int64_t kRssBoundBytes = int64_t{32} << 20;
#endif

class Mutator {
 public:
  explicit Mutator(uint64_t seed) : rng_(seed) {}
  int Int(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  bool OneIn(int n) { return Int(0, n - 1) == 0; }
  int32_t Int32() {
    static const int32_t kEdges[] = {0,
                                     -1,
                                     1,
                                     2,
                                     3,
                                     7,
                                     8,
                                     64,
                                     std::numeric_limits<int32_t>::min(),
                                     std::numeric_limits<int32_t>::max()};
    return OneIn(4) ? static_cast<int32_t>(rng_()) : kEdges[Int(0, 9)];
  }
  int64_t Int64() {
    static const int64_t kEdges[] = {0,
                                     -1,
                                     1,
                                     4096,
                                     int64_t{8} << 30,
                                     int64_t{1} << 50,
                                     (int64_t{1} << 50) + 1,
                                     std::numeric_limits<int64_t>::min(),
                                     std::numeric_limits<int64_t>::max()};
    return OneIn(4) ? static_cast<int64_t>(rng_()) : kEdges[Int(0, 8)];
  }
  double Double() {
    static const double kEdges[] = {0.0,
                                    -0.0,
                                    1.0,
                                    1.2,
                                    64.0,
                                    65.0,
                                    -1.0,
                                    5e-324,  // the smallest subnormal
                                    2.2e-308,
                                    std::numeric_limits<double>::min() / 3,
                                    1e-300,
                                    1e300,
                                    std::numeric_limits<double>::max(),
                                    std::numeric_limits<double>::quiet_NaN(),
                                    std::numeric_limits<double>::infinity(),
                                    -std::numeric_limits<double>::infinity()};
    return kEdges[Int(0, 15)];
  }
  std::string JsonNumber() {
    static const char* kNumbers[] = {"5e-324",
                                     "2.2250738585072014e-308",
                                     "-0",
                                     "0",
                                     "-1",
                                     "1e30",
                                     "1e308",
                                     "9223372036854775807",
                                     "18446744073709551616",
                                     "0.5",
                                     "\"64MiB\"",
                                     "\"x\"",
                                     "null",
                                     "true",
                                     "[]",
                                     "{}"};
    return kNumbers[Int(0, 15)];
  }
  // ASCII, control characters included (proto3 strings must be UTF-8 to be sent at all).
  std::string Bytes(size_t max) {
    std::string s(static_cast<size_t>(Int(0, static_cast<int>(max))), '\0');
    for (char& c : s) c = static_cast<char>(rng_() & 0x7f);
    return s;
  }
  // Any bytes: for the raw-wire path only.
  std::string RawBytes(size_t max) {
    std::string s(static_cast<size_t>(Int(0, static_cast<int>(max))), '\0');
    for (char& c : s) c = static_cast<char>(rng_());
    return s;
  }
  std::string Nested(int depth) {
    const bool arrays = OneIn(2);
    return std::string(static_cast<size_t>(depth), arrays ? '[' : '{') +
           (arrays ? std::string(static_cast<size_t>(depth), ']')
                   : std::string())  // unbalanced objects: an error either way
        ;
  }
  int Depth() {
    static const int kDepths[] = {63, 64, 65, 1000, 80000};
    return kDepths[Int(0, 4)];
  }
  std::string LayerGraph(int operators) {
    std::string ops, tensors;
    for (int i = 0; i < operators; ++i) {
      if (i > 0) ops += ",";
      ops += "{\"name\":\"op" + std::to_string(i) +
             "\",\"kind\":\"linear\",\"forward_ms\":" + (OneIn(8) ? JsonNumber() : "0.1") +
             ",\"backward_ms\":0.2}";
      tensors += ",{\"name\":\"t" + std::to_string(i) +
                 "\",\"bytes\":" + (OneIn(8) ? JsonNumber() : "1048576") + ",\"producer\":\"op" +
                 std::to_string(i) + "\",\"consumers\":[\"op" + std::to_string(i) + "\"]}";
    }
    return "{\"operators\":[" + ops +
           "],\"tensors\":[{\"name\":\"x\",\"bytes\":1048576,\"block_input\":true,"
           "\"consumers\":[\"op0\"]}" +
           tensors + "]}";
  }
  // The tiny model with one of many structural mutations.
  std::string ModelJson(const std::string& base) {
    static const char* kFields[] = {"layers",
                                    "hidden",
                                    "moe_hidden",
                                    "experts",
                                    "top_k",
                                    "head_dim",
                                    "seq_len",
                                    "pp",
                                    "vp",
                                    "micro_batches",
                                    "gpus",
                                    "workspace",
                                    "micro_batch_size",
                                    "safety_margin",
                                    "name",
                                    "gpu"};
    const std::string body = base.substr(0, base.rfind('}'));
    switch (Int(0, 11)) {
      case 0:
        return base;
      case 1: {  // one field's value replaced
        const std::string field = kFields[Int(0, 15)];
        const size_t at = base.find("\"" + field + "\"");
        if (at == std::string::npos) return base;
        const size_t colon = base.find(':', at), end = base.find_first_of(",}", colon);
        return base.substr(0, colon + 1) + JsonNumber() + base.substr(end);
      }
      case 2:  // a deeply nested value
        return body + ",\"" + (OneIn(2) ? "comment" : "layer_graph") + "\":" + Nested(Depth()) +
               "}";
      case 3:
        return Nested(Depth());
      case 4: {  // an explicit layer graph, small or huge
        static const int kOps[] = {0, 1, 3, 257, 2000};
        return body + ",\"layer_graph\":" + LayerGraph(kOps[Int(0, 4)]) + "}";
      }
      case 5:  // a long unknown key
        return body + ",\"" + std::string(static_cast<size_t>(Int(1, 200000)), 'k') + "\":1}";
      case 6:
        return base.substr(0, static_cast<size_t>(Int(0, static_cast<int>(base.size()))));
      case 7:
        return Bytes(300);
      case 8: {  // a huge array where a string belongs
        std::string arr = "[0";
        for (int i = Int(1, 200000); i > 0; --i) arr += ",0";
        return body + ",\"description\":" + arr + "]}";
      }
      case 9:  // duplicate keys
        return body + ",\"layers\":9,\"layers\":-3}";
      case 10:
        return OneIn(2) ? "" : "[1,2]";
      default:  // a long name (quoted in errors)
        return body + ",\"name\":\"" + std::string(static_cast<size_t>(Int(1, 100000)), 'n') +
               "\"}";
    }
  }
  std::string SnapshotJson() {
    switch (Int(0, 5)) {
      case 0:
        return "{\"segments\":[],\"device_traces\":[[]]}";
      case 1:
        return Nested(Depth());
      case 2: {
        std::string arr = "[";
        for (int i = Int(1, 300000); i > 0; --i) arr += "1.5e-323,";
        return arr + "0]";
      }
      case 3:
        return Bytes(200);
      case 4:
        return std::string(static_cast<size_t>(Int(1, 64)) << 14, ' ');
      default:
        return "";
    }
  }
  // The wire bytes of `msg` with repeated unknown fields appended, bits flipped, a truncation
  // or invalid UTF-8 in a string: sent as they are (GenericStub), parsed by the daemon or not.
  std::string Wire(const google::protobuf::Message& msg) {
    std::string wire = msg.SerializeAsString();
    switch (Int(0, 3)) {
      case 0: {
        const int n = OneIn(4) ? 100000 : Int(1, 1000);
        for (int i = 0; i < n; ++i) {
          wire += std::string("\xb8\x3e", 2) + static_cast<char>(i & 0x7f);  // field 999
        }
        break;
      }
      case 1:
        for (int i = 0; i < 3 && !wire.empty(); ++i) {
          wire[static_cast<size_t>(Int(0, static_cast<int>(wire.size()) - 1))] ^=
              static_cast<char>(1 << Int(0, 7));
        }
        break;
      case 2:
        wire.resize(static_cast<size_t>(Int(0, static_cast<int>(wire.size()))));
        break;
      default: {  // field 1 (a string in every request but ListSessions): not UTF-8
        const std::string bad = "\xff\xfe" + RawBytes(30);
        wire = std::string(1, '\x0a') + static_cast<char>(bad.size()) + bad + wire;
        break;
      }
    }
    return wire;
  }

 private:
  std::mt19937_64 rng_;
};

struct Tally {
  std::mutex mu;
  std::vector<std::string> failures;
  std::atomic<int> calls{0}, ok{0};
  void Fail(const std::string& what) {
    std::lock_guard<std::mutex> lock(mu);
    if (failures.size() < 20) failures.push_back(what);
  }
};

void Check(const char* method, const std::string& mutation, const grpc::Status& s, Tally& t) {
  static const std::regex kField("^[a-z_][a-z_0-9.\\[\\]]*: .+");
  t.calls.fetch_add(1);
  if (s.ok()) {
    t.ok.fetch_add(1);
    return;
  }
  const auto code = s.error_code();
  const bool refusal =
      code == grpc::StatusCode::INVALID_ARGUMENT || code == grpc::StatusCode::RESOURCE_EXHAUSTED ||
      code == grpc::StatusCode::NOT_FOUND || code == grpc::StatusCode::PERMISSION_DENIED ||
      code == grpc::StatusCode::FAILED_PRECONDITION;
  const std::string head = s.error_message().substr(0, 160);
  if (!refusal) {
    t.Fail(std::string(method) + " (" + mutation + "): code " + std::to_string(code) + ": " + head);
  } else if (s.error_message().size() > 1024 || !std::regex_search(head, kField)) {
    t.Fail(std::string(method) + " (" + mutation + "): message of " +
           std::to_string(s.error_message().size()) + " bytes not naming a field: " + head);
  }
}

// Sends `wire` as the request of `method` without parsing it first.
grpc::Status RawCall(grpc::GenericStub& stub, const std::string& method, const std::string& wire) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  grpc::Slice slice(wire);
  grpc::ByteBuffer request(&slice, 1), response;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, "/bagualu.v1.Governor/" + method, grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) { done.set_value(std::move(s)); });
  return done.get_future().get();
}

template <typename Call>
grpc::Status Invoke(Call&& call) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  return call(ctx);
}

void FuzzClient(const std::string& address, uint64_t seed,
                std::chrono::steady_clock::time_point end, Tally& tally) {
  RemoteOptions options;
  options.address = address;
  options.reconnect = false;
  RemoteGovernor gov(options);
  auto& stub = gov.stub();
  grpc::GenericStub raw(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  Mutator m(seed);
  // Sends `req` as is, or one time in `n` its mutated wire bytes; checks the answer.
  auto send = [&](const char* method, const std::string& mutation,
                  const google::protobuf::Message& req, int n, auto&& typed) -> grpc::Status {
    if (!m.OneIn(n)) {
      grpc::Status s = Invoke(typed);
      Check(method, mutation, s, tally);
      return s;
    }
    grpc::Status s = RawCall(raw, method, m.Wire(req));
    // gRPC itself answers requests that do not parse (INTERNAL, before any handler runs; the
    // handlers never answer INTERNAL).
    if (s.error_code() != grpc::StatusCode::INTERNAL) Check(method, mutation + "+wire", s, tally);
    return grpc::Status(grpc::StatusCode::UNKNOWN, "raw");  // no session id to keep
  };
  const std::string base = testing::TinyModelJson();
  std::vector<std::string> sessions;
  auto valid_register = [&] {
    pb::RegisterRequest r;
    r.set_gpu_uuid("host-" + std::to_string(seed % 2));
    r.set_model_json(base);
    r.set_capacity_bytes(int64_t{8} << 30);
    return r;
  };
  auto some_session = [&]() -> std::string {
    if (!sessions.empty() && !m.OneIn(5))
      return sessions[static_cast<size_t>(m.Int(0, static_cast<int>(sessions.size()) - 1))];
    return m.OneIn(2) ? m.Bytes(40) : std::string(static_cast<size_t>(m.Int(0, 400)), 's');
  };
  while (std::chrono::steady_clock::now() < end && tally.failures.empty()) {
    const int method = m.Int(0, 9);
    if (method <= 2) {
      pb::RegisterRequest r = valid_register();
      std::string mutation = "model";
      if (!m.OneIn(4)) r.set_model_json(m.ModelJson(base));
      pb::Calibration* cal = r.mutable_calibration();
      if (m.OneIn(3)) {
        mutation += "+calibration";
        switch (m.Int(0, 5)) {
          case 0:
            cal->set_peak_tflops(m.Double());
            break;
          case 1:
            cal->set_matmul_efficiency(m.Double());
            break;
          case 2:
            cal->set_hbm_gbps(m.Double());
            break;
          case 3:
            cal->mutable_offload()->set_peak_gbps(m.Double());
            break;
          case 4:
            cal->mutable_reload()->set_launch_floor_us(m.Double());
            break;
          default:
            cal->mutable_fp8_cast()->set_peak_gbps(m.Double());
            break;
        }
      }
      if (m.OneIn(6)) cal->set_gpu_profile(m.OneIn(2) ? m.Bytes(80) : "paper");
      if (m.OneIn(6)) r.set_gpu_uuid(m.Bytes(400));
      if (m.OneIn(6)) r.set_job_id(m.Bytes(400));
      if (m.OneIn(6)) r.set_gpu_index(m.Int32());
      if (m.OneIn(6)) r.set_pipeline_rank(m.Int32());
      if (m.OneIn(6)) r.set_capacity_bytes(m.Int64());
      if (m.OneIn(6)) r.set_budget_step_bytes(m.Int64());
      if (m.OneIn(8)) r.set_disable_dual_batch(true);
      pb::RegisterResponse resp;
      grpc::Status s = send("Register", mutation, r, 5,
                            [&](grpc::ClientContext& c) { return stub.Register(&c, r, &resp); });
      if (s.ok()) sessions.push_back(resp.session_id());
    } else if (method <= 4) {
      pb::PlanRequest r;
      r.set_session_id(some_session());
      if (!m.OneIn(4)) r.set_forward_micro_batch(m.OneIn(2) ? m.Int(0, 7) : m.Int32());
      if (m.OneIn(2)) r.set_backward_micro_batch(m.OneIn(2) ? m.Int(0, 7) : m.Int32());
      if (m.OneIn(3)) r.set_forward_chunk(m.Int32());
      if (m.OneIn(3)) r.set_phase(static_cast<pb::Phase>(m.Int(-1, 5)));
      if (m.OneIn(2)) r.set_load_factor(m.Double());
      if (m.OneIn(3)) r.set_bytes_in_use(m.Int64());
      if (m.OneIn(4)) {
        pb::GateObservation* g = r.mutable_gate();
        g->set_micro_batch(m.OneIn(2) ? m.Int(0, 7) : m.Int32());
        g->set_chunk(m.Int32());
        g->set_gate_layer(m.Int32());
        g->set_observed_load_factor(m.Double());
      }
      pb::PlanResponse resp;
      send("Plan", "fields", r, 6, [&](grpc::ClientContext& c) { return stub.Plan(&c, r, &resp); });
    } else if (method == 5) {
      pb::ReportRequest r;
      r.set_session_id(some_session());
      r.set_micro_batch(m.OneIn(2) ? m.Int(0, 7) : m.Int32());
      r.set_chunk(m.OneIn(2) ? 0 : m.Int32());
      r.set_actual_bytes(m.Int64());
      if (m.OneIn(2)) {
        pb::AllocatorStats* st = r.mutable_stats();
        st->set_allocated_bytes(m.Int64());
        st->set_peak_allocated_bytes(m.Int64());
        st->set_ooms_avoided(m.Int64());
        st->set_fragmentation(m.Double());
      }
      if (m.OneIn(3)) r.set_allocator_snapshot_json(m.SnapshotJson());
      pb::ReportResponse resp;
      send("Report", "fields", r, 6,
           [&](grpc::ClientContext& c) { return stub.Report(&c, r, &resp); });
    } else if (method == 6) {
      pb::UnregisterRequest r;
      const bool own = !sessions.empty() && m.OneIn(2);
      r.set_session_id(own ? sessions.back() : some_session());
      pb::UnregisterResponse resp;
      grpc::Status s =
          Invoke([&](grpc::ClientContext& c) { return stub.Unregister(&c, r, &resp); });
      Check("Unregister", "id", s, tally);
      if (own && s.ok()) sessions.pop_back();
    } else if (method == 7) {
      pb::ListSessionsRequest r;
      pb::ListSessionsResponse resp;
      send("ListSessions", "empty", r, 3,
           [&](grpc::ClientContext& c) { return stub.ListSessions(&c, r, &resp); });
    } else if (method == 8) {
      pb::SnapshotRequest r;
      if (m.OneIn(2)) r.set_session_id(some_session());
      pb::SnapshotResponse resp;
      send("Snapshot", "id", r, 6,
           [&](grpc::ClientContext& c) { return stub.Snapshot(&c, r, &resp); });
    } else {
      pb::WatchRequest r;
      r.set_interval_ms(m.OneIn(3) ? m.Int32() : 10);
      r.set_max_samples(m.OneIn(3) ? m.Int32() : m.Int(0, 3));
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
      auto reader = stub.Watch(&ctx, r);
      pb::WatchResponse sample;
      for (int i = 0; i < 3 && reader->Read(&sample); ++i) {
      }
      ctx.TryCancel();
      grpc::Status s = reader->Finish();
      if (s.error_code() != grpc::StatusCode::CANCELLED) Check("Watch", "fields", s, tally);
    }
  }
  for (const std::string& id : sessions) {
    pb::UnregisterRequest r;
    r.set_session_id(id);
    pb::UnregisterResponse resp;
    Check("Unregister", "cleanup",
          Invoke([&](grpc::ClientContext& c) { return stub.Unregister(&c, r, &resp); }), tally);
  }
}

// One valid round of every RPC, so one-time allocations happen before the baseline.
void WarmUp(RemoteGovernor& gov) {
  Registration reg;
  reg.gpu_uuid = "host-0";
  reg.model_json = testing::TinyModelJson();
  reg.capacity_bytes = int64_t{8} << 30;
  for (int round = 0; round < 3; ++round) {
    auto info = gov.Register(reg);
    ASSERT_TRUE(info.ok()) << info.status().message();
    for (int mb = 0; mb < 8; ++mb) {
      plan::SchedulePoint p;
      p.forward_micro_batch = mb;
      p.load_factor = 1.0 + 0.1 * mb;
      ASSERT_TRUE(gov.Plan(info->session_id, p).ok());
    }
    ASSERT_TRUE(gov.ListSessions().ok());
    ASSERT_TRUE(gov.Unregister(info->session_id).ok());
  }
}

// The daemon's last "heap: ..." debug line (glibc builds), or "".
std::string LastHeapLine(const DaemonProcess& daemon) {
  const std::string log = testing::ReadFile(daemon.dir() + "/daemon.log");
  const size_t at = log.rfind("heap: ");
  return at == std::string::npos ? "" : log.substr(at, log.find('\n', at) - at);
}

// How many "heap: ..." lines the daemon has logged: one after each housekeeping trim.
int HeapLines(const DaemonProcess& daemon) {
  const std::string log = testing::ReadFile(daemon.dir() + "/daemon.log");
  int n = 0;
  for (size_t at = log.find("heap: "); at != std::string::npos; at = log.find("heap: ", at + 1)) {
    ++n;
  }
  return n;
}

// Waits until the daemon has run a whole trim that began after this call: two more heap lines
// (the first may end a trim already under way). By evidence, not by the clock; false if the
// daemon stopped logging them (the bound only keeps a broken daemon from hanging the test).
bool WaitForTrim(const DaemonProcess& daemon) {
  const int before = HeapLines(daemon);
  for (int i = 0; i < 6000; ++i) {
    if (HeapLines(daemon) >= before + 2) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

TEST(GovernorDaemonFuzz, EveryRpcRefusesBadInputAndMemoryReturns) {
  const char* seconds_env = std::getenv("BGL_FUZZ_SECONDS");
  const char* seed_env = std::getenv("BGL_FUZZ_SEED");
  const int seconds = seconds_env != nullptr ? std::atoi(seconds_env) : 40;
  const uint64_t seed = seed_env != nullptr ? std::strtoull(seed_env, nullptr, 10) : 20261130;
  std::printf("fuzz: %d s, seed %llu (BGL_FUZZ_SECONDS, BGL_FUZZ_SEED)\n", seconds,
              static_cast<unsigned long long>(seed));
  // Under ASan, a smaller quarantine and prompt release to the OS, so resident memory measures
  // the daemon rather than the sanitizer's delayed reuse.
  const char* asan = std::getenv("ASAN_OPTIONS");
  const std::string saved = asan != nullptr ? asan : "";
  setenv("ASAN_OPTIONS",
         (saved + (saved.empty() ? "" : ":") +
          "quarantine_size_mb=16:allocator_release_to_os_interval_ms=100:detect_leaks=1")
             .c_str(),
         1);
  DaemonProcess daemon(
      {"--max-sessions-per-uid", "4096", "--plan-timeout-ms", "5000", "--log-level", "debug"});
  const bool started = daemon.Start();
  if (asan != nullptr) {
    setenv("ASAN_OPTIONS", saved.c_str(), 1);
  } else {
    unsetenv("ASAN_OPTIONS");
  }
  ASSERT_TRUE(started) << testing::ReadFile(daemon.dir() + "/daemon.log");
  RemoteOptions options;
  options.address = daemon.address();
  options.reconnect = false;
  options.deadline = std::chrono::milliseconds(30000);
  RemoteGovernor gov(options);
  WarmUp(gov);
  // A housekeeping trim after the warm-up, so the start figure is the trimmed one.
  ASSERT_TRUE(WaitForTrim(daemon)) << "no heap line: the daemon does not trim\n"
                                   << testing::ReadFile(daemon.dir() + "/daemon.log");
  const int64_t rss_start = daemon.RssBytes();
  const std::string heap_start = LastHeapLine(daemon);

  Tally tally;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  std::vector<std::thread> clients;
  for (int c = 0; c < 3; ++c) {
    clients.emplace_back(FuzzClient, daemon.address(), seed + static_cast<uint64_t>(c), end,
                         std::ref(tally));
  }
  int64_t rss_peak = rss_start;
  while (std::chrono::steady_clock::now() < end && tally.failures.empty()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    rss_peak = std::max(rss_peak, daemon.RssBytes());
  }
  for (auto& t : clients) t.join();
  for (const std::string& f : tally.failures) ADD_FAILURE() << f;
  ASSERT_TRUE(gov.Health().ok()) << "the daemon stopped serving\n"
                                 << testing::ReadFile(daemon.dir() + "/daemon.log");
  // Sessions registered through the raw path are not tracked by the clients: end them here
  // (every client is this process, so it owns them all).
  auto left = gov.ListSessions();
  ASSERT_TRUE(left.ok());
  for (const auto& session : left->sessions()) {
    pb::UnregisterRequest r;
    r.set_session_id(session.session_id());
    pb::UnregisterResponse resp;
    grpc::Status s =
        Invoke([&](grpc::ClientContext& c) { return gov.stub().Unregister(&c, r, &resp); });
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  left = gov.ListSessions();
  ASSERT_TRUE(left.ok());
  EXPECT_EQ(left->sessions_size(), 0);
  // The housekeeper returns free memory to the OS every few seconds: wait for a trim that
  // began after the sessions ended.
  ASSERT_TRUE(WaitForTrim(daemon)) << "no heap line after the run\n"
                                   << testing::ReadFile(daemon.dir() + "/daemon.log");
  const int64_t rss_end = daemon.RssBytes();
  std::printf(
      "fuzz: %d calls (%d OK); daemon RSS %.1f MiB after warm-up, peak %.1f MiB, "
      "%.1f MiB after the run with no sessions (bound +%lld MiB)\n",
      tally.calls.load(), tally.ok.load(), rss_start / 1048576.0, rss_peak / 1048576.0,
      rss_end / 1048576.0, static_cast<long long>(kRssBoundBytes >> 20));
  EXPECT_LE(rss_end, rss_start + kRssBoundBytes);
  // The daemon's own count of heap bytes in use (glibc builds), for telling a leak from memory
  // the allocator keeps.
  if (!heap_start.empty() && heap_start.rfind("heap: 0 ", 0) != 0) {  // ASan: no glibc heap
    std::printf("fuzz: daemon after warm-up: %s; after the run: %s\n", heap_start.c_str(),
                LastHeapLine(daemon).c_str());
  }
  EXPECT_GT(tally.calls.load(), 50);
  const int status = daemon.StopWithin(30000);
  EXPECT_EQ(status, 0) << testing::ReadFile(daemon.dir() + "/daemon.log");
  // LeakSanitizer reports in the log when the daemon is built with ASan.
  const std::string log = testing::ReadFile(daemon.dir() + "/daemon.log");
  EXPECT_EQ(log.find("ERROR: LeakSanitizer"), std::string::npos) << log.substr(0, 4000);
  EXPECT_EQ(log.find("ERROR: AddressSanitizer"), std::string::npos) << log.substr(0, 4000);
}

}  // namespace
}  // namespace bgl::gov
