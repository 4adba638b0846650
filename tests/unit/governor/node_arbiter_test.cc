// NodeArbiter: grants within the node budget, floors, max-min fairness against brute force,
// bad configs and requests naming the field, bandwidth shares per link.
#include "governor/common/node_arbiter.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <numeric>
#include <random>

namespace bgl::gov {
namespace {

NodeArbiter MakeArbiter(int64_t budget, int64_t floor, int max_sessions,
                        std::vector<NodeLink> links = {}) {
  NodeConfig config;
  config.host_budget_bytes = budget;
  config.host_floor_bytes = floor;
  config.max_sessions = max_sessions;
  config.links = std::move(links);
  auto arbiter = NodeArbiter::Create(config);
  EXPECT_TRUE(arbiter.ok()) << arbiter.status().message();
  return std::move(arbiter).value();
}

int64_t Sum(const NodeArbiter& a) {
  int64_t sum = 0;
  for (const auto& [id, grant] : a.Grants()) sum += grant;
  return sum;
}

TEST(NodeArbiter, RandomSequencesKeepGrantsWithinBudgetAndAboveFloor) {
  std::mt19937_64 rng(14);
  for (int trial = 0; trial < 200; ++trial) {
    const int max_sessions = 1 + static_cast<int>(rng() % 8);
    const int64_t floor = static_cast<int64_t>(rng() % 1000);
    const int64_t budget = floor * max_sessions + static_cast<int64_t>(rng() % 5000);
    NodeArbiter a = MakeArbiter(budget, floor, max_sessions);
    std::vector<uint64_t> live;
    uint64_t next = 1;
    uint64_t version = a.Version();
    for (int step = 0; step < 60; ++step) {
      if (!live.empty() && (rng() % 3 == 0 || static_cast<int>(live.size()) == max_sessions)) {
        const size_t i = rng() % live.size();
        auto before = a.Grants();
        a.Unregister(live[i]);
        EXPECT_EQ(a.Grant(live[i]), 0);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
        before.erase(std::remove_if(before.begin(), before.end(),
                                    [&](const auto& g) { return a.Grant(g.first) == 0; }),
                     before.end());
        // The version moves exactly when a remaining session's grant changed.
        EXPECT_EQ(a.Version() > version, before != a.Grants());
      } else {
        const int64_t request = rng() % 4 == 0 ? 0 : static_cast<int64_t>(rng() % (budget + 1));
        auto grant = a.Register(next, static_cast<int>(rng() % 8), request);
        ASSERT_TRUE(grant.ok()) << grant.status().message();
        EXPECT_EQ(*grant, a.Grant(next));
        live.push_back(next++);
      }
      version = a.Version();
      EXPECT_LE(Sum(a), budget);
      for (const auto& [id, grant] : a.Grants()) EXPECT_GE(grant, floor) << "session " << id;
    }
  }
}

// Sessions hold pinned memory up to their grant; a grant that shrinks is given back only as
// copies come back. Under random registrations, departures and uses (each within the session's
// current grant, or shrinking from above it), the node's pinned memory (every session's
// max(grant, use)) never exceeds the budget, and once every session is within its share the
// grants are the plain fair shares again.
TEST(NodeArbiter, UseAboveAShrunkGrantIsTakenFromTheOthersHeadroom) {
  std::mt19937_64 rng(41);
  for (int trial = 0; trial < 200; ++trial) {
    const int max_sessions = 1 + static_cast<int>(rng() % 8);
    const int64_t floor = static_cast<int64_t>(rng() % 1000);
    const int64_t budget = floor * max_sessions + static_cast<int64_t>(rng() % 5000);
    NodeArbiter a = MakeArbiter(budget, floor, max_sessions);
    std::map<uint64_t, int64_t> used;
    uint64_t next = 1;
    auto held = [&] {
      int64_t sum = 0;
      for (const auto& [id, grant] : a.Grants()) sum += std::max(grant, used[id]);
      return sum;
    };
    for (int step = 0; step < 80; ++step) {
      const int r = static_cast<int>(rng() % 4);
      if (!used.empty() && (r == 0 || static_cast<int>(used.size()) == max_sessions)) {
        auto it = std::next(used.begin(), static_cast<std::ptrdiff_t>(rng() % used.size()));
        a.Unregister(it->first);
        used.erase(it);
      } else if (!used.empty() && r == 1) {
        // A session allocates up to its grant, or frees part of what it holds.
        auto it = std::next(used.begin(), static_cast<std::ptrdiff_t>(rng() % used.size()));
        const int64_t grant = a.Grant(it->first);
        const int64_t now = it->second;
        const int64_t to = now > grant ? static_cast<int64_t>(rng() % (now + 1))
                                       : static_cast<int64_t>(rng() % (grant + 1));
        it->second = to;
        a.SetUsed(it->first, to);
      } else {
        ASSERT_TRUE(a.Register(next, 0, 0).ok());
        used[next++] = 0;
      }
      EXPECT_LE(held(), budget) << "trial " << trial << " step " << step;
    }
    for (auto& [id, u] : used) {
      u = 0;
      a.SetUsed(id, 0);
    }
    for (const auto& [id, grant] : a.Grants()) EXPECT_GE(grant, floor);
    EXPECT_LE(Sum(a), budget);
  }
}

TEST(NodeArbiter, ANewcomerGetsWhatTheFirstSessionGivesBack) {
  NodeArbiter a = MakeArbiter(1000, 100, 4);
  ASSERT_EQ(*a.Register(1, 0, 0), 1000);
  a.SetUsed(1, 900);
  ASSERT_TRUE(a.Register(2, 1, 0).ok());
  EXPECT_EQ(a.Grant(1), 500);  // told to shrink
  EXPECT_EQ(a.Grant(2), 100);  // what is free now
  a.SetUsed(1, 700);
  EXPECT_EQ(a.Grant(2), 300);
  a.SetUsed(1, 400);
  EXPECT_EQ(a.Grant(1), 500);
  EXPECT_EQ(a.Grant(2), 500);
  a.SetUsed(7, 10);  // unknown session: ignored
  a.SetUsed(2, -1);  // negative: ignored
  EXPECT_EQ(a.Grant(2), 500);
}

// Brute force: every integer allocation with floor <= g_i <= demand_i and sum <= budget; the
// max-min fair one is the lexicographically largest sorted vector, then the largest sum. Ties
// (the bytes a level leaves over) go to the sessions in order, as WaterFill documents: among
// the fair allocations, the lexicographically largest in session order.
std::vector<int64_t> BruteForce(const std::vector<int64_t>& requests, int64_t budget,
                                int64_t floor) {
  const size_t n = requests.size();
  std::vector<int64_t> demand(n);
  for (size_t i = 0; i < n; ++i) {
    demand[i] = requests[i] == 0 ? budget : std::max(requests[i], floor);
  }
  std::vector<int64_t> best_sorted, best, g(n);
  std::function<void(size_t, int64_t)> walk = [&](size_t i, int64_t left) {
    if (i == n) {
      std::vector<int64_t> sorted = g;
      std::sort(sorted.begin(), sorted.end());
      const int64_t sum = std::accumulate(g.begin(), g.end(), int64_t{0});
      const int64_t best_sum = std::accumulate(best.begin(), best.end(), int64_t{0});
      if (best.empty() || sorted > best_sorted ||
          (sorted == best_sorted && (sum > best_sum || (sum == best_sum && g > best)))) {
        best_sorted = sorted;
        best = g;
      }
      return;
    }
    for (int64_t v = floor; v <= std::min(demand[i], left); ++v) {
      g[i] = v;
      walk(i + 1, left - v);
    }
  };
  walk(0, budget);
  return best;
}

TEST(WaterFill, EqualsBruteForceMaxMinOnSmallInputs) {
  int cases = 0;
  for (int64_t floor = 0; floor <= 2; ++floor) {
    for (int64_t budget = floor * 3; budget <= 9; ++budget) {
      for (int n = 1; n <= 3; ++n) {
        std::vector<int64_t> req(n, 0);
        std::function<void(int)> each = [&](int i) {
          if (i == n) {
            const std::vector<int64_t> got = WaterFill(req, budget, floor);
            const std::vector<int64_t> want = BruteForce(req, budget, floor);
            // Per session, not as multisets: a grant given to the wrong session fails.
            ASSERT_EQ(got.size(), want.size());
            for (int k = 0; k < n; ++k) {
              EXPECT_EQ(got[k], want[k])
                  << "session " << k << " of " << n << ", budget " << budget << " floor " << floor;
            }
            for (int k = 0; k < n; ++k) {
              // Per session: no grant above what it asked (or the floor).
              const int64_t cap = req[k] == 0 ? budget : std::max(req[k], floor);
              EXPECT_LE(got[k], cap);
              EXPECT_GE(got[k], floor);
            }
            EXPECT_LE(std::accumulate(got.begin(), got.end(), int64_t{0}), budget);
            ++cases;
            return;
          }
          for (int64_t r = 0; r <= budget; ++r) {
            req[i] = r;
            each(i + 1);
          }
        };
        each(0);
      }
    }
  }
  EXPECT_GT(cases, 1000);
}

TEST(NodeArbiter, RebalancesOnRegisterAndUnregister) {
  NodeArbiter a = MakeArbiter(1000, 100, 4);
  EXPECT_EQ(*a.Register(1, 0, 0), 1000);
  EXPECT_EQ(*a.Register(2, 1, 0), 500);
  EXPECT_EQ(a.Grant(1), 500);
  EXPECT_EQ(*a.Register(3, 2, 200), 200);
  EXPECT_EQ(a.Grant(1), 400);
  EXPECT_EQ(a.Grant(2), 400);
  EXPECT_EQ(*a.Register(4, 3, 50), 100);  // the floor
  EXPECT_EQ(a.Grant(1), 350);
  a.Unregister(3);
  EXPECT_EQ(a.Grant(1), 450);
  EXPECT_EQ(a.Grant(3), 0);
}

TEST(NodeArbiter, BadConfigsNameTheField) {
  auto err = [](NodeConfig c) {
    auto a = NodeArbiter::Create(std::move(c));
    EXPECT_FALSE(a.ok());
    return a.status().message();
  };
  NodeConfig c;
  c.host_budget_bytes = 799;
  c.host_floor_bytes = 100;
  c.max_sessions = 8;
  EXPECT_NE(err(c).find("host_budget_bytes"), std::string::npos);
  c.host_budget_bytes = -1;
  EXPECT_NE(err(c).find("host_budget_bytes"), std::string::npos);
  c.host_budget_bytes = 800;
  c.host_floor_bytes = -1;
  EXPECT_NE(err(c).find("host_floor_bytes"), std::string::npos);
  c.host_floor_bytes = 100;
  c.max_sessions = 0;
  EXPECT_NE(err(c).find("max_sessions"), std::string::npos);
  c.max_sessions = 8;
  c.links = {{{0, 1}, 0}, {{2, 1}, 0}};
  EXPECT_NE(err(c).find("links"), std::string::npos);
  c.links = {{{0, -3}, 0}};
  EXPECT_NE(err(c).find("links"), std::string::npos);
  c.links = {{{}, 0}};
  EXPECT_NE(err(c).find("links"), std::string::npos);
  c.links = {{{0}, -5}};
  EXPECT_NE(err(c).find("links[0].peak_bytes_per_s"), std::string::npos);
  c.links = {{{0, 1}, 0}};
  EXPECT_TRUE(NodeArbiter::Create(c).ok());
}

TEST(NodeArbiter, BadRequestsNameTheFieldAndLeaveOthersAlone) {
  NodeArbiter a = MakeArbiter(1000, 100, 2);
  ASSERT_TRUE(a.Register(1, 0, 0).ok());
  auto over = a.Register(2, 0, 1001);
  ASSERT_FALSE(over.ok());
  EXPECT_NE(over.status().message().find("host_request_bytes"), std::string::npos);
  // Sizes in binary units with the exact count (issue 44).
  EXPECT_NE(over.status().message().find("0.98 KiB (1001 bytes) is over the node's host budget "
                                         "(host_budget_bytes 0.98 KiB (1000 bytes))"),
            std::string::npos)
      << over.status().message();
  auto negative = a.Register(2, 0, -1);
  ASSERT_FALSE(negative.ok());
  EXPECT_NE(negative.status().message().find("host_request_bytes"), std::string::npos);
  EXPECT_FALSE(a.Register(1, 0, 0).ok());  // twice
  EXPECT_FALSE(a.Register(2, -1, 0).ok());
  EXPECT_EQ(a.Grant(1), 1000);
  ASSERT_TRUE(a.Register(2, 1, 0).ok());
  auto full = a.Register(3, 2, 0);
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(full.status().message().find("host_request_bytes"), std::string::npos);
  EXPECT_EQ(a.Grant(1), 500);
  EXPECT_EQ(a.Grant(2), 500);
}

TEST(NodeArbiter, BandwidthSharesPerLink) {
  NodeArbiter a = MakeArbiter(8000, 100, 8, {{{0, 1, 2, 3}, 0}, {{4, 5, 6, 7}, 0}});
  EXPECT_EQ(a.LinkOf(2), 0);
  EXPECT_EQ(a.LinkOf(5), 1);
  EXPECT_EQ(a.LinkOf(9), -10);
  for (uint64_t s = 0; s < 5; ++s) ASSERT_TRUE(a.Register(s, static_cast<int>(s), 0).ok());
  ASSERT_TRUE(a.Register(9, 9, 0).ok());
  EXPECT_EQ(a.BandwidthShare(0), 1.0);
  a.SetOffloading(0, true);
  EXPECT_EQ(a.BandwidthShare(0), 1.0);
  EXPECT_EQ(a.BandwidthShare(1), 0.5);  // would offload beside session 0
  a.SetOffloading(1, true);
  a.SetOffloading(2, true);
  EXPECT_EQ(a.OffloadingOnLink(0), 3);
  EXPECT_DOUBLE_EQ(a.BandwidthShare(0), 1.0 / 3);
  EXPECT_DOUBLE_EQ(a.BandwidthShare(3), 0.25);
  // Other links are unaffected.
  a.SetOffloading(4, true);
  EXPECT_EQ(a.BandwidthShare(4), 1.0);
  EXPECT_EQ(a.OffloadingOnLink(1), 1);
  a.SetOffloading(9, true);
  EXPECT_EQ(a.BandwidthShare(9), 1.0);
  EXPECT_EQ(a.OffloadingOnLink(-10), 1);
  a.Unregister(1);
  EXPECT_EQ(a.BandwidthShare(0), 0.5);
  a.SetOffloading(2, false);
  EXPECT_EQ(a.BandwidthShare(0), 1.0);
  EXPECT_EQ(a.BandwidthShare(12345), 1.0);
  EXPECT_EQ(a.SessionLink(0, 0), 0);
  EXPECT_EQ(a.SessionLink(12345, 6), NodeArbiter::OwnLink(6));  // unknown: the GPU's own link
  EXPECT_EQ(NodeArbiter::GpuOfOwnLink(NodeArbiter::OwnLink(6)), 6);
}

TEST(NodeArbiter, PlanShareScalesByTheLinksMeasuredPeak) {
  // Link 0 measured at 20 GB/s; link 1 without a peak; GPU 7 a link of its own.
  NodeArbiter a = MakeArbiter(8000, 100, 8, {{{0, 1}, 20e9}, {{2, 3}, 0}});
  for (uint64_t s = 0; s < 4; ++s) ASSERT_TRUE(a.Register(s, static_cast<int>(s), 0).ok());
  ASSERT_TRUE(a.Register(7, 7, 0).ok());
  const double own = 50e9;                     // each GPU's calibrated copy peak
  EXPECT_DOUBLE_EQ(a.PlanShare(0, own), 0.4);  // alone: the link's peak over its own
  a.SetOffloading(1, true);
  EXPECT_DOUBLE_EQ(a.PlanShare(0, own), 0.2);        // and halved beside an offloading session
  EXPECT_DOUBLE_EQ(a.PlanShare(0, 10e9), 1.0);       // half of a link twice as fast: its own peak
  EXPECT_DOUBLE_EQ(a.PlanShare(0, 0), 0.5);          // no calibrated peak: the plain share
  EXPECT_DOUBLE_EQ(a.PlanShare(0, 1e15), 1.0 / 64);  // never below 1/64
  a.SetOffloading(3, true);
  EXPECT_DOUBLE_EQ(a.PlanShare(2, own), 0.5);  // no measured peak: the plain share
  EXPECT_DOUBLE_EQ(a.PlanShare(7, own), 1.0);
  EXPECT_DOUBLE_EQ(a.PlanShare(12345, own), 1.0);
}

}  // namespace
}  // namespace bgl::gov
