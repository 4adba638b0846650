// The anytime path's background refinement (issue 23). A plan-cache miss on a large chunk is
// answered at once with the first answer (MitigationOptions::fast: the operator DP on a small
// front); the Refiner then runs the full search (the greedy, the layer search, the operator DP at
// dp_states) for the same cache key on one worker thread, off the caller's critical path, and
// hands the cheaper of the two back for the planner to put in its cache under that key.
//
// Deterministic: a job's answer depends only on the job (the graph, the hardware, the load, the
// budget and the options), never on timing; only when it becomes visible does. Jobs run one at a
// time in submission order, a miss's refinement before any warm-up job (issue 43: the warm-up's
// jobs, RefineJob::warm, wait in their own queue and run when no miss is waiting).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "governor/planner/assignment.h"
#include "governor/planner/hardware.h"
#include "governor/planner/mitigation.h"
#include "governor/planner/plan_cache.h"
#include "governor/planner/stage_graph.h"

namespace bgl::plan {

// One full search to run: the cache key it answers and the inputs the first answer had.
// A plain value.
struct RefineJob {
  MitigationKey key;
  uint64_t generation = 0;  // the planner's cache generation when the job was made
  HardwareProfile hw;       // the hardware at the key's bandwidth share
  double r = 1;
  double budget = 0;
  MitigationOptions options;  // the full search's (fast off)
  Assignment first_answer;    // what the cache holds until the refinement lands
  double first_exposed_s = 0;
  // The warm-up's job (issue 43): the key not met yet; the worker computes its first answer
  // too and hands back the cheaper of that and the full search (RefineDone::improved: a plan).
  bool warm = false;
};

// A finished job: the assignment to cache under `key` (never costlier than the first answer).
// A plain value.
struct RefineDone {
  MitigationKey key;
  uint64_t generation = 0;
  double r = 1;
  Assignment assignment;
  bool fallback_full_recompute = false;
  bool improved = false;  // cheaper than the first answer (else the first answer is kept)
  bool expired = false;   // the refinement ran past its time limit: the first answer stays
  bool warm = false;      // RefineJob::warm
  double cpu_s = 0;       // the worker thread's CPU time on this job
};

// Threading: every public method may be called from any thread; the worker thread reads only
// the Refiner's own copy of the graph and the jobs' values. The destructor cancels the job in
// flight (the search checks a cancel flag), drops the queued ones and joins the worker.
class Refiner {
 public:
  // `graph` is copied; `limit_ms` bounds each job (<= 0: no limit); `nice` > 0: the worker
  // thread lowers its own priority to it (Linux setpriority; ignored where refused).
  Refiner(const StageGraph& graph, int64_t limit_ms, int nice = 0);
  ~Refiner();
  Refiner(const Refiner&) = delete;
  Refiner& operator=(const Refiner&) = delete;

  // `ahead`: before the queued warm-up jobs (with the misses' refinements); a warm-up job sent
  // ahead goes before those of a higher load bucket sent ahead earlier.
  void Submit(RefineJob job, bool ahead = false);
  // The jobs finished since the last call, in submission order.
  std::vector<RefineDone> TakeDone();
  // Drops the queued jobs (the one running finishes; its result is still handed back).
  void DropQueued();
  // Blocks until every submitted job has finished (or the Refiner is stopping).
  void WaitIdle();
  // Jobs queued or running.
  size_t Pending() const;
  // Warm-up jobs queued (not yet running).
  size_t WarmQueued() const;
  // Whether TakeDone() has something (lock-free: the planner's hit path asks on every point).
  bool HasDone() const { return done_count_.load(std::memory_order_acquire) > 0; }

 private:
  void Run();

  const StageGraph graph_;
  const int64_t limit_ms_;
  const int nice_;
  mutable std::mutex mu_;
  std::condition_variable work_;      // a job was queued, or stopping
  std::condition_variable idle_;      // a job finished
  std::deque<RefineJob> queue_;       // the misses' refinements, first
  std::deque<RefineJob> warm_queue_;  // the warm-up's jobs, when queue_ is empty
  std::vector<RefineDone> done_;
  size_t running_ = 0;
  std::atomic<size_t> done_count_{0};  // done_.size()
  std::atomic<bool> stopping_{false};
  std::thread worker_;  // last: started once the members above exist
};

}  // namespace bgl::plan
