// Plan caches (paper V-B "memorizing"): assignments keyed by (phase, chunk, discretised budget,
// load bucket) and issue orders keyed by what the four units of a scheduling point run.
// Bounded (least recently used goes first) and counted.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <optional>
#include <tuple>

namespace bgl::plan {

// The discretised inputs that determine an assignment.
struct MitigationKey {
  int phase = 0;
  int chunk = 0;
  int64_t budget_bucket = 0;  // floor(budget / step)
  int64_t load_bucket = 0;    // ceil(r / bucket)
  int64_t host_bucket = -1;   // floor(host limit / step); -1: no limit
  int share_bucket = 0;       // bandwidth share in kShareSteps-ths (planner.h)
  bool valid = false;         // false: no such unit at this point

  auto Tie() const {
    return std::tie(valid, phase, chunk, budget_bucket, load_bucket, host_bucket, share_bucket);
  }
  bool operator<(const MitigationKey& o) const { return Tie() < o.Tie(); }
  bool operator==(const MitigationKey& o) const { return Tie() == o.Tie(); }
};

// What one unit of a scheduling point runs: its chunk, its assignment (interned id; -1: the
// unit is absent) and its load class.
struct UnitKey {
  int chunk = 0;
  int assignment = -1;
  int64_t load_class = 0;

  auto Tie() const { return std::tie(assignment, chunk, load_class); }
  bool operator<(const UnitKey& o) const { return Tie() < o.Tie(); }
};

// The four units of a point (F, B, O, R) and the bandwidth share the copies run at.
struct ScheduleKey {
  std::array<UnitKey, 4> units;
  int share_bucket = 0;

  bool operator<(const ScheduleKey& o) const {
    if (share_bucket != o.share_bucket) return share_bucket < o.share_bucket;
    return units < o.units;
  }
};

// Hit and miss counters of one cache.
struct CacheCounters {
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t evictions = 0;
  size_t entries = 0;
};

// A least-recently-used map with counters. Not thread-safe: its owner's thread.
template <typename Key, typename Value>
class LruCache {
 public:
  explicit LruCache(size_t capacity) : capacity_(capacity) {}

  // Called with each entry the capacity pushes out, before it goes.
  void set_on_evict(std::function<void(const Key&, const Value&)> on_evict) {
    on_evict_ = std::move(on_evict);
  }
  size_t capacity() const { return capacity_; }

  const Value* Find(const Key& key) {
    auto it = index_.find(key);
    if (it == index_.end()) {
      ++counters_.misses;
      return nullptr;
    }
    ++counters_.hits;
    order_.splice(order_.begin(), order_, it->second);
    return &it->second->second;
  }

  // The entry under `key` or null, without counting or reordering (to update it in place).
  Value* Peek(const Key& key) {
    auto it = index_.find(key);
    return it == index_.end() ? nullptr : &it->second->second;
  }

  const Value& Insert(const Key& key, Value value) {
    auto it = index_.find(key);
    if (it != index_.end()) {
      it->second->second = std::move(value);
      order_.splice(order_.begin(), order_, it->second);
      return it->second->second;
    }
    order_.emplace_front(key, std::move(value));
    index_[key] = order_.begin();
    if (order_.size() > capacity_) {
      if (on_evict_) on_evict_(order_.back().first, order_.back().second);
      index_.erase(order_.back().first);
      order_.pop_back();
      ++counters_.evictions;
    }
    return order_.front().second;
  }

  // Visits each entry whose key is in [lo, hi), in key order, without counting or reordering.
  template <typename F>
  void ForEachIn(const Key& lo, const Key& hi, F&& visit) const {
    for (auto it = index_.lower_bound(lo); it != index_.end() && it->first < hi; ++it) {
      visit(it->first, it->second->second);
    }
  }

  void Clear() {
    order_.clear();
    index_.clear();
  }
  CacheCounters counters() const {
    CacheCounters c = counters_;
    c.entries = order_.size();
    return c;
  }

 private:
  size_t capacity_;
  std::list<std::pair<Key, Value>> order_;
  std::map<Key, typename std::list<std::pair<Key, Value>>::iterator> index_;
  CacheCounters counters_;
  std::function<void(const Key&, const Value&)> on_evict_;
};

}  // namespace bgl::plan
