// SharedPlans: the warm-up's plans shared by the planners of several sessions (issue 43: the
// ranks of one job whose stage graph, calibration and options are equal; the daemon decides who
// shares, governor_core.cc). A planner claims a key before its warm-up worker searches it, so no
// two planners search the same key, and publishes the plan when it lands; another planner whose
// point meets the key serves that plan as a warm hit. The plans belong to the SharedPlans, not to
// the planner that made them: a session ending (its planner destroyed) releases its claims on
// keys not landed yet and leaves its published plans to the others. Thread-safe: every method
// takes one mutex (planners call it from their own calling threads, never from their workers).
#pragma once

#include <cstddef>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <utility>

#include "governor/planner/assignment.h"
#include "governor/planner/plan_cache.h"

namespace bgl::plan {

class SharedPlans {
 public:
  // A landed warm-up plan: the assignment, the load it was planned for and whether it is the
  // full-recompute fallback.
  struct Entry {
    Assignment assignment;
    double planned_r = 1;
    bool fallback = false;
  };

  // At most `capacity` published plans (later ones are not shared; their planner keeps them).
  explicit SharedPlans(size_t capacity = 4096) : capacity_(capacity) {}

  // Claims `key` for the caller's warm-up: false when a plan for it is published or another
  // planner claimed it first.
  bool Claim(const MitigationKey& key) {
    std::lock_guard<std::mutex> lock(mu_);
    if (plans_.count(key) > 0) return false;
    return claimed_.insert(key).second;
  }
  // Gives up a claim whose search never landed (the planner ended, cleared its caches, or the
  // search expired), so another planner's warm-up may search the key.
  void Release(const MitigationKey& key) {
    std::lock_guard<std::mutex> lock(mu_);
    claimed_.erase(key);
  }
  // Publishes the plan of a claimed key (the claim ends: the key now has a plan).
  void Publish(const MitigationKey& key, Entry entry) {
    std::lock_guard<std::mutex> lock(mu_);
    claimed_.erase(key);
    if (plans_.size() < capacity_) plans_.emplace(key, std::move(entry));
  }
  std::optional<Entry> Find(const MitigationKey& key) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = plans_.find(key);
    if (it == plans_.end()) return std::nullopt;
    return it->second;
  }
  size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return plans_.size();
  }
  size_t claimed() const {
    std::lock_guard<std::mutex> lock(mu_);
    return claimed_.size();
  }

 private:
  const size_t capacity_;
  mutable std::mutex mu_;
  std::map<MitigationKey, Entry> plans_;
  std::set<MitigationKey> claimed_;
};

}  // namespace bgl::plan
