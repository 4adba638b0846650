// StreamScheduler: issues the offload (O) and recover (R) pieces of a plan's dual-batch issue
// order when compute reaches the stage boundary the plan names, in order, with at most
// `max_inflight` pieces issued but not complete.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "enforcer/allocator_names.h"
#include "governor/planner/dual_batch.h"

namespace bgl::enf {

// Carries out one O/R piece (queues its copies/casts) and reports when it completed.
class WorkIssuer {
 public:
  virtual ~WorkIssuer() = default;
  // Queues the work of `item`; *done gets an event after it (a null handle: already complete).
  virtual Status issue(const plan::IssueItem& item, Event* done, std::string* error) = 0;
  virtual bool query(const Event& e) = 0;
  virtual Status wait(const Event& e) = 0;
  virtual void release(const Event& /*e*/) {}
};

// See file comment. Not thread safe (the Enforcer's lock guards it).
class StreamScheduler {
 public:
  StreamScheduler(WorkIssuer* issuer, int max_inflight);

  // Loads an issue order. kInvalidArgument (and nothing loaded) when stages of a chain do not
  // increase, rounds decrease, or a chain/resource value is out of range.
  Status load(const std::vector<plan::IssueItem>& order, std::string* error);
  // Compute (chain F or B) reached the start of `stage`: O/R pieces of that round or earlier
  // become issuable. kInvalidArgument when no such compute stage is in the order.
  Status reached(plan::Chain chain, int stage, std::string* error);
  // Compute of chain F entered operator `op`, or compute of chain B needs what operator `op`
  // produced (indices of the planner's stage graph): every stage of that chain compute passed
  // since the last call is reached, as `reached` does for each, and *passed gets how many (0, the
  // common case: nothing else happens). The forward passes a stage once `op` is at or after the
  // stage's first operator, the backward once `op` is at or before it (a backward's stages run
  // from the chunk's last operator down). The one definition of where compute is in a point's
  // order (the integrations call it at every operator call and every unpack). op < 0: not a
  // planned operator, nothing passed. kInvalidArgument for a chain other than F and B.
  Status at(plan::Chain chain, int op, int* passed, std::string* error);
  // Retires completed pieces and issues what the frontier and the bound allow. The first issue
  // error is returned (that piece is skipped: its tensors stay where they are).
  Status pump(std::string* error);
  // Makes everything issuable, issues it all and waits for it. kBackendError when a piece did
  // not complete within the wait timeout (it stays in flight).
  Status finish(std::string* error);
  // Makes everything issuable and issues it all, waiting only while the bound holds an issue
  // back (for the oldest piece in flight); what is still in flight stays there, completing
  // beside the next order and counted against its bound (a copy engine has no barrier between
  // scheduling points). Errors as finish.
  Status hand_over(std::string* error);

  std::size_t waiting() const { return queue_.size(); }
  std::size_t inflight() const { return inflight_.size(); }
  std::uint64_t issued() const { return issued_; }
  std::size_t max_inflight_seen() const { return max_seen_; }
  int max_inflight() const { return max_inflight_; }

 private:
  struct Flight {
    plan::IssueItem item;
    Event done;
  };
  void retire();
  // finish (wait_all) and hand_over: every piece issuable, issued; waits for the oldest in
  // flight while the bound holds one back, and for all of them with wait_all.
  Status drain(bool wait_all, std::string* error);

  WorkIssuer* issuer_;
  int max_inflight_;
  std::deque<plan::IssueItem> queue_;  // O/R pieces not yet issued, in issue order
  // A compute stage of the loaded order: where it starts (its first operator) and its round.
  struct Mark {
    int first, stage, round;
  };
  // Per compute chain (F, B): its stages in the order compute passes them (F: first operator
  // ascending, B: descending), and how many compute passed (`at`).
  std::array<std::vector<Mark>, 2> marks_;
  std::array<std::size_t, 2> passed_{0, 0};
  std::deque<Flight> inflight_;
  int frontier_ = -1;  // highest round compute has reached
  std::uint64_t issued_ = 0;
  std::size_t max_seen_ = 0;
};

}  // namespace bgl::enf
