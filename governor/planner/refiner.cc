#include "governor/planner/refiner.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <limits>
#include <utility>

#include "governor/planner/deadline.h"

namespace bgl::plan {

Refiner::Refiner(const StageGraph& graph, int64_t limit_ms, int nice)
    : graph_(graph), limit_ms_(limit_ms), nice_(nice), worker_([this] { Run(); }) {}

Refiner::~Refiner() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_.store(true, std::memory_order_relaxed);
    queue_.clear();
    warm_queue_.clear();
  }
  work_.notify_all();
  idle_.notify_all();
  worker_.join();
}

void Refiner::Submit(RefineJob job, bool ahead) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_.load(std::memory_order_relaxed)) return;
    if (job.warm && ahead) {
      // Ahead of the queued warm-up jobs, lowest load bucket first (in submission order within
      // one): the loads a run meets most, at every budget it met, before the rarer spikes.
      auto at = std::find_if(queue_.begin(), queue_.end(), [&](const RefineJob& queued) {
        return queued.warm && queued.key.load_bucket > job.key.load_bucket;
      });
      queue_.insert(at, std::move(job));
    } else {
      (job.warm ? warm_queue_ : queue_).push_back(std::move(job));
    }
  }
  work_.notify_one();
}

std::vector<RefineDone> Refiner::TakeDone() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<RefineDone> out;
  out.swap(done_);
  done_count_.store(0, std::memory_order_release);
  return out;
}

void Refiner::DropQueued() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.clear();
    warm_queue_.clear();
  }
  idle_.notify_all();
}

void Refiner::WaitIdle() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_.wait(lock, [&] {
    return stopping_.load(std::memory_order_relaxed) ||
           (queue_.empty() && warm_queue_.empty() && running_ == 0);
  });
}

size_t Refiner::Pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.size() + warm_queue_.size() + running_;
}

size_t Refiner::WarmQueued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return warm_queue_.size();
}

namespace {

double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

}  // namespace

void Refiner::Run() {
  if (nice_ > 0) {  // this thread only (Linux: a thread's own priority)
    (void)setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), nice_);
  }
  for (;;) {
    RefineJob job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_.wait(lock, [&] {
        return stopping_.load(std::memory_order_relaxed) || !queue_.empty() || !warm_queue_.empty();
      });
      if (stopping_.load(std::memory_order_relaxed)) return;
      std::deque<RefineJob>& from = queue_.empty() ? warm_queue_ : queue_;
      job = std::move(from.front());
      from.pop_front();
      ++running_;
    }
    RefineDone done;
    done.key = job.key;
    done.generation = job.generation;
    done.r = job.r;
    done.assignment = job.first_answer;
    done.warm = job.warm;
    const double cpu0 = ThreadCpuSeconds();
    CostEvaluator eval(graph_, job.hw);
    const Deadline deadline(limit_ms_, &stopping_);
    eval.set_deadline(&deadline);
    try {
      if (job.warm) {
        // The key's first answer too (well under a millisecond), so the warm plan is what a
        // miss's first answer and its refinement together would leave: the cheaper.
        MitigationOptions fast = job.options;
        fast.fast = true;
        Result<MitigationResult> first = SelectMitigation(eval, job.r, job.budget, fast);
        job.first_exposed_s = std::numeric_limits<double>::infinity();
        if (first.ok()) {
          if (first->fits && !first->cost.conflict) job.first_exposed_s = first->cost.exposed_s;
          done.assignment = std::move(first->assignment);
          done.fallback_full_recompute = first->fallback_full_recompute;
          done.improved = true;  // a plan for the key
        }
      }
      Result<MitigationResult> full = SelectMitigation(eval, job.r, job.budget, job.options);
      if (full.ok() &&
          ((full->fits && !full->cost.conflict && full->cost.exposed_s < job.first_exposed_s) ||
           (job.warm && !done.improved))) {
        done.assignment = std::move(full->assignment);
        done.fallback_full_recompute = full->fallback_full_recompute;
        done.improved = true;
      }
    } catch (const detail::DeadlineExpired&) {
      done.expired = true;
    }
    done.cpu_s = ThreadCpuSeconds() - cpu0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      --running_;
      if (!stopping_.load(std::memory_order_relaxed)) {
        done_.push_back(std::move(done));
        done_count_.store(done_.size(), std::memory_order_release);
      }
    }
    idle_.notify_all();
  }
}

}  // namespace bgl::plan
