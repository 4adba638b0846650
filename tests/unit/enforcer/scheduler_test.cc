// StreamScheduler: issue order, stage-boundary frontier and the in-flight bound, with a fake
// issuer (deterministic completion) and with the enforcer on host streams.
#include <gtest/gtest.h>

#include <map>

#include "enforcer/stream_scheduler.h"
#include "tests/unit/enforcer/test_env.h"

namespace bgl::enf::testing {
namespace {

using plan::Chain;
using plan::IssueItem;
using plan::Resource;

IssueItem item(Chain c, int stage, int round, Resource r, int first = 0, int last = 0) {
  IssueItem i;
  i.chain = c;
  i.stage = stage;
  i.round = round;
  i.resource = r;
  i.first = first;
  i.last = last;
  return i;
}

// Completes an item only when the test says so.
class FakeIssuer : public WorkIssuer {
 public:
  Status issue(const IssueItem& it, Event* done, std::string*) override {
    issued.push_back(it);
    const std::uint64_t id = issued.size();
    complete[id] = false;
    *done = Event{this, id};
    max_open = std::max(max_open, open());
    return Status::kOk;
  }
  bool query(const Event& e) override { return complete[e.value]; }
  Status wait(const Event& e) override {
    complete[e.value] = true;
    return Status::kOk;
  }
  std::size_t open() const {
    std::size_t n = 0;
    for (auto& [id, c] : complete) n += c ? 0 : 1;
    return n;
  }
  std::vector<IssueItem> issued;
  std::map<std::uint64_t, bool> complete;
  std::size_t max_open = 0;
};

std::vector<IssueItem> sample_order() {
  return {item(Chain::kForward, 0, 0, Resource::kCompute),
          item(Chain::kOffload, 0, 0, Resource::kD2H),
          item(Chain::kBackward, 0, 1, Resource::kCompute),
          item(Chain::kOffload, 1, 1, Resource::kD2H),
          item(Chain::kRecover, 0, 1, Resource::kH2D),
          item(Chain::kForward, 1, 2, Resource::kCompute),
          item(Chain::kOffload, 2, 2, Resource::kD2H),
          item(Chain::kRecover, 1, 2, Resource::kH2D),
          item(Chain::kRecover, 2, 2, Resource::kCompute),
          item(Chain::kBackward, 1, 3, Resource::kCompute)};
}

TEST(StreamScheduler, IssuesAtStageBoundariesInChainOrderWithinTheBound) {
  FakeIssuer fake;
  StreamScheduler s(&fake, /*max_inflight=*/2);
  std::string error;
  ASSERT_EQ(s.load(sample_order(), &error), Status::kOk) << error;
  EXPECT_TRUE(fake.issued.empty());  // nothing before compute starts
  ASSERT_EQ(s.reached(Chain::kForward, 0, &error), Status::kOk);
  ASSERT_EQ(fake.issued.size(), 1u);  // O0 (round 0)
  ASSERT_EQ(s.reached(Chain::kBackward, 0, &error), Status::kOk);
  ASSERT_EQ(fake.issued.size(), 2u);  // O1; R0 waits for the bound
  EXPECT_EQ(s.waiting(), 4u);
  fake.complete[1] = true;
  s.pump(&error);
  ASSERT_EQ(fake.issued.size(), 3u);  // R0
  ASSERT_EQ(s.reached(Chain::kForward, 1, &error), Status::kOk);
  EXPECT_EQ(fake.issued.size(), 3u);  // two in flight
  for (auto& [id, c] : fake.complete) c = true;
  s.pump(&error);
  EXPECT_EQ(fake.issued.size(), 5u);
  ASSERT_EQ(s.finish(&error), Status::kOk);
  ASSERT_EQ(fake.issued.size(), 6u);
  EXPECT_LE(fake.max_open, 2u);
  EXPECT_LE(s.max_inflight_seen(), 2u);
  // Issued = the O/R items in issue order, so chain order holds.
  std::vector<std::pair<Chain, int>> got, want;
  for (auto& i : fake.issued) got.push_back({i.chain, i.stage});
  for (auto& i : sample_order()) {
    if (i.chain == Chain::kOffload || i.chain == Chain::kRecover)
      want.push_back({i.chain, i.stage});
  }
  EXPECT_EQ(got, want);
}

TEST(StreamScheduler, BoundOfOneSerialisesEveryPiece) {
  FakeIssuer fake;
  StreamScheduler s(&fake, 1);
  std::string error;
  ASSERT_EQ(s.load(sample_order(), &error), Status::kOk);
  ASSERT_EQ(s.reached(Chain::kBackward, 1, &error), Status::kOk);  // everything issuable
  EXPECT_EQ(fake.issued.size(), 1u);
  ASSERT_EQ(s.finish(&error), Status::kOk);
  EXPECT_EQ(fake.issued.size(), 6u);
  EXPECT_EQ(fake.max_open, 1u);
}

TEST(StreamScheduler, HandingOverIssuesTheRestAndLeavesItsCopiesInFlight) {
  FakeIssuer fake;
  StreamScheduler s(&fake, /*max_inflight=*/8);
  std::string error;
  ASSERT_EQ(s.load(sample_order(), &error), Status::kOk);
  ASSERT_EQ(s.reached(Chain::kForward, 0, &error), Status::kOk);  // O0 issued
  // The next point: the rest is issued, nothing is waited for (a wait completes a piece).
  ASSERT_EQ(s.hand_over(&error), Status::kOk) << error;
  EXPECT_EQ(fake.issued.size(), 6u);
  EXPECT_EQ(s.waiting(), 0u);
  EXPECT_EQ(fake.open(), 6u);
  EXPECT_EQ(s.inflight(), 6u);
  // They complete beside the next order, counted against its bound.
  ASSERT_EQ(s.load(sample_order(), &error), Status::kOk);
  EXPECT_EQ(s.inflight(), 6u);
  for (auto& [id, c] : fake.complete) c = true;
  ASSERT_EQ(s.reached(Chain::kForward, 0, &error), Status::kOk);
  EXPECT_EQ(s.inflight(), 1u);  // the old ones retired, the new O0 issued
}

TEST(StreamScheduler, HandingOverWaitsOnlyWhereTheBoundHoldsAnIssueBack) {
  FakeIssuer fake;
  StreamScheduler s(&fake, /*max_inflight=*/2);
  std::string error;
  ASSERT_EQ(s.load(sample_order(), &error), Status::kOk);
  ASSERT_EQ(s.hand_over(&error), Status::kOk) << error;
  EXPECT_EQ(fake.issued.size(), 6u);  // all issued
  EXPECT_LE(fake.max_open, 2u);       // never more than the bound in flight
  EXPECT_EQ(fake.open(), 2u);         // the last two were not waited for
}

// The order of sample_order() with the stages' first operators: F0 from operator 0, F1 from 5;
// B0 from 9 down, B1 from 4 down (a backward runs from the chunk's last operator).
std::vector<IssueItem> order_with_operators() {
  auto order = sample_order();
  order[0].first = 0;
  order[2].first = 9;
  order[5].first = 5;
  order[9].first = 4;
  return order;
}

TEST(StreamScheduler, AtPassesTheStagesComputeEnteredInEachChainsDirection) {
  FakeIssuer fake;
  StreamScheduler s(&fake, /*max_inflight=*/8);
  std::string error;
  ASSERT_EQ(s.load(order_with_operators(), &error), Status::kOk) << error;
  int passed = -1;
  ASSERT_EQ(s.at(Chain::kForward, -1, &passed, &error), Status::kOk);  // not a planned operator
  EXPECT_EQ(passed, 0);
  EXPECT_TRUE(fake.issued.empty());
  ASSERT_EQ(s.at(Chain::kForward, 0, &passed, &error), Status::kOk);  // F0: round 0 issuable
  EXPECT_EQ(passed, 1);
  ASSERT_EQ(fake.issued.size(), 1u);                                  // O0
  ASSERT_EQ(s.at(Chain::kForward, 4, &passed, &error), Status::kOk);  // still inside F0
  EXPECT_EQ(passed, 0);
  ASSERT_EQ(s.at(Chain::kBackward, 10, &passed, &error), Status::kOk);  // before B0's first
  EXPECT_EQ(passed, 0);
  EXPECT_EQ(fake.issued.size(), 1u);
  ASSERT_EQ(s.at(Chain::kBackward, 3, &passed, &error), Status::kOk);  // past B0 and B1 at once
  EXPECT_EQ(passed, 2);
  EXPECT_EQ(fake.issued.size(), 6u);                                   // rounds up to 3: everything
  ASSERT_EQ(s.at(Chain::kBackward, 0, &passed, &error), Status::kOk);  // nothing left to pass
  EXPECT_EQ(passed, 0);
  ASSERT_EQ(s.at(Chain::kForward, 7, &passed, &error), Status::kOk);  // F1
  EXPECT_EQ(passed, 1);
  // A new order starts from its first stages again.
  ASSERT_EQ(s.finish(&error), Status::kOk);
  ASSERT_EQ(s.load(order_with_operators(), &error), Status::kOk);
  ASSERT_EQ(s.at(Chain::kForward, 9, &passed, &error), Status::kOk);
  EXPECT_EQ(passed, 2);
  EXPECT_EQ(s.at(Chain::kOffload, 0, &passed, &error), Status::kInvalidArgument);
  EXPECT_NE(error.find("chain must be forward (0) or backward (1)"), std::string::npos) << error;
  EXPECT_EQ(passed, 0);
}

// `at` and `reached` describe the same progress: the pieces issued after each step agree.
TEST(StreamScheduler, AtIssuesWhatReachedIssuesForTheSameStages) {
  FakeIssuer by_op, by_stage;
  StreamScheduler a(&by_op, 2), b(&by_stage, 2);
  std::string error;
  ASSERT_EQ(a.load(order_with_operators(), &error), Status::kOk);
  ASSERT_EQ(b.load(order_with_operators(), &error), Status::kOk);
  int passed = 0;
  const std::vector<std::pair<Chain, int>> ops = {
      {Chain::kForward, 0}, {Chain::kBackward, 9}, {Chain::kForward, 6}, {Chain::kBackward, 2}};
  const std::vector<std::pair<Chain, int>> stages = {
      {Chain::kForward, 0}, {Chain::kBackward, 0}, {Chain::kForward, 1}, {Chain::kBackward, 1}};
  for (std::size_t i = 0; i < ops.size(); ++i) {
    ASSERT_EQ(a.at(ops[i].first, ops[i].second, &passed, &error), Status::kOk);
    EXPECT_EQ(passed, 1) << i;
    ASSERT_EQ(b.reached(stages[i].first, stages[i].second, &error), Status::kOk);
    EXPECT_EQ(by_op.issued.size(), by_stage.issued.size()) << i;
    for (auto& [id, c] : by_op.complete) c = true;
    for (auto& [id, c] : by_stage.complete) c = true;
  }
}

TEST(StreamScheduler, RejectsBadOrdersAndUnknownStages) {
  FakeIssuer fake;
  StreamScheduler s(&fake, 2);
  std::string error;
  auto order = sample_order();
  std::swap(order[3], order[6]);  // O2 before O1
  order[3].round = 1;
  order[6].round = 2;
  EXPECT_EQ(s.load(order, &error), Status::kInvalidArgument);
  EXPECT_NE(error.find("order inside a chain"), std::string::npos) << error;
  order = sample_order();
  order[5].round = 0;  // rounds go back
  EXPECT_EQ(s.load(order, &error), Status::kInvalidArgument);
  ASSERT_EQ(s.load(sample_order(), &error), Status::kOk);
  EXPECT_EQ(s.reached(Chain::kForward, 7, &error), Status::kInvalidArgument);
  EXPECT_EQ(s.reached(Chain::kOffload, 0, &error), Status::kInvalidArgument);
  EXPECT_TRUE(fake.issued.empty());
}

TEST(StreamScheduler, EnforcerOffloadsAndRecoversWhatThePlanNames) {
  Env env(std::size_t{256} << 20, 64 << 20, /*max_inflight=*/1);
  // Micro-batch 0: six tensors (graph 0..5) to offload now; micro-batch 1: two offloaded and
  // two dropped tensors to recover.
  std::vector<std::vector<std::uint8_t>> data(10);
  std::vector<std::uint64_t> h;
  for (int t = 0; t < 6; ++t) {
    h.push_back(env.make(70000 + t, &data[t], t, 0, t));
    env.enf->set_strategy(h.back(), t == 4 ? Strategy::kKeep : Strategy::kOffload);
  }
  for (int t = 0; t < 4; ++t) {
    h.push_back(env.make(50000 + t, &data[6 + t], /*producer=*/t, 1, t));
    ASSERT_EQ(env.enf->apply(h.back(), t < 2 ? Strategy::kOffload : Strategy::kRecompute),
              Status::kOk);
  }
  std::vector<int> recomputed;
  env.enf->set_recompute([&](std::uint64_t handle, int producer, int, void** out) {
    recomputed.push_back(producer);
    auto& d = data[6 + producer];
    void* p = env.pool->allocate(d.size(), &env.compute);
    std::memcpy(p, d.data(), d.size());
    *out = p;
    (void)handle;
    return 0;
  });
  const std::vector<IssueItem> order = {item(Chain::kForward, 0, 0, Resource::kCompute),
                                        item(Chain::kOffload, 0, 0, Resource::kD2H, 0, 2),
                                        item(Chain::kRecover, 0, 0, Resource::kH2D, 0, 1),
                                        item(Chain::kBackward, 0, 1, Resource::kCompute),
                                        item(Chain::kOffload, 1, 1, Resource::kD2H, 3, 5),
                                        item(Chain::kRecover, 1, 1, Resource::kCompute, 3, 3),
                                        item(Chain::kRecover, 2, 2, Resource::kCompute, 2, 2),
                                        item(Chain::kForward, 1, 2, Resource::kCompute)};
  ASSERT_EQ(env.enf->schedule_begin(order, 0, 1), Status::kOk);
  EXPECT_EQ(env.enf->stats().offloads, 2u);  // only the applies so far
  ASSERT_EQ(env.enf->schedule_reached(Chain::kForward, 0), Status::kOk);
  ASSERT_EQ(env.enf->schedule_reached(Chain::kBackward, 0), Status::kOk);
  ASSERT_EQ(env.enf->schedule_reached(Chain::kForward, 1), Status::kOk);
  ASSERT_EQ(env.enf->schedule_finish(), Status::kOk) << last_error();
  auto s = env.enf->stats();
  EXPECT_EQ(s.offloads, 2u + 5u);
  EXPECT_EQ(s.reloads, 2u);
  EXPECT_EQ(recomputed, (std::vector<int>{3, 2}));  // in issue order, each once
  EXPECT_LE(s.scheduled_max_inflight, 1u);
  for (int t = 0; t < 6; ++t) {
    EXPECT_EQ(env.info(h[t]).placement, t == 4 ? BGL_PLACE_DEVICE : BGL_PLACE_HOST) << t;
  }
  for (std::size_t i = 0; i < h.size(); ++i) {
    env.expect_data(h[i], data[i]);
    env.enf->release(h[i], -1, &env.compute);
  }
  EXPECT_EQ(recomputed.size(), 2u);
}

}  // namespace
}  // namespace bgl::enf::testing
