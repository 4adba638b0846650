#include "governor/planner/budget.h"

#include <algorithm>

namespace bgl::plan {

BudgetDecision AssignBudget(double m_max, double used, int k, double m0) {
  BudgetDecision d;
  d.k = std::max(k, 1);
  d.free = m_max - used;
  if (d.free < d.k * m0) {
    d.infeasible = true;
    d.budget = m0;
    return d;
  }
  d.budget = std::max(m0, d.free / d.k);
  return d;
}

void BudgetTracker::OnReport(int micro_batch, int chunk, double actual) {
  auto& slot = live_[{micro_batch, chunk}];
  used_ += actual - slot;
  slot = actual;
}

void BudgetTracker::OnBackward(int micro_batch, int chunk) {
  auto it = live_.find({micro_batch, chunk});
  if (it == live_.end()) return;
  used_ -= it->second;
  live_.erase(it);
}

}  // namespace bgl::plan
