#include "enforcer/pinned_pool.h"

#include <bit>

namespace bgl::enf {

using alloc::format_bytes;

PinnedPool::PinnedPool(DeviceOps* ops, std::size_t capacity) : ops_(ops) {
  stats_.capacity = capacity;
}

void PinnedPool::set_capacity(std::size_t capacity) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.capacity = capacity;
  reap(/*wait=*/false);
  const std::size_t held = stats_.in_use + stats_.cached;
  if (held > capacity) release_cached(held - capacity);
}

PinnedPool::~PinnedPool() {
  std::lock_guard<std::mutex> lock(mu_);
  // Until every copy is done, however long: a block a stalled copy still uses is never freed.
  while (!pending_.empty()) reap(/*wait=*/true);
  for (auto& [p, n] : size_) ops_->host_free(p);
}

std::size_t PinnedPool::round(std::size_t bytes) {
  constexpr std::size_t kPage = 4096;
  if (bytes <= kPage) return kPage;
  if (bytes <= (std::size_t{1} << 20)) return (bytes + kPage - 1) / kPage * kPage;
  // Larger: eight size classes per power of two, so reuse wastes at most 12.5%.
  const std::size_t step = std::bit_floor(bytes) / 8;
  return (bytes + step - 1) / step * step;
}

void PinnedPool::reap(bool wait) {
  std::size_t kept = 0;
  for (auto& pe : pending_) {
    // A wait that timed out (a stalled copy) leaves the block pending: it is not reused.
    // A null event (a stream with nothing queued) is complete.
    auto done = [&](const Event& e) {
      return e.handle == nullptr || (wait && ops_->wait(e) == Status::kOk) || ops_->query(e);
    };
    if (done(pe.event) && done(pe.also)) {
      if (pe.event.handle != nullptr) ops_->release(pe.event);
      if (pe.also.handle != nullptr) ops_->release(pe.also);
      cache(pe.p);
    } else {
      pending_[kept++] = pe;
    }
  }
  pending_.resize(kept);
}

void PinnedPool::cache(void* p) {
  const std::size_t n = size_.at(p);
  stats_.in_use -= n;
  stats_.cached += n;
  free_.emplace(n, p);
}

std::size_t PinnedPool::release_cached(std::size_t goal) {
  std::size_t released = 0;
  // Largest first: fewest calls into the (slow) host allocator.
  while (released < goal && !free_.empty()) {
    auto it = std::prev(free_.end());
    ops_->host_free(it->second);
    size_.erase(it->second);
    stats_.cached -= it->first;
    released += it->first;
    ++stats_.releases;
    free_.erase(it);
  }
  return released;
}

Status PinnedPool::allocate(std::size_t bytes, void** out, std::string* error) {
  const std::size_t n = round(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  reap(/*wait=*/false);
  ++stats_.allocs;
  // Exact size class, or a cached block at most 25% larger.
  auto it = free_.lower_bound(n);
  if (it != free_.end() && it->first <= n + n / 4) {
    *out = it->second;
    stats_.cached -= it->first;
    stats_.in_use += it->first;
    stats_.peak = std::max(stats_.peak, stats_.in_use);
    free_.erase(it);
    ++stats_.hits;
    return Status::kOk;
  }
  ++stats_.misses;
  auto fail = [&](const std::string& why) {
    ++stats_.failures;
    *error = "pinned host pool exhausted: need " + format_bytes(n) + " for a copy of " +
             format_bytes(bytes) + "; in use " + format_bytes(stats_.in_use) + " of capacity " +
             format_bytes(stats_.capacity) + why;
    return Status::kPinnedExhausted;
  };
  if (n > stats_.capacity || stats_.in_use > stats_.capacity - n) {
    // Blocks whose last copy is still queued count as in use; wait for them only if that helps.
    std::size_t pending_bytes = 0;
    for (auto& pe : pending_) pending_bytes += size_.at(pe.p);
    if (n > stats_.capacity || stats_.in_use - pending_bytes > stats_.capacity - n) return fail("");
    reap(/*wait=*/true);
    if (stats_.in_use > stats_.capacity - n) {
      return fail(" (a copy from pinned memory did not complete: " + ops_->last_error() + ")");
    }
  }
  if (stats_.in_use + stats_.cached > stats_.capacity - n) {
    release_cached(stats_.in_use + stats_.cached - (stats_.capacity - n));
  }
  void* p = ops_->host_alloc(n);
  if (p == nullptr) {
    release_cached(SIZE_MAX);  // fragmentation of the host heap: retry once with nothing cached
    p = ops_->host_alloc(n);
    if (p == nullptr) return fail(" (the system refused: " + ops_->last_error() + ")");
  }
  size_[p] = n;
  stats_.in_use += n;
  stats_.peak = std::max(stats_.peak, stats_.in_use);
  *out = p;
  return Status::kOk;
}

void PinnedPool::free_after(void* p, const Event& after) {
  if (p == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (after.handle == nullptr || ops_->query(after)) {
    ops_->release(after);
    cache(p);
  } else {
    pending_.push_back({p, after, Event{}});
  }
}

void PinnedPool::free_after_both(void* p, const Event& first, const Event& second) {
  if (p == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  pending_.push_back({p, first, second});
  reap(/*wait=*/false);
}

std::size_t PinnedPool::trim() {
  std::lock_guard<std::mutex> lock(mu_);
  reap(/*wait=*/false);
  return release_cached(SIZE_MAX);
}

PinnedStats PinnedPool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace bgl::enf
