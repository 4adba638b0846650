// The anytime path (issue 23): a plan-cache miss on a large chunk is answered with the first
// answer (the operator DP on a small front), the full search runs on the refiner's thread, and
// the next hit of the same key gets its plan. Also run under ThreadSanitizer (label tsan).
#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "governor/planner/iteration.h"
#include "governor/planner/mitigation.h"
#include "governor/planner/planner.h"
#include "governor/planner/refiner.h"

namespace bgl::plan {
namespace {

// The Table II GLM-423B-A30B stage (two layers of 14 operators per chunk) with copy engines at a
// twentieth of the paper's bandwidth, so plans have an overhead and the searches differ.
HardwareProfile SlowCopies() {
  HardwareProfile hw = *HardwareProfileByName("paper");
  hw.offload.peak_bytes_per_s /= 20;
  hw.reload.peak_bytes_per_s /= 20;
  return hw;
}

std::unique_ptr<StagePlanner> Glm423(int anytime_min_ops, int64_t refine_timeout_ms = 30000,
                                     int refine_nice = 0) {
  auto doc = LoadJsonOrYaml(std::string(BGL_MODELS_DIR) + "/glm-423b-a30b.json", "model");
  EXPECT_TRUE(doc.ok());
  (*doc)["micro_batches"] = 8;  // fewer points and keys: each refinement is a full search
  auto config = ModelConfigFromJson(*doc, "glm-423b-a30b.json");
  EXPECT_TRUE(config.ok()) << config.status().message();
  PlannerOptions options;
  options.capacity_bytes = int64_t{64} * 1000 * 1000 * 1000;
  options.anytime_min_ops = anytime_min_ops;  // the chunk has 28: on below, off at 0
  options.refine_timeout_ms = refine_timeout_ms;
  options.refine_nice = refine_nice;
  auto planner = StagePlanner::Create(*config, SlowCopies(), options);
  EXPECT_TRUE(planner.ok()) << planner.status().message();
  return std::move(planner).value();
}

// Two loads, so budgets and load buckets differ between micro-batches (few keys: each
// refinement is a full search).
std::vector<double> Loads(const StagePlanner& p) {
  std::vector<double> loads(static_cast<size_t>(p.config().MicroBatches()));
  for (size_t i = 0; i < loads.size(); ++i) loads[i] = i % 4 == 1 ? 2.6 : 1.0;
  return loads;
}

// The inputs a plan's cache key is planned for (the bucket's worst case, planner.cc).
struct KeyInputs {
  double r = 1, budget = 0;
  bool operator<(const KeyInputs& o) const { return r < o.r || (r == o.r && budget < o.budget); }
};
// The first answer and the full search at a key's inputs, computed once per key.
struct Answers {
  MitigationResult quick, full;
};
const Answers& AnswersAt(const StagePlanner& p, const KeyInputs& k) {
  static std::map<KeyInputs, Answers> memo;
  auto it = memo.find(k);
  if (it != memo.end()) return it->second;
  MitigationOptions fast;
  fast.fast = true;
  auto quick = SelectMitigation(p.evaluator(), k.r, k.budget, fast);
  auto full = SelectMitigation(p.evaluator(), k.r, k.budget, MitigationOptions{});
  EXPECT_TRUE(quick.ok() && full.ok());
  return memo.emplace(k, Answers{*quick, *full}).first->second;
}
KeyInputs InputsOf(const StagePlanner& p, const Plan& plan) {
  const PlannerOptions& o = p.options();
  KeyInputs k;
  k.r = std::ceil(plan.load_factor / o.load_bucket - 1e-9) * o.load_bucket;
  const double step = static_cast<double>(o.budget_step_bytes);
  k.budget =
      std::max(p.graph().M0(k.r), std::floor(static_cast<double>(plan.budget_bytes) / step) * step);
  return k;
}

// Replays iterations until one has no first answer left (every refinement landed), waiting for
// the refiner between iterations; returns the iterations' plans.
std::vector<IterationReplay> UntilRefined(StagePlanner& p, int max_iterations = 8) {
  std::vector<IterationReplay> out;
  for (int i = 0; i < max_iterations; ++i) {
    auto replay = ReplayIteration(p, Loads(p));
    EXPECT_TRUE(replay.ok());
    if (!replay.ok()) break;
    out.push_back(std::move(*replay));
    p.WaitForRefinements();
    bool first = false;
    for (const Plan& plan : out.back().plans) first |= plan.first_answer;
    if (!first) break;
  }
  return out;
}

TEST(Anytime, AMissAnswersWithTheFirstAnswerAndTheNextHitGetsTheRefinedPlan) {
  auto p = Glm423(/*anytime_min_ops=*/1);
  std::vector<IterationReplay> runs = UntilRefined(*p);
  ASSERT_GE(runs.size(), 2u);
  const PlannerCacheStats stats = p->cache_stats();
  // The first iteration's first mitigated point is a miss answered with the first answer; later
  // points may hit its key before or after its refinement landed (either is right). Every plan
  // flagged as a first answer is the operator DP on the small front, at the key's inputs.
  int first_answers = 0;
  for (const Plan& plan : runs[0].plans) {
    EXPECT_FALSE(plan.first_answer && plan.refined);
    if (first_answers == 0 && plan.refined) ADD_FAILURE() << "refined before any first answer";
    if (!plan.first_answer) continue;
    if (first_answers++ == 0) {
      EXPECT_FALSE(plan.cache_hit);
    }
    const MitigationResult& quick = AnswersAt(*p, InputsOf(*p, plan)).quick;
    EXPECT_TRUE(quick.first_answer);
    EXPECT_EQ(plan.strategies, quick.assignment);
    EXPECT_LE(plan.predicted_bytes, plan.budget_bytes);
  }
  EXPECT_GT(first_answers, 0);
  EXPECT_EQ(stats.first_answers, stats.refined + stats.refine_expired);
  EXPECT_EQ(stats.refine_expired, 0u);
  EXPECT_GT(stats.improved, 0u) << "the full search never beat the first answer here";
  // The last iteration: every mitigated plan is a hit of a refined key (or planned in full on the
  // call), never costlier than the first answer, and the full search's plan where that is cheaper.
  int refined = 0;
  for (const Plan& plan : runs.back().plans) {
    EXPECT_FALSE(plan.first_answer);
    if (!plan.refined) continue;
    ++refined;
    const Answers& answers = AnswersAt(*p, InputsOf(*p, plan));
    EXPECT_LE(plan.overhead_s, answers.quick.cost.exposed_s + 1e-15);
    if (answers.full.cost.exposed_s < answers.quick.cost.exposed_s) {
      EXPECT_EQ(plan.strategies, answers.full.assignment);
    } else {
      EXPECT_EQ(plan.strategies, answers.quick.assignment);
    }
    EXPECT_LE(plan.predicted_bytes, plan.budget_bytes);
  }
  EXPECT_GT(refined, 0);
  // The iteration's plans cost no more than the same iteration planned without the anytime path.
  auto exact = Glm423(/*anytime_min_ops=*/0);
  auto reference = ReplayIteration(*exact, Loads(*exact));
  ASSERT_TRUE(reference.ok());
  for (const Plan& plan : reference->plans) {
    EXPECT_FALSE(plan.first_answer);
    EXPECT_FALSE(plan.refined);
  }
  EXPECT_EQ(exact->cache_stats().first_answers, 0u);
  // Plan by plan, where both iterations planned the same forward within the same budget at the
  // same load (the budgets follow what earlier plans predicted, so the iterations may part).
  ASSERT_EQ(reference->plans.size(), runs.back().plans.size());
  int compared = 0;
  for (size_t i = 0; i < reference->plans.size(); ++i) {
    const Plan& anytime = runs.back().plans[i];
    const Plan& full = reference->plans[i];
    if (anytime.micro_batch != full.micro_batch || anytime.chunk != full.chunk ||
        anytime.budget_bytes != full.budget_bytes || anytime.load_factor != full.load_factor) {
      continue;
    }
    ++compared;
    EXPECT_LE(anytime.overhead_s, full.overhead_s + 1e-12) << "plan " << i;
  }
  EXPECT_GT(compared, 0) << "the two iterations planned no forward alike";
}

TEST(Anytime, DeterministicWhateverTheTiming) {
  // A planner that waits for the refiner after every iteration and one that plans three
  // iterations without waiting (its refinements land whenever they finish) end with the same
  // plans once every refinement has landed.
  auto a = Glm423(1), c = Glm423(1);
  std::vector<IterationReplay> ra = UntilRefined(*a);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(ReplayIteration(*c, Loads(*c)).ok());
  std::vector<IterationReplay> rc = UntilRefined(*c);
  const std::vector<Plan>& last_a = ra.back().plans;
  const std::vector<Plan>& last_c = rc.back().plans;
  ASSERT_EQ(last_a.size(), last_c.size());
  for (size_t j = 0; j < last_a.size(); ++j) {
    EXPECT_EQ(last_a[j].strategies, last_c[j].strategies) << "point " << j;
  }
}

TEST(Anytime, ShutdownWithRefinementsInFlight) {
  // The planner (and its refiner) goes while jobs are queued and one runs: the job in flight is
  // cancelled, the queue dropped, the worker joined.
  for (int round = 0; round < 2; ++round) {
    auto p = Glm423(1);
    ASSERT_TRUE(ReplayIteration(*p, Loads(*p)).ok());
    EXPECT_GT(p->cache_stats().first_answers, 0u);
    p.reset();
  }
  // ClearCaches with refinements in flight: they never enter the new cache.
  auto p = Glm423(1);
  ASSERT_TRUE(ReplayIteration(*p, Loads(*p)).ok());
  p->ClearCaches();
  p->WaitForRefinements();
  EXPECT_EQ(p->cache_stats().refined, 0u);
  EXPECT_EQ(p->refinements_pending(), 0u);
  // A Refiner on its own, destroyed at once after a submit.
  Refiner refiner(p->graph(), 0);
  RefineJob job;
  job.hw = p->hardware();
  job.r = 1;
  job.budget = p->graph().M0(1);
  job.first_answer = FullRecompute(p->evaluator());
  job.first_exposed_s = 1;
  refiner.Submit(job);
}

TEST(Anytime, Deadlines) {
  auto p = Glm423(1);
  const std::vector<double> loads = Loads(*p);
  // A cancelled call: the first answer is not computed, nothing is submitted, state unchanged.
  std::atomic<bool> cancel{true};
  SchedulePoint point;
  point.forward_micro_batch = 0;
  point.load_factor = 2.6;
  point.bytes_in_use = 0;
  // The budget of a point after the whole warmup would pass keep-all; the first point of the
  // stage with nothing in use does too, so the test shrinks the budget through bytes_in_use.
  point.bytes_in_use = static_cast<int64_t>(p->activation_capacity() - 1.5 * p->m0());
  auto refused = p->PlanPoint(point, Deadline(0, &cancel));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(p->cache_stats().first_answers, 0u);
  EXPECT_EQ(p->refinements_pending(), 0u);
  // The same call with a live deadline: a first answer; its refinement is not bound by the call's
  // deadline (which is gone when the refiner runs) but by refine_timeout_ms.
  std::atomic<bool> keep_going{false};
  auto planned = p->PlanPoint(point, Deadline(60000, &keep_going));
  ASSERT_TRUE(planned.ok()) << planned.status().message();
  EXPECT_TRUE(planned->first_answer);
  p->WaitForRefinements();
  EXPECT_EQ(p->cache_stats().refined, 1u);
  // refine_timeout_ms of 1 ms: each refinement lands or expires (its first answer then stays and
  // keeps its flag); none is lost either way.
  auto tight = Glm423(1, /*refine_timeout_ms=*/1);
  ASSERT_TRUE(ReplayIteration(*tight, loads).ok());
  tight->WaitForRefinements();
  const PlannerCacheStats s = tight->cache_stats();
  EXPECT_GT(s.first_answers, 0u);
  EXPECT_EQ(s.first_answers, s.refined + s.refine_expired);
  auto again = ReplayIteration(*tight, loads);
  ASSERT_TRUE(again.ok());
  for (const Plan& plan : again->plans) {
    EXPECT_FALSE(plan.first_answer && plan.refined);
    if (plan.first_answer && plan.cache_hit) {
      EXPECT_GT(s.refine_expired, 0u);
    }
  }
}

// The nice values of this process's threads (Linux: /proc/self/task/<tid>/stat, field 19).
std::vector<int> ThreadNices() {
  std::vector<int> out;
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return out;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream f(std::string("/proc/self/task/") + e->d_name + "/stat");
    std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const size_t close = text.rfind(')');  // the command may hold spaces
    if (close == std::string::npos) continue;
    std::istringstream rest(text.substr(close + 2));
    std::string field;
    for (int i = 3; i <= 19 && rest >> field; ++i) {
      if (i == 19) out.push_back(std::stoi(field));
    }
  }
  closedir(dir);
  return out;
}

int ThreadsAtNice(int nice) {
  int n = 0;
  for (const int v : ThreadNices()) n += v == nice;
  return n;
}

// The first answers' refinements run on a worker thread at refine_nice (the package's embedded
// planner asks for 19: in a training process it takes only the CPU training leaves; 0 by
// default); outside [0, 19] is refused by name.
TEST(Anytime, TheRefinerRunsAtRefineNice) {
  if (getpriority(PRIO_PROCESS, 0) >= 19) GTEST_SKIP() << "this process runs at nice 19 already";
  const int before = ThreadsAtNice(19);
  auto lowered = Glm423(1, 30000, 19);
  int seen = before;
  for (int i = 0; i < 200 && seen == before; ++i) {  // the worker lowers itself as it starts
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    seen = ThreadsAtNice(19);
  }
  EXPECT_EQ(seen, before + 1);
  lowered.reset();
  EXPECT_EQ(ThreadsAtNice(19), before);
  auto kept = Glm423(1);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(ThreadsAtNice(19), before);
  kept.reset();
  auto doc = LoadJsonOrYaml(std::string(BGL_MODELS_DIR) + "/glm-423b-a30b.json", "model");
  ASSERT_TRUE(doc.ok());
  auto config = ModelConfigFromJson(*doc, "glm-423b-a30b.json");
  ASSERT_TRUE(config.ok());
  // Either thread's priority out of range is refused naming its field (the warm-up's too).
  for (const std::string field : {"refine_nice", "warm_nice"}) {
    for (int bad : {-1, 20}) {
      PlannerOptions options;
      options.capacity_bytes = int64_t{64} * 1000 * 1000 * 1000;
      (field == "refine_nice" ? options.refine_nice : options.warm_nice) = bad;
      auto p = StagePlanner::Create(*config, SlowCopies(), options);
      ASSERT_FALSE(p.ok()) << field << " " << bad;
      EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
      EXPECT_NE(
          p.status().message().find(field + ": must be in [0, 19], got " + std::to_string(bad)),
          std::string::npos)
          << p.status().message();
    }
  }
}

}  // namespace
}  // namespace bgl::plan
