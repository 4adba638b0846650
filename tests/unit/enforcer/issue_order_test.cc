// The plan's dual-batch issue order carried out on the host backend (real host streams): a real
// plan of the planner for a steady point F_x B_y is handed to the enforcer's stream scheduler
// with x-1's tensors to offload and y+1's offloaded tensors to reload. The order in which the
// D2H and H2D pieces reach their streams is recorded and must equal the plan's order, each piece
// issued only once compute reached its round; and no consumer reads a reloaded tensor before its
// copy completed (the H2D stream is slowed down to make an early read visible).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "allocator/host_backend.h"
#include "allocator/host_stream.h"
#include "enforcer/detail/forwarding_ops.h"
#include "enforcer/enforcer.h"
#include "governor/planner/planner.h"

namespace bgl::enf::testing {
namespace {

using alloc::HostBackend;
using alloc::HostBackendOptions;
using alloc::HostStream;
using alloc::PoolOptions;
using plan::Chain;
using plan::IssueItem;
using plan::Resource;

// One entry of the recorded order: a copy queued on a copy stream, or compute reaching a stage.
struct Entry {
  enum Kind { kD2H, kH2D, kCompute, kFinish } kind;
  const void* src = nullptr;
  Chain chain = Chain::kForward;
  int stage = -1;
};

// DeviceOps over host streams that records every copy queued on the two copy streams, and
// delays each reload copy so that a consumer that did not wait for it would read stale bytes.
class RecordingOps final : public detail::ForwardingOps {
 public:
  RecordingOps(std::unique_ptr<DeviceOps> inner, Stream d2h, Stream h2d, std::vector<Entry>* log,
               std::mutex* mu)
      : ForwardingOps(std::move(inner)), d2h_(d2h), h2d_(h2d), log_(log), mu_(mu) {}
  Status copy(void* dst, const void* src, std::size_t n, Stream s) override {
    if (s == d2h_ || s == h2d_) {
      std::lock_guard<std::mutex> lock(*mu_);
      log_->push_back({s == d2h_ ? Entry::kD2H : Entry::kH2D, src});
    }
    if (s == h2d_) {
      static_cast<HostStream*>(s)->enqueue(
          [] { std::this_thread::sleep_for(std::chrono::milliseconds(2)); });
    }
    return upstream().copy(dst, src, n, s);
  }

