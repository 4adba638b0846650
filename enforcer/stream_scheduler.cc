#include "enforcer/stream_scheduler.h"

#include <algorithm>
#include <array>
#include <limits>

#include "allocator/detail/fault.h"

namespace bgl::enf {

StreamScheduler::StreamScheduler(WorkIssuer* issuer, int max_inflight)
    : issuer_(issuer), max_inflight_(max_inflight < 1 ? 1 : max_inflight) {}

Status StreamScheduler::load(const std::vector<plan::IssueItem>& order, std::string* error) {
  std::array<int, plan::kChainCount> last_stage{-1, -1, -1, -1};
  int last_round = std::numeric_limits<int>::min();
  for (std::size_t i = 0; i < order.size(); ++i) {
    const auto& it = order[i];
    const int c = static_cast<int>(it.chain);
    const std::string where = "issue item " + std::to_string(i);
    if (c >= plan::kChainCount) {
      *error = where + ": chain " + std::to_string(c) + " out of range";
      return Status::kInvalidArgument;
    }
    if (static_cast<int>(it.resource) >= plan::kResourceCount) {
      *error =
          where + ": resource " + std::to_string(static_cast<int>(it.resource)) + " out of range";
      return Status::kInvalidArgument;
    }
    if (it.stage <= last_stage[c]) {
      *error = where + ": stage " + std::to_string(it.stage) + " of chain " + std::to_string(c) +
               " does not follow stage " + std::to_string(last_stage[c]) +
               " (order inside a chain)";
      return Status::kInvalidArgument;
    }
    if (it.round < last_round) {
      *error = where + ": round " + std::to_string(it.round) + " after round " +
               std::to_string(last_round);
      return Status::kInvalidArgument;
    }
    last_stage[c] = it.stage;
    last_round = it.round;
  }
  queue_.clear();
  for (auto& m : marks_) m.clear();
  passed_ = {0, 0};
  frontier_ = -1;
  for (const auto& it : order) {
    if (it.chain == plan::Chain::kOffload || it.chain == plan::Chain::kRecover) {
      queue_.push_back(it);
    } else {
      marks_[static_cast<int>(it.chain)].push_back({it.first, it.stage, it.round});
    }
  }
  auto& f = marks_[static_cast<int>(plan::Chain::kForward)];
  auto& b = marks_[static_cast<int>(plan::Chain::kBackward)];
  std::stable_sort(f.begin(), f.end(),
                   [](const auto& x, const auto& y) { return x.first < y.first; });
  std::stable_sort(b.begin(), b.end(),
                   [](const auto& x, const auto& y) { return x.first > y.first; });
  return Status::kOk;
}

Status StreamScheduler::at(plan::Chain chain, int op, int* passed, std::string* error) {
  *passed = 0;
  if (chain != plan::Chain::kForward && chain != plan::Chain::kBackward) {
    *error = "schedule_at: chain must be forward (0) or backward (1), not " +
             std::to_string(static_cast<int>(chain));
    return Status::kInvalidArgument;
  }
  if (op < 0) return Status::kOk;
  const int c = static_cast<int>(chain);
  const auto& marks = marks_[c];
  std::size_t n = passed_[c];
  const bool forward = chain == plan::Chain::kForward;
  while (n < marks.size() && (forward ? marks[n].first <= op : marks[n].first >= op)) {
    frontier_ = std::max(frontier_, marks[n].round);
    ++n;
  }
  if (n == passed_[c]) return Status::kOk;
  *passed = static_cast<int>(n - passed_[c]);
  passed_[c] = n;
  return pump(error);
}

Status StreamScheduler::reached(plan::Chain chain, int stage, std::string* error) {
  if (chain != plan::Chain::kForward && chain != plan::Chain::kBackward) {
    *error = "schedule_reached: chain must be forward (0) or backward (1), not " +
             std::to_string(static_cast<int>(chain));
    return Status::kInvalidArgument;
  }
  const auto& marks = marks_[static_cast<int>(chain)];
  auto it =
      std::find_if(marks.begin(), marks.end(), [&](const Mark& m) { return m.stage == stage; });
  if (it == marks.end()) {
    *error = "schedule_reached: no stage " + std::to_string(stage) + " of chain " +
             std::to_string(static_cast<int>(chain)) + " in the loaded issue order";
    return Status::kInvalidArgument;
  }
  frontier_ = std::max(frontier_, it->round);
  return pump(error);
}

void StreamScheduler::retire() {
  // Pieces complete in any order across streams; retire every completed one.
  for (auto it = inflight_.begin(); it != inflight_.end();) {
    if (issuer_->query(it->done)) {
      issuer_->release(it->done);
      it = inflight_.erase(it);
    } else {
      ++it;
    }
  }
}

Status StreamScheduler::pump(std::string* error) {
  retire();
  Status first = Status::kOk;
  while (!queue_.empty() && queue_.front().round <= frontier_ &&
         inflight_.size() < static_cast<std::size_t>(max_inflight_)) {
    const plan::IssueItem item = queue_.front();
    queue_.pop_front();
    Event done;
    std::string why;
    const Status s = issuer_->issue(item, &done, &why);
    ++issued_;
    if (s != Status::kOk) {
      if (first == Status::kOk) {
        first = s;
        *error = why;
      }
      continue;
    }
    inflight_.push_back({item, done});
    max_seen_ = std::max(max_seen_, inflight_.size());
    retire();
  }
  return first;
}

Status StreamScheduler::finish(std::string* error) { return drain(/*wait_all=*/true, error); }

Status StreamScheduler::hand_over(std::string* error) { return drain(/*wait_all=*/false, error); }

Status StreamScheduler::drain(bool wait_all, std::string* error) {
  frontier_ = std::numeric_limits<int>::max();
  Status first = Status::kOk;
  while (true) {
    std::string why;
    const Status s = pump(&why);
    if (s != Status::kOk && first == Status::kOk) {
      first = s;
      *error = why;
    }
    if (queue_.empty() && (!wait_all || inflight_.empty())) break;
    if (inflight_.empty()) continue;  // pump issues the next one
    if (issuer_->wait(inflight_.front().done) != Status::kOk) {
      // Bounded (BGL_WAIT_TIMEOUT_MS): the piece stays in flight; a later pump retires it.
      if (first == Status::kOk) {
        first = Status::kBackendError;
        *error = alloc::detail::wait_timeout_message("a scheduled offload or reload");
      }
      return first;
    }
  }
  return first;
}

}  // namespace bgl::enf
