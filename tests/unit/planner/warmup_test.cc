// The warm-up (issue 43 item 1): the refiner's thread plans the mitigation-cache keys a run will
// meet (every forward at load 1 and each micro-batch spiked up to the spike bound) before they are
// met; the cap keeps it from evicting its own plans; a bad spike bound is refused.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "governor/planner/iteration.h"
#include "governor/planner/planner.h"

namespace bgl::plan {
namespace {

// The Table II GLM-423B-A30B stage at 8 micro-batches with copies at a twentieth of the paper's
// bandwidth (as anytime_test.cc) on 48 GB, so plans mitigate at load 1 and differ between keys.
Result<std::unique_ptr<StagePlanner>> Glm423(PlannerOptions options, bool anytime = false) {
  auto doc = LoadJsonOrYaml(std::string(BGL_MODELS_DIR) + "/glm-423b-a30b.json", "model");
  EXPECT_TRUE(doc.ok());
  (*doc)["micro_batches"] = 8;
  auto config = ModelConfigFromJson(*doc, "glm-423b-a30b.json");
  EXPECT_TRUE(config.ok()) << config.status().message();
  HardwareProfile hw = *HardwareProfileByName("paper");
  hw.offload.peak_bytes_per_s /= 20;
  hw.reload.peak_bytes_per_s /= 20;
  // 48 GB: about half the forwards at load 1 mitigate, and every spiked one.
  options.capacity_bytes = int64_t{48} * 1000 * 1000 * 1000;
  // 0: a miss runs the full search on the call (same plans as warm); anytime, a miss gets the
  // first answer (every chunk) and its refinement, as the package's embedded planner does.
  options.anytime_min_ops = anytime ? 1 : 0;
  return StagePlanner::Create(*config, hw, options);
}

PlannerOptions Warm(double bound) {
  PlannerOptions options;
  options.warm_up = true;
  options.warm_spike_bound = bound;
  return options;
}

std::vector<double> Loads(const StagePlanner& p, int spiked, double spike) {
  std::vector<double> loads(static_cast<size_t>(p.config().MicroBatches()), 1.0);
  if (spiked >= 0) loads[static_cast<size_t>(spiked)] = spike;
  return loads;
}

TEST(Warmup, RefusesASpikeBoundOutsideOneTo64WithItsName) {
  for (double bad : {0.5, 0.99, 65.0, -1.0, std::numeric_limits<double>::quiet_NaN(),
                     std::numeric_limits<double>::infinity()}) {
    auto p = Glm423(Warm(bad));
    ASSERT_FALSE(p.ok()) << bad;
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(p.status().message().find("warm_spike_bound"), std::string::npos)
        << p.status().message();
    EXPECT_NE(p.status().message().find("[1, 64]"), std::string::npos) << p.status().message();
  }
  for (double good : {1.0, 3.0, 64.0}) EXPECT_TRUE(Glm423(Warm(good)).ok()) << good;
  PlannerOptions over = Warm(3.0);
  over.cache_entries = 100;
  over.warm_max_keys = 51;  // more than half the cache
  auto p = Glm423(over);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("warm_max_keys"), std::string::npos);
}

TEST(Warmup, OffUnlessAskedFor) {
  auto p = Glm423(PlannerOptions{});
  ASSERT_TRUE(p.ok());
  EXPECT_EQ((*p)->StartWarmup().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(ReplayIteration(**p, Loads(**p, -1, 1)).ok());
  const PlannerCacheStats s = (*p)->cache_stats();
  EXPECT_EQ(s.warm_submitted, 0u);
  EXPECT_EQ(s.warm_keys, 0u);
}

// Every forward that mitigates, at load 1 and with each micro-batch spiked to each bucket up to
// the bound, is a cache hit on a warm-up plan: no miss once the warm-up is done.
TEST(Warmup, TheKeysOfARunWithASpikeAreWarmBeforeTheyAreMet) {
  const double bound = 1.5;
  auto made = Glm423(Warm(bound));
  ASSERT_TRUE(made.ok()) << made.status().message();
  StagePlanner& p = **made;
  ASSERT_TRUE(p.StartWarmup().ok());
  p.WaitForWarmup();
  const PlannerCacheStats warm = p.cache_stats();
  EXPECT_TRUE(warm.warm_complete);
  EXPECT_GT(warm.warm_submitted, 0u);
  EXPECT_EQ(warm.warm_done, warm.warm_submitted);
  EXPECT_EQ(warm.warm_keys, warm.warm_submitted);
  EXPECT_EQ(warm.mitigation.misses, 0u);
  int mitigated = 0, spiked_points = 0;
  std::set<double> spike_loads;
  for (int spiked = -1; spiked < static_cast<int>(p.config().MicroBatches()); ++spiked) {
    for (double spike : {1.05, 1.25, 1.5}) {
      if (spiked < 0 && spike != 1.05) continue;
      auto replay = ReplayIteration(p, Loads(p, spiked, spike));
      ASSERT_TRUE(replay.ok()) << replay.status().message();
      for (const Plan& plan : replay->plans) {
        if (plan.micro_batch < 0) continue;
        if (plan.predicted_bytes >= plan.keep_all_bytes) continue;  // keep-all: no key
        ++mitigated;
        if (plan.micro_batch == spiked) {
          ++spiked_points;
          spike_loads.insert(plan.load_factor);
        }
        EXPECT_TRUE(plan.warm) << "micro-batch " << plan.micro_batch << " chunk " << plan.chunk
                               << " load " << plan.load_factor << " spiked " << spiked;
      }
    }
  }
  EXPECT_GT(mitigated, 0);
  EXPECT_GT(spiked_points, 0);
  EXPECT_EQ(spike_loads.size(), 3u);
  const PlannerCacheStats after = p.cache_stats();
  EXPECT_EQ(after.mitigation.misses, 0u);
  EXPECT_EQ(after.warm_hits, static_cast<uint64_t>(mitigated));
  EXPECT_GT(after.warm_cpu_s, 0);
}

// A budget the planner's replay does not give (the point's measured bytes in use) is warmed at
// every load once a point met it: a spike at that budget is then a warm hit.
TEST(Warmup, ABudgetThePointsMeetIsWarmedAtEveryLoad) {
  auto made = Glm423(Warm(2.0));
  ASSERT_TRUE(made.ok());
  StagePlanner& p = **made;
  ASSERT_TRUE(p.StartWarmup().ok());
  p.WaitForWarmup();
  SchedulePoint point;
  point.forward_micro_batch = 0;
  point.load_factor = 1.0;
  // Room for 1.37 M0 more: a budget below keep-all that no replayed point has.
  point.bytes_in_use = static_cast<int64_t>(p.activation_capacity() - 1.37 * p.m0());
  point.load_factor = 1.9;
  auto cold = p.PlanPoint(point);
  ASSERT_TRUE(cold.ok());
  ASSERT_LT(cold->predicted_bytes, cold->keep_all_bytes);
  EXPECT_FALSE(cold->warm);  // not among the replay's keys
  p.ResetIteration();
  p.WaitForWarmup();  // the round the met budget started
  point.load_factor = 1.6;
  auto spiked = p.PlanPoint(point);
  ASSERT_TRUE(spiked.ok());
  EXPECT_TRUE(spiked->warm);
  EXPECT_TRUE(spiked->cache_hit || !spiked->first_answer);
}

// The budget buckets beside a met one are warmed too (the points after a spike meet them in a
// training run: the spiked micro-batch's measured bytes move their budgets by a bucket or so).
TEST(Warmup, TheBudgetBucketsBesideAMetOneAreWarmed) {
  PlannerOptions options = Warm(1.2);
  options.budget_step_bytes = int64_t{4} << 20;  // buckets well inside the budgets met
  auto made = Glm423(options);
  ASSERT_TRUE(made.ok());
  StagePlanner& p = **made;
  ASSERT_TRUE(p.StartWarmup().ok());
  p.WaitForWarmup();
  SchedulePoint point;
  point.forward_micro_batch = 0;
  point.load_factor = 1.1;
  // Room for 1.5 M0 per forward until the next backward: a budget of 1.5 M0, above M0's floor.
  int k = 1;
  for (size_t i = 0; i < p.steps().size(); ++i) {
    const Step& s = p.steps()[i];
    if (s.forward && s.micro_batch == 0 && s.chunk == 0)
      k = ForwardsUntilNextBackward(p.steps(), i);
  }
  point.bytes_in_use = static_cast<int64_t>(p.activation_capacity() - 1.5 * k * p.m0());
  auto met = p.PlanPoint(point);
  ASSERT_TRUE(met.ok());
  ASSERT_LT(met->predicted_bytes, met->keep_all_bytes);
  const auto step = static_cast<double>(p.options().budget_step_bytes);
  const auto bucket = [&](double budget) {
    return static_cast<int64_t>(std::floor(budget / step));
  };
  const int64_t b = bucket(static_cast<double>(met->budget_bytes));
  p.ResetIteration();
  p.WaitForWarmup();
  for (const int64_t beside : {b - 1, b + 1}) {
    // Bytes in use that give the forward a budget in the bucket beside the met one.
    int64_t in_use = -1;
    for (int i = -400; i <= 400 && in_use < 0; ++i) {
      const double used = static_cast<double>(point.bytes_in_use) + i * step / 8;
      if (bucket(AssignBudget(p.activation_capacity(), used, met->k, p.m0()).budget) == beside) {
        in_use = static_cast<int64_t>(used);
      }
    }
    ASSERT_GE(in_use, 0) << beside;
    SchedulePoint next = point;
    next.bytes_in_use = in_use;
    next.load_factor = 1.15;
    auto spiked = p.PlanPoint(next);
    ASSERT_TRUE(spiked.ok());
    ASSERT_EQ(bucket(static_cast<double>(spiked->budget_bytes)), beside);
    if (spiked->predicted_bytes >= spiked->keep_all_bytes) continue;  // keep-all: no key
    EXPECT_TRUE(spiked->warm) << "budget bucket " << beside << " beside " << b;
    p.ResetIteration();
  }
}

// With the warm-up a load below 1 is planned as 1: a training run's predicted loads fall below 1
// about as often as above, and the warm-up plans from load 1 up.
TEST(Warmup, ALoadBelowOneIsServedTheWarmPlanOfLoadOne) {
  auto made = Glm423(Warm(1.2));
  ASSERT_TRUE(made.ok());
  StagePlanner& p = **made;
  int k = 1;  // forwards until the next backward at micro-batch 0's forward
  for (size_t i = 0; i < p.steps().size(); ++i) {
    const Step& s = p.steps()[i];
    if (s.forward && s.micro_batch == 0 && s.chunk == 0)
      k = ForwardsUntilNextBackward(p.steps(), i);
  }
  SchedulePoint point;
  point.forward_micro_batch = 0;
  point.load_factor = 1.1;
  point.bytes_in_use = static_cast<int64_t>(p.activation_capacity() - 1.5 * k * p.m0());
  auto met = p.PlanPoint(point);  // starts the warm-up; its budget is warmed at every load
  ASSERT_TRUE(met.ok());
  ASSERT_LT(met->predicted_bytes, met->keep_all_bytes);
  p.ResetIteration();
  p.WaitForWarmup();
  for (double below : {0.97, 0.9, 0.8}) {
    point.load_factor = below;
    auto plan = p.PlanPoint(point);
    ASSERT_TRUE(plan.ok());
    ASSERT_LT(plan->predicted_bytes, plan->keep_all_bytes) << below;
    EXPECT_TRUE(plan->warm) << "load " << below;
    EXPECT_LE(plan->predicted_bytes, plan->budget_bytes);
    p.ResetIteration();
  }
}

// A cold key (a load the warm-up does not plan, as after a spike) is served the nearest plan, a
// neighbouring key's full search, where it fits and costs no more than the key's first answer
// at its load; else the first answer. Without the warm-up, never.
TEST(Warmup, AColdKeyIsServedTheNearestPlanWhereItIsNotCostlier) {
  for (const bool warm : {true, false}) {
    PlannerOptions options = warm ? Warm(1.0) : PlannerOptions{};  // 1.0: no load above 1 warm
    auto made = Glm423(options, /*anytime=*/true);
    ASSERT_TRUE(made.ok());
    StagePlanner& p = **made;
    int k = 1;  // forwards until the next backward at micro-batch 0's forward
    for (size_t i = 0; i < p.steps().size(); ++i) {
      const Step& s = p.steps()[i];
      if (s.forward && s.micro_batch == 0 && s.chunk == 0)
        k = ForwardsUntilNextBackward(p.steps(), i);
    }
    SchedulePoint point;
    point.forward_micro_batch = 0;
    point.load_factor = 1.5;
    point.bytes_in_use = static_cast<int64_t>(p.activation_capacity() - 1.5 * k * p.m0());
    auto first = p.PlanPoint(point);  // a miss: its first answer, refined in the background
    ASSERT_TRUE(first.ok());
    ASSERT_LT(first->predicted_bytes, first->keep_all_bytes);
    EXPECT_FALSE(first->nearest);  // nothing cached near it yet
    p.ResetIteration();
    int nearest = 0, first_answers = 0;
    for (double r = 1.45; r > 1.02; r -= 0.05) {  // each a cold key below the refined ones
      p.WaitForRefinements();                     // the keys met so far are full searches now
      point.load_factor = r;
      auto plan = p.PlanPoint(point);
      ASSERT_TRUE(plan.ok());
      p.ResetIteration();
      if (plan->predicted_bytes >= plan->keep_all_bytes) continue;  // keep-all: no key
      ASSERT_FALSE(plan->cache_hit && plan->nearest) << r;
      // What the key's first answer would be: the bucket's worst case (StagePlanner::JobFor).
      const double bucket_r =
          std::ceil(r / p.options().load_bucket - 1e-9) * p.options().load_bucket;
      const double step = static_cast<double>(p.options().budget_step_bytes);
      const double budget =
          std::max(p.evaluator().graph().M0(bucket_r),
                   std::floor(static_cast<double>(plan->budget_bytes) / step) * step);
      MitigationOptions fast = p.options().mitigation;
      fast.fast = true;
      auto answer = SelectMitigation(p.evaluator(), bucket_r, budget, fast);
      ASSERT_TRUE(answer.ok());
      if (plan->nearest) {
        ++nearest;
        EXPECT_FALSE(plan->first_answer) << r;
        const AssignmentCost cost = p.evaluator().Evaluate(plan->strategies, bucket_r);
        EXPECT_LE(cost.device_bytes, budget) << r;
        EXPECT_FALSE(cost.conflict) << r;
        EXPECT_LE(cost.exposed_s, answer->cost.exposed_s + 1e-12) << r;
      } else if (plan->first_answer) {
        ++first_answers;
      }
    }
    if (warm) {
      EXPECT_GT(nearest, 0) << "first answers " << first_answers;
      EXPECT_EQ(p.cache_stats().warm_nearest, static_cast<uint64_t>(nearest));
    } else {
      EXPECT_EQ(nearest, 0);
      EXPECT_GT(first_answers, 0);
    }
  }
}

// With the warm-up the downgrade after the gate also weighs the cached full-search plans near
// the observed load (ReplanAfterGate's warm alternatives): never costlier than without them, and
// cheaper where a warm plan of the observed load does better than the priced candidates.
TEST(Warmup, TheDowngradeAfterTheGateWeighsTheWarmPlansOfTheObservedLoad) {
  auto warm_made = Glm423(Warm(1.6));
  auto cold_made = Glm423(PlannerOptions{});
  ASSERT_TRUE(warm_made.ok() && cold_made.ok());
  StagePlanner& warm = **warm_made;
  StagePlanner& cold = **cold_made;
  ASSERT_TRUE(warm.StartWarmup().ok());
  warm.WaitForWarmup();
  int k = 1;  // forwards until the next backward at micro-batch 0's forward
  for (size_t i = 0; i < warm.steps().size(); ++i) {
    const Step& s = warm.steps()[i];
    if (s.forward && s.micro_batch == 0 && s.chunk == 0)
      k = ForwardsUntilNextBackward(warm.steps(), i);
  }
  int cheaper = 0, revised = 0;
  for (double in_use : {12.0, 24.0}) {  // budgets of about 12 and 24 M0
    for (double observed : {1.3, 1.6}) {
      for (int gate = 0; gate < 1; ++gate) {
        SchedulePoint point;
        point.forward_micro_batch = 0;
        point.load_factor = 1.0;
        point.bytes_in_use =
            static_cast<int64_t>(warm.activation_capacity() - in_use * k * warm.m0());
        double overhead[2] = {0, 0};
        bool deferred = false;
        int i = 0;
        for (StagePlanner* p : {&warm, &cold}) {
          if (p == &warm) {  // the point's budget met, then warmed at every load
            ASSERT_TRUE(p->PlanPoint(point).ok());
            p->ResetIteration();
            p->WaitForWarmup();
          }
          auto planned = p->PlanPoint(point);
          ASSERT_TRUE(planned.ok());
          auto after = p->PlanAfterGate(0, 0, gate, observed);
          ASSERT_TRUE(after.ok()) << after.status().message();
          overhead[i++] = after->overhead_s;
          deferred = after->strategies != planned->strategies;
          p->ResetIteration();
        }
        if (!deferred) continue;
        ++revised;
        EXPECT_LE(overhead[0], overhead[1] + 1e-12) << in_use << " " << observed << " " << gate;
        cheaper += overhead[0] < overhead[1] - 1e-9 ? 1 : 0;
      }
    }
  }
  EXPECT_GT(revised, 0);
  EXPECT_GT(cheaper, 0);
}

// The same run without the warm-up misses: the test above is not vacuous.
TEST(Warmup, WithoutItTheSpikedKeysMiss) {
  auto made = Glm423(PlannerOptions{});
  ASSERT_TRUE(made.ok());
  StagePlanner& p = **made;
  ASSERT_TRUE(ReplayIteration(p, Loads(p, -1, 1)).ok());
  const uint64_t misses = p.cache_stats().mitigation.misses;
  ASSERT_TRUE(ReplayIteration(p, Loads(p, 3, 1.5)).ok());
  EXPECT_GT(p.cache_stats().mitigation.misses, misses);
}

// More keys than half the cache: the warm-up submits half the cache and every plan it made is
// still cached when it is done (none pushed out by a later one of its own).
TEST(Warmup, NeverEvictsItsOwnPlans) {
  PlannerOptions options = Warm(3.0);
  options.cache_entries = 16;
  auto made = Glm423(options);
  ASSERT_TRUE(made.ok());
  StagePlanner& p = **made;
  ASSERT_GT(p.WarmKeys().size(), 8u);
  ASSERT_TRUE(p.StartWarmup().ok());
  p.WaitForWarmup();
  const PlannerCacheStats s = p.cache_stats();
  EXPECT_EQ(s.warm_submitted, 8u);
  EXPECT_GT(s.warm_enumerated, 8u);
  EXPECT_EQ(s.warm_keys, 8u);
  EXPECT_EQ(s.mitigation.evictions, 0u);
  EXPECT_TRUE(s.warm_complete);
}

// The order of the keys a met budget adds (WarmObserved): the budgets the points meet (the met one
// and the buckets beside it), lowest load first across all of them, and a key a miss's full
// search already holds is skipped. With room under the cap for 4 more keys after the replay's,
// a point at a new budget and load 1 (its own key planned by the full search on the call) gets:
// load bucket 1.0 at the two budgets beside, then 1.05 at the lower one beside and at the met one.
// Budgets first (every load of one budget before the next), highest load first, or the miss's key
// searched again would leave the met budget's 1.05 cold. Under a second.
TEST(Warmup, AMetBudgetIsWarmedLowestLoadFirstSkippingWhatAMissHolds) {
  PlannerOptions options = Warm(2.0);
  options.warm_rounds = 1;
  size_t replayed = 0;
  {
    auto first = Glm423(options);
    ASSERT_TRUE(first.ok());
    ASSERT_TRUE((*first)->StartWarmup().ok());
    (*first)->WaitForWarmup();
    replayed = (*first)->cache_stats().warm_submitted;
  }
  ASSERT_GT(replayed, 0u);
  options.warm_max_keys = replayed + 4;
  auto made = Glm423(options);
  ASSERT_TRUE(made.ok());
  StagePlanner& p = **made;
  ASSERT_TRUE(p.StartWarmup().ok());
  p.WaitForWarmup();
  ASSERT_EQ(p.cache_stats().warm_submitted, replayed);
  SchedulePoint point;
  point.forward_micro_batch = 0;
  point.load_factor = 1.0;
  // Room for 1.1 M0 more: a budget below keep-all at load 1 that no replayed point has.
  point.bytes_in_use = static_cast<int64_t>(p.activation_capacity() - 1.1 * p.m0());
  auto met = p.PlanPoint(point);
  ASSERT_TRUE(met.ok());
  ASSERT_LT(met->predicted_bytes, met->keep_all_bytes);
  ASSERT_FALSE(met->warm);          // not among the replay's keys
  ASSERT_FALSE(met->first_answer);  // the full search on the call
  p.ResetIteration();
  p.WaitForWarmup();  // the round the met budget started
  EXPECT_EQ(p.cache_stats().warm_submitted, replayed + 4);
  // The met budget at load buckets 1.0 (the miss's plan), 1.05 (warm) and 1.1 (cold: the cap).
  const bool expect_warm[] = {false, true, false};
  for (int i = 0; i < 3; ++i) {
    SchedulePoint probe = point;
    probe.load_factor = 1.0 + 0.05 * i;
    auto plan = p.PlanPoint(probe);
    ASSERT_TRUE(plan.ok());
    ASSERT_EQ(plan->budget_bytes, met->budget_bytes);
    ASSERT_LT(plan->predicted_bytes, plan->keep_all_bytes) << probe.load_factor;
    EXPECT_EQ(plan->warm, expect_warm[i]) << "load " << probe.load_factor;
    p.ResetIteration();
  }
}

// The first planned point starts the warm-up at its host limit and bandwidth share; clearing the
// caches starts it again.
TEST(Warmup, TheFirstPointStartsItAndClearCachesRestartsIt) {
  auto made = Glm423(Warm(1.2));
  ASSERT_TRUE(made.ok());
  StagePlanner& p = **made;
  EXPECT_EQ(p.cache_stats().warm_rounds, 0u);
  ASSERT_TRUE(ReplayIteration(p, Loads(p, -1, 1)).ok());
  EXPECT_GT(p.cache_stats().warm_rounds, 0u);
  p.WaitForWarmup();
  EXPECT_GT(p.cache_stats().warm_keys, 0u);
  p.ClearCaches();
  EXPECT_EQ(p.cache_stats().warm_keys, 0u);
  ASSERT_TRUE(ReplayIteration(p, Loads(p, -1, 1)).ok());
  p.WaitForWarmup();
  EXPECT_GT(p.cache_stats().warm_keys, 0u);
}

}  // namespace
}  // namespace bgl::plan