 private:
  Stream d2h_, h2d_;
  std::vector<Entry>* log_;
  std::mutex* mu_;
};

// A planner on the tiny MoE model at a capacity that makes it offload (offload only).
std::unique_ptr<plan::StagePlanner> OffloadingPlanner() {
  auto config = plan::LoadModelConfig(std::string(BGL_MODELS_DIR) + "/tiny-moe.json");
  EXPECT_TRUE(config.ok());
  const auto hw = plan::HardwareProfileByName(config->gpu);
  plan::PlannerOptions options;
  options.mitigation.allow_recompute = false;
  options.mitigation.allow_fp8 = false;
  options.budget_step_bytes = 1 << 20;
  options.offload_chunk_bytes = 1 << 20;  // several O pieces
  // The activation capacity is capacity * (1 - margin) - static bytes: two probes give both.
  // 1.6 times one micro-batch's keep-all bytes is far below what 1F1B keeps in flight: the
  // plans offload.
  auto probe = [&](int64_t capacity) {
    options.capacity_bytes = capacity;
    auto p = plan::StagePlanner::Create(*config, *hw, options);
    EXPECT_TRUE(p.ok());
    return std::make_pair((*p)->activation_capacity(), (*p)->graph().KeepAllBytes(1.0));
  };
  const auto [m1, keep_all] = probe(int64_t{1} << 40);
  const double m2 = probe(int64_t{1} << 41).first;
  const double share = (m2 - m1) / static_cast<double>(int64_t{1} << 40);  // 1 - margin
  const double fixed = static_cast<double>(int64_t{1} << 40) * share - m1;
  options.capacity_bytes = static_cast<int64_t>((keep_all * 1.6 + fixed) / share);
  auto p = plan::StagePlanner::Create(*config, *hw, options);
  EXPECT_TRUE(p.ok()) << p.status().message();
  return p.ok() ? std::move(*p) : nullptr;
}

TEST(IssueOrder, HostStreamsFollowThePlansOrderAndConsumersWaitForReloads) {
  auto planner = OffloadingPlanner();
  ASSERT_NE(planner, nullptr);
  const plan::StageGraph& g = planner->graph();
  const auto& eval = planner->evaluator();

  // Plan the iteration point by point (the pairing of iteration.cc), keeping each forward's
  // assignment, until a steady point whose order offloads x-1 and reloads y+1.
  const auto& steps = planner->steps();
  std::map<int, plan::Assignment> assignment;  // micro-batch -> its forward's strategies
  plan::Plan chosen;
  int x = -1, y = -1;
  for (size_t i = 0; i < steps.size() && x < 0;) {
    plan::SchedulePoint point;
    const plan::Step& s = steps[i];
    if (s.forward) {
      point.forward_micro_batch = s.micro_batch;
      const bool pair =
          i + 1 < steps.size() && !steps[i + 1].forward && s.phase == plan::Phase::kSteady;
      if (pair) point.backward_micro_batch = steps[i + 1].micro_batch;
      i += pair ? 2 : 1;
    } else {
      point.backward_micro_batch = s.micro_batch;
      i += 1;
    }
    auto p = planner->PlanPoint(point);
    ASSERT_TRUE(p.ok()) << p.status().message();
    if (p->micro_batch >= 0) assignment[p->micro_batch] = p->strategies;
    bool has_o = false, has_r = false;
    for (const IssueItem& it : p->issue_order) {
      has_o |= it.chain == Chain::kOffload;
      has_r |= it.chain == Chain::kRecover && it.resource == Resource::kH2D;
    }
    if (has_o && has_r && point.backward_micro_batch >= 0) {
      chosen = *p;
      x = point.forward_micro_batch;
      y = point.backward_micro_batch;
    }
  }
  ASSERT_GE(x, 1) << "no steady point of the plan offloads and reloads";
  ASSERT_TRUE(assignment.count(x - 1) && assignment.count(y + 1));

  // The enforcer over a recording host backend.
  HostStream d2h, h2d, compute;
  std::vector<Entry> log;
  std::mutex mu;
  HostBackendOptions bo;
  bo.capacity = std::size_t{256} << 20;
  PoolOptions po;
  po.log = false;
  Pool pool(std::make_unique<HostBackend>(bo), po);
  EnforcerOptions eo;
  eo.pinned_capacity = std::size_t{128} << 20;
  eo.max_inflight = 2;
  eo.d2h = &d2h;
  eo.h2d = &h2d;
  eo.pressure_eviction = false;
  std::string error;
  auto enf = Enforcer::create(
      &pool, std::make_unique<RecordingOps>(make_host_device_ops(), &d2h, &h2d, &log, &mu), eo,
      &error);
  ASSERT_NE(enf, nullptr) << error;

  // x-1's tensors that its plan offloads (planned, still on the device) and y+1's (offloaded
  // during its forward, now on the host), with recognisable bytes.
  struct Tensor {
    std::uint64_t handle;
    int graph;
    std::vector<std::uint8_t> data;
  };
  std::vector<Tensor> offload, reload;
  std::map<const void*, int> d2h_src;  // device pointer -> graph tensor (x-1)
  auto make = [&](int t, int mb) {
    Tensor tensor{0, t, std::vector<std::uint8_t>(4096 + 64 * t)};
    for (size_t b = 0; b < tensor.data.size(); ++b) {
      tensor.data[b] = static_cast<std::uint8_t>(b * 7 + t + mb);
    }
    void* p = pool.allocate(tensor.data.size(), &compute);
    EXPECT_NE(p, nullptr);
    std::memcpy(p, tensor.data.data(), tensor.data.size());
    TensorDesc d;
    d.ptr = p;
    d.bytes = tensor.data.size();
    d.producer_op = g.tensors[t].producer;
    d.graph_tensor = t;
    d.micro_batch = mb;
    d.stream = &compute;
    d.owned = true;
    EXPECT_EQ(enf->register_tensor(d, &tensor.handle), Status::kOk);
    if (mb == x - 1) d2h_src[p] = t;
    return tensor;
  };
  for (int t = 0; t < static_cast<int>(g.tensors.size()); ++t) {
    if (eval.TensorPlacement(assignment[x - 1], t) == plan::Placement::kHost) {
      offload.push_back(make(t, x - 1));
      ASSERT_EQ(enf->set_strategy(offload.back().handle, plan::Strategy::kOffload), Status::kOk);
    }
    if (eval.TensorPlacement(assignment[y + 1], t) == plan::Placement::kHost) {
      reload.push_back(make(t, y + 1));
      ASSERT_EQ(enf->apply(reload.back().handle, plan::Strategy::kOffload), Status::kOk);
    }
  }
  ASSERT_FALSE(offload.empty());
  ASSERT_FALSE(reload.empty());
  ASSERT_EQ(enf->synchronize(), Status::kOk);
  std::map<const void*, int> h2d_src;  // pinned copy -> graph tensor (y+1)
  for (const Tensor& t : reload) {
    bgl_enf_tensor_info info;
    ASSERT_EQ(enf->info(t.handle, &info), Status::kOk);
    h2d_src[info.host_ptr] = t.graph;
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    log.clear();  // only the point's pieces count
  }

  // Run the point: compute reaches each F/B stage in the plan's order.
  ASSERT_EQ(enf->schedule_begin(chosen.issue_order, x - 1, y + 1), Status::kOk);
  for (const IssueItem& it : chosen.issue_order) {
    if (it.chain != Chain::kForward && it.chain != Chain::kBackward) continue;
    {
      std::lock_guard<std::mutex> lock(mu);
      log.push_back({Entry::kCompute, nullptr, it.chain, it.stage});
    }
    ASSERT_EQ(enf->schedule_reached(it.chain, it.stage), Status::kOk);
    compute.enqueue([] { std::this_thread::sleep_for(std::chrono::microseconds(300)); });
    compute.synchronize();
    ASSERT_EQ(enf->schedule_poll(nullptr), Status::kOk);
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    log.push_back({Entry::kFinish});
  }
  ASSERT_EQ(enf->schedule_finish(), Status::kOk);

  // The recorded O/R pieces, in the order they reached their streams, are the plan's.
  auto piece_of = [&](const Entry& e) -> int {  // index of the plan item that covers the copy
    const int t = e.kind == Entry::kD2H ? d2h_src.at(e.src) : h2d_src.at(e.src);
    for (size_t i = 0; i < chosen.issue_order.size(); ++i) {
      const IssueItem& it = chosen.issue_order[i];
      const bool kind_ok = e.kind == Entry::kD2H
                               ? it.chain == Chain::kOffload
                               : it.chain == Chain::kRecover && it.resource == Resource::kH2D;
      if (kind_ok && it.first <= t && t <= it.last) return static_cast<int>(i);
    }
    return -1;
  };
  std::vector<int> recorded;
  int compute_round = -1;
  for (const Entry& e : log) {
    if (e.kind == Entry::kFinish) {  // compute is done: whatever the bound held back goes now
      compute_round = std::numeric_limits<int>::max();
      continue;
    }
    if (e.kind == Entry::kCompute) {
      for (const IssueItem& it : chosen.issue_order) {
        if (it.chain == e.chain && it.stage == e.stage) compute_round = it.round;
      }
      continue;
    }
    const int piece = piece_of(e);
    ASSERT_GE(piece, 0) << "a copy no item of the plan names";
    EXPECT_LE(chosen.issue_order[piece].round, compute_round)
        << "a piece was issued before compute reached its round";

    if (recorded.empty() || recorded.back() != piece) recorded.push_back(piece);
  }
  std::vector<int> planned;
  for (size_t i = 0; i < chosen.issue_order.size(); ++i) {
    const IssueItem& it = chosen.issue_order[i];
    if (it.chain == Chain::kOffload ||
        (it.chain == Chain::kRecover && it.resource == Resource::kH2D)) {
      planned.push_back(static_cast<int>(i));
    }
  }
  EXPECT_EQ(recorded, planned);
  for (const Tensor& t : offload) {
    bgl_enf_tensor_info info;
    ASSERT_EQ(enf->info(t.handle, &info), Status::kOk);
    EXPECT_EQ(info.placement, BGL_PLACE_HOST) << "graph tensor " << t.graph;
  }

  // Consumers on the compute stream read every reloaded tensor only after its copy.
  std::atomic<int> wrong{0};
  for (const Tensor& t : reload) {
    void* p = nullptr;
    ASSERT_EQ(enf->acquire(t.handle, -1, &compute, &p), Status::kOk);
    compute.enqueue([&wrong, &t, p] {
      if (std::memcmp(p, t.data.data(), t.data.size()) != 0) ++wrong;
    });
  }
  compute.synchronize();
  EXPECT_EQ(wrong.load(), 0);
  for (const Tensor& t : reload) ASSERT_EQ(enf->release(t.handle, -1, &compute), Status::kOk);
  for (const Tensor& t : offload) {
    void* p = nullptr;
    ASSERT_EQ(enf->acquire(t.handle, -1, &compute, &p), Status::kOk);
    compute.enqueue([&wrong, &t, p] {
      if (std::memcmp(p, t.data.data(), t.data.size()) != 0) ++wrong;
    });
    compute.synchronize();
    ASSERT_EQ(enf->release(t.handle, -1, &compute), Status::kOk);
  }
  EXPECT_EQ(wrong.load(), 0);
  enf.reset();
}

}  // namespace
}  // namespace bgl::enf::testing
