// A seeded random fuzz harness over the daemon's request handlers (GovernorCore): malformed
// (random bytes), truncated, oversized and out-of-range requests from one caller must get
// INVALID_ARGUMENT or RESOURCE_EXHAUSTED naming the field (or NOT_FOUND/PERMISSION_DENIED for
// sessions), never crash, and never change another caller's session.
#include <gtest/gtest.h>

#include <fstream>
#include <limits>
#include <random>
#include <regex>
#include <sstream>

#include "governor/service/governor_core.h"
#include "tests/unit/governor/tiny_model.h"

namespace bgl::gov {
namespace {

namespace pb = bagualu::v1;

using testing::TinyModel;

pb::RegisterRequest ValidRegister() {
  pb::RegisterRequest r;
  r.set_gpu_uuid("host-0");
  r.set_model_json(TinyModel());
  r.set_capacity_bytes(int64_t{8} << 30);
  return r;
}

class Fuzzer {
 public:
  explicit Fuzzer(uint64_t seed) : rng_(seed) {}
  int Int(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  int64_t Int64() {
    static const int64_t kEdges[] = {0,
                                     -1,
                                     1,
                                     std::numeric_limits<int64_t>::min(),
                                     std::numeric_limits<int64_t>::max(),
                                     int64_t{1} << 50,
                                     (int64_t{1} << 50) + 1,
                                     7,
                                     100};
    return Int(0, 3) == 0 ? static_cast<int64_t>(rng_()) : kEdges[Int(0, 8)];
  }
  int32_t Int32() {
    static const int32_t kEdges[] = {0,
                                     -1,
                                     1,
                                     3,
                                     7,
                                     8,
                                     9,
                                     std::numeric_limits<int32_t>::min(),
                                     std::numeric_limits<int32_t>::max()};
    return Int(0, 3) == 0 ? static_cast<int32_t>(rng_()) : kEdges[Int(0, 8)];
  }
  double Double() {
    static const double kEdges[] = {0,
                                    -1,
                                    1,
                                    1.5,
                                    64,
                                    65,
                                    1e300,
                                    -1e-300,
                                    std::numeric_limits<double>::quiet_NaN(),
                                    std::numeric_limits<double>::infinity()};
    return kEdges[Int(0, 9)];
  }
  std::string Bytes(size_t max) {
    std::string s(static_cast<size_t>(Int(0, static_cast<int>(max))), '\0');
    for (char& c : s) c = static_cast<char>(rng_());
    return s;
  }
  // Mutates the wire encoding: truncation, bit flips, random garbage.
  template <typename Msg>
  void Corrupt(Msg& msg) {
    std::string wire = msg.SerializeAsString();
    switch (Int(0, 2)) {
      case 0:
        wire.resize(wire.empty() ? 0 : static_cast<size_t>(Int(0, static_cast<int>(wire.size()))));
        break;
      case 1:
        for (int i = 0; i < 4 && !wire.empty(); ++i) {
          wire[static_cast<size_t>(Int(0, static_cast<int>(wire.size()) - 1))] ^=
              static_cast<char>(1 << Int(0, 7));
        }
        break;
      default:
        wire = Bytes(64);
    }
    Msg parsed;
    if (parsed.ParseFromString(wire)) msg = parsed;
  }
  std::string ModelJson() {
    std::string m = TinyModel();
    switch (Int(0, 6)) {
      case 0:
        return m.substr(0, static_cast<size_t>(Int(0, static_cast<int>(m.size()))));
      case 1:
        return std::string((size_t{4} << 20) + 1, '{');
      case 2: {
        static const char* kFields[] = {"layers", "hidden",  "pp", "micro_batches", "experts",
                                        "top_k",  "seq_len", "vp", "gpus"};
        const std::string field = kFields[Int(0, 8)];
        const size_t at = m.find("\"" + field + "\"");
        if (at == std::string::npos) return m;
        const size_t colon = m.find(':', at), end = m.find_first_of(",}", colon);
        static const char* kValues[] = {"-1",   "0",           "1e30", "\"x\"",
                                        "null", "99999999999", "4096", "3"};
        return m.substr(0, colon + 1) + kValues[Int(0, 7)] + m.substr(end);
      }
      case 3:
        return "[1, 2]";
      case 4:
        return Bytes(100);
      default:
        return m;
    }
  }

 private:
  std::mt19937_64 rng_;
};

bool NamesField(const grpc::Status& s) {
  static const std::regex kField("^[a-z_][a-z_0-9.]*: .+");
  return std::regex_search(s.error_message(), kField);
}

TEST(GovernorFuzz, HandlersRejectBadInputAndKeepOtherSessions) {
  Metrics metrics;
  GovernorCore core(&metrics);
  Caller victim{1000, 111, false, "victim"};
  Caller attacker{2000, 222, false, "attacker"};
  pb::RegisterResponse vr;
  ASSERT_TRUE(core.Register(victim, ValidRegister(), &vr).ok());
  pb::RegisterResponse ar;
  ASSERT_TRUE(core.Register(attacker, ValidRegister(), &ar).ok());
  pb::PlanRequest warm;
  warm.set_session_id(vr.session_id());
  warm.set_forward_micro_batch(0);
  pb::PlanResponse warm_plan;
  ASSERT_TRUE(core.Plan(victim, warm, &warm_plan).ok());

  Fuzzer f(20240611);
  const int iterations = 1500;
  int rejected = 0;
  for (int i = 0; i < iterations; ++i) {
    grpc::Status s;
    const int method = f.Int(0, 5);
    // Half the calls aim at the attacker's own session, some at the victim's, some at junk.
    const int target = f.Int(0, 9);
    const std::string session = target < 5   ? ar.session_id()
                                : target < 7 ? vr.session_id()
                                : target < 8 ? std::string(300, 's')
                                             : f.Bytes(20);
    if (method == 0) {
      pb::RegisterRequest r = ValidRegister();
      r.set_model_json(f.ModelJson());
      if (f.Int(0, 3) == 0) r.set_gpu_index(f.Int32());
      if (f.Int(0, 3) == 0) r.set_pipeline_rank(f.Int32());
      if (f.Int(0, 3) == 0) r.set_capacity_bytes(f.Int64());
      if (f.Int(0, 5) == 0) r.set_budget_step_bytes(f.Int64());
      if (f.Int(0, 5) == 0) r.set_gpu_uuid(f.Bytes(300));
      if (f.Int(0, 5) == 0) r.mutable_calibration()->set_peak_tflops(f.Double());
      if (f.Int(0, 5) == 0) r.mutable_calibration()->mutable_offload()->set_peak_gbps(f.Double());
      if (f.Int(0, 5) == 0) r.mutable_calibration()->set_gpu_profile(f.Bytes(8));
      if (f.Int(0, 4) == 0) f.Corrupt(r);
      pb::RegisterResponse resp;
      s = core.Register(attacker, r, &resp);
      if (s.ok()) {
        pb::UnregisterRequest u;
        u.set_session_id(resp.session_id());
        pb::UnregisterResponse ur;
        EXPECT_TRUE(core.Unregister(attacker, u, &ur).ok());
      }
    } else if (method <= 2) {
      pb::PlanRequest r;
      r.set_session_id(session);
      if (f.Int(0, 1)) r.set_forward_micro_batch(f.Int32());
      if (f.Int(0, 1)) r.set_backward_micro_batch(f.Int32());
      if (f.Int(0, 2) == 0) r.set_forward_chunk(f.Int32());
      if (f.Int(0, 2) == 0) r.set_phase(static_cast<pb::Phase>(f.Int(-2, 6)));
      if (f.Int(0, 1)) r.set_load_factor(f.Double());
      if (f.Int(0, 2) == 0) r.set_bytes_in_use(f.Int64());
      if (f.Int(0, 3) == 0) {
        pb::GateObservation* g = r.mutable_gate();
        g->set_micro_batch(f.Int32());
        g->set_chunk(f.Int32());
        g->set_gate_layer(f.Int32());
        g->set_observed_load_factor(f.Double());
      }
      if (f.Int(0, 4) == 0) f.Corrupt(r);
      pb::PlanResponse resp;
      s = core.Plan(attacker, r, &resp);
    } else if (method == 3) {
      pb::ReportRequest r;
      r.set_session_id(session);
      r.set_micro_batch(f.Int32());
      r.set_chunk(f.Int(0, 1) ? 0 : f.Int32());
      r.set_actual_bytes(f.Int64());
      if (f.Int(0, 1)) r.mutable_stats()->set_allocated_bytes(f.Int64());
      if (f.Int(0, 2) == 0) r.mutable_stats()->set_fragmentation(f.Double());
      if (f.Int(0, 4) == 0) r.set_allocator_snapshot_json(f.Bytes(50));
      if (f.Int(0, 30) == 0)
        r.set_allocator_snapshot_json(std::string((size_t{16} << 20) + 1, ' '));
      if (f.Int(0, 4) == 0) f.Corrupt(r);
      pb::ReportResponse resp;
      s = core.Report(attacker, r, &resp);
    } else if (method == 4) {
      pb::SnapshotRequest r;
      r.set_session_id(f.Int(0, 1) ? session : "");
      pb::SnapshotResponse resp;
      s = core.Snapshot(attacker, r, &resp);
      for (const auto& snap : resp.snapshots()) EXPECT_NE(snap.session_id(), vr.session_id());
    } else {
      pb::UnregisterRequest r;
      r.set_session_id(session == ar.session_id() ? f.Bytes(10) : session);
      pb::UnregisterResponse resp;
      s = core.Unregister(attacker, r, &resp);
    }
    const auto code = s.error_code();
    EXPECT_TRUE(code == grpc::StatusCode::OK || code == grpc::StatusCode::INVALID_ARGUMENT ||
                code == grpc::StatusCode::RESOURCE_EXHAUSTED ||
                code == grpc::StatusCode::NOT_FOUND || code == grpc::StatusCode::PERMISSION_DENIED)
        << "iteration " << i << ": code " << code << " " << s.error_message();
    if (!s.ok()) {
      EXPECT_TRUE(NamesField(s)) << "iteration " << i << ": " << s.error_message();
      rejected++;
    }
  }
  EXPECT_GT(rejected, iterations / 4);

  // The victim's session is exactly as it was: one plan, and it still plans.
  pb::ListSessionsResponse list;
  ASSERT_TRUE(core.ListSessions(victim, {}, &list).ok());
  ASSERT_EQ(list.sessions_size(), 1);
  pb::WatchResponse sample;
  core.Sample(victim, &sample);
  ASSERT_EQ(sample.gpus_size(), 1);
  EXPECT_EQ(sample.gpus(0).processes(0).plans(), 1u);
  pb::PlanRequest next;
  next.set_session_id(vr.session_id());
  next.set_forward_micro_batch(1);
  pb::PlanResponse plan;
  EXPECT_TRUE(core.Plan(victim, next, &plan).ok());
  EXPECT_NE(metrics.Text().find("bagualu_invalid_requests_total"), std::string::npos);
}

TEST(GovernorCore, SessionLimitsAndMetrics) {
  Metrics metrics;
  RequestLimits limits;
  limits.max_sessions_per_uid = 2;
  GovernorCore core(&metrics, limits);
  Caller c{1000, 5, false, "u"};
  pb::RegisterResponse r;
  ASSERT_TRUE(core.Register(c, ValidRegister(), &r).ok());
  ASSERT_TRUE(core.Register(c, ValidRegister(), &r).ok());
  grpc::Status s = core.Register(c, ValidRegister(), &r);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(NamesField(s)) << s.error_message();
  pb::PlanRequest p;
  p.set_session_id(r.session_id());
  p.set_forward_micro_batch(0);
  pb::PlanResponse plan;
  ASSERT_TRUE(core.Plan(c, p, &plan).ok());
  core.PublishMetrics();
  const std::string text = metrics.Text();
  for (const char* name : {"bagualu_plans_total 1", "bagualu_sessions 2",
                           "bagualu_plan_latency_seconds_bucket", "bagualu_gpu_in_use_bytes{",
                           "bagualu_ooms_avoided_total", "bagualu_plan_cache_hits_total"}) {
    EXPECT_NE(text.find(name), std::string::npos) << name << "\n" << text;
  }
  // Dead processes' sessions are reaped; live ones stay.
  EXPECT_EQ(core.Reap([](int32_t pid) { return pid != 5; }), 2);
  EXPECT_EQ(core.session_count(), 0u);
}

}  // namespace
}  // namespace bgl::gov
