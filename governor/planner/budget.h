// Algorithm 1: the per-micro-batch activation budget from the pipeline phase, the capacity, M0
// and the consumption actually reported (paper V-A, docs/algorithms.md sec. 3).
#pragma once

#include <map>
#include <utility>

namespace bgl::plan {

// The budget of one forward and the numbers it came from.
struct BudgetDecision {
  double budget = 0;
  double free = 0;          // M_max - used at the time of the forward
  int k = 1;                // forwards sharing `free` before memory is next released
  bool infeasible = false;  // free < k * M0: pressure, evict (docs/algorithms.md sec. 6)
};

// budget = max(M0, free / k); infeasible when free < k * M0.
BudgetDecision AssignBudget(double m_max, double used, int k, double m0);

// Replays Algorithm 1 over a stage's steps: used grows by what each forward really retained and
// shrinks when its backward runs.
class BudgetTracker {
 public:
  BudgetTracker(double m_max, double m0) : m_max_(m_max), m0_(m0) {}

  // A micro-batch (of a chunk) starts its forward; k from ForwardsUntilNextBackward.
  BudgetDecision OnForward(int k) const { return AssignBudget(m_max_, used_, k, m0_); }
  // What the forward of (micro_batch, chunk) really retained (re-bases the estimate).
  void OnReport(int micro_batch, int chunk, double actual);
  // The backward of (micro_batch, chunk) ran: its activations are freed.
  void OnBackward(int micro_batch, int chunk);
  // The allocator's measurement replaces the running sum.
  void Rebase(double used) { used_ = used; }

  double used() const { return used_; }
  double m_max() const { return m_max_; }
  double m0() const { return m0_; }

 private:
  double m_max_;
  double m0_;
  double used_ = 0;
  std::map<std::pair<int, int>, double> live_;
};

}  // namespace bgl::plan
