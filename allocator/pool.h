// Pool: the caching allocator of one device over a Backend (best fit, split and merge,
// stream-ordered reuse, page-granular growth on a reserved range, release under pressure).
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "allocator/backend.h"
#include "allocator/block.h"
#include "allocator/error.h"
#include "allocator/export.h"
#include "allocator/history.h"
#include "allocator/ptr_map.h"
#include "allocator/stats.h"

namespace bgl::alloc {

// Pool policy knobs (parsed from BGL_ALLOC_CONF by Config).
struct PoolOptions {
  // Capacity limit: limit_bytes if non-zero, else limit_fraction of the physical capacity.
  std::size_t limit_bytes = 0;
  double limit_fraction = 1.0;
  // Requests up to this size use the small arena (kept apart so small long-lived blocks do
  // not pin pages between large ones).
  std::size_t small_max = std::size_t{1} << 20;
  // Size classes: 0 rounds to 512 bytes; N > 0 splits each power-of-two interval into N steps.
  unsigned round_divisions = 0;
  // Defragment on growth: when mapping more would put reserved bytes above
  // (allocated + request) * (1 + defrag_slack), first unmap free pages elsewhere.
  bool defrag = true;
  double defrag_slack = 0.02;
  // Segment size of the small arena in segment (non-expandable) mode.
  std::size_t small_segment = std::size_t{2} << 20;
  // History ring entries (0: off).
  std::size_t history = 0;
  // Echo errors to stderr.
  bool log = true;
};

// Called when memory is short: free about `bytes_needed` (e.g. evict activations) and return
// the bytes freed. Runs without the pool lock; it may free pool memory.
using PressureCallback = std::function<std::size_t(int device, std::size_t bytes_needed)>;
// Called after memory is mapped (mapped=true) or before it is unmapped (mapped=false), e.g. to
// register it with NCCL. Runs under the pool lock: it must not call back into the allocator.
using SegmentHook = std::function<void(int device, void* addr, std::size_t bytes, bool mapped)>;

// A block as reported in a snapshot.
struct BlockInfo {
  std::uintptr_t addr;
  std::size_t size;
  std::size_t requested;
  BlockState state;
  Stream stream;
};
// A contiguous mapped range (segment) with its blocks, in address order.
struct SegmentInfo {
  std::uintptr_t addr;
  std::size_t size;
  bool small;
  bool expandable;
  Stream stream;
  std::vector<BlockInfo> blocks;
};

// Internal: one address range family (small or large requests).
struct Arena {
  using FreeSet = std::set<Block*, FreeOrder>;
  bool small = false;
  std::uintptr_t base = 0;  // expandable: the reservation
  std::size_t va_size = 0;
  FreeSet free;
  std::vector<FreeSet::node_type> spare_nodes;  // recycled set nodes: no malloc per insert
  std::set<Block*, AddrOrder> unmapped;
  std::set<Block*, AddrOrder> heads;  // first block of each region
};

// See file comment. Thread safe.
class BGL_ALLOC_INTERNAL Pool {
 public:
  Pool(std::unique_ptr<Backend> backend, const PoolOptions& options);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // Memory for `bytes` usable in order on `stream`; null on failure (see last_error()).
  void* allocate(std::size_t bytes, Stream stream);
  // Frees `ptr`. `bytes` (0: unchecked) must be the size asked for. `stream` is where it was
  // last used; if it is not the allocation stream it is treated as record_stream(ptr, stream).
  Status deallocate(void* ptr, std::size_t bytes, Stream stream);
  // Marks `ptr` as used on `stream` too: on free, it is reused only after that work completes.
  Status record_stream(void* ptr, Stream stream);

  // Waits for pending frees and unmaps every free page; returns bytes released.
  std::size_t empty_cache();
  Stats stats() const;
  // The backend's mapping page (segment rounding for segment backends).
  std::size_t page_size() const { return page_; }
  void reset_peak_stats();
  std::vector<SegmentInfo> segments() const;
  std::vector<TraceEntry> history() const;
  bool history_overflowed() const;
  void set_history(std::size_t max_entries);

  int add_pressure_callback(PressureCallback cb);
  void remove_pressure_callback(int id);
  int add_segment_hook(SegmentHook hook);
  void remove_segment_hook(int id);

  // True when `ptr` lies in memory this pool manages (mapped or reserved).
  bool contains(const void* ptr) const;
  // True when `ptr` is a live allocation of this pool.
  bool is_allocated(const void* ptr) const;
  // Counts a bad-input event detected outside the pool (free naming the wrong device).
  void count_wrong_device();
  // Counts a zero-byte request in num_invalid_size without a message (the C ABI's bgl_alloc(0):
  // PyTorch asks for empty tensors, so it is normal there and must stay quiet).
  void count_empty_request();
  // Block size a request of `bytes` is rounded to.
  std::size_t round_size(std::size_t bytes) const;
  std::size_t limit() const { return limit_; }
  int device() const { return backend_->device(); }
  Backend& backend() { return *backend_; }
  const PoolOptions& options() const { return options_; }
  // Checks the block structure (links, coverage, merge, index and counter consistency);
  // on failure returns false and says why. For tests.
  bool check_invariants(std::string* why) const;

 private:
  struct PendingFree {
    Event event;
    Block* block;
  };
  struct Steal {
    Event event;
    Stream stream;
    std::uint64_t seq;
  };

  Arena& arena_for(std::size_t rounded) { return rounded <= options_.small_max ? small_ : large_; }
  void init_arena(Arena& a, bool small);
  Block* find_fit(Arena& a, Stream s, std::size_t n);
  Block* allocate_slow(Arena& a, Stream s, std::size_t n, std::size_t requested,
                       std::unique_lock<std::mutex>& lock);
  Block* grow(Arena& a, Stream s, std::size_t n);
  Block* grow_expandable(Arena& a, Stream s, std::size_t n);
  Block* grow_segment(Arena& a, Stream s, std::size_t n);
  Block* map_range(Arena& a, Block* u, std::uintptr_t addr, std::size_t bytes, Stream s);
  Block* split_at(Block* b, std::uintptr_t at);
  Block* take(Block* b, std::size_t n, std::size_t requested, Stream s);
  void insert_free(Block* b);
  Block* merge_free(Block* b);
  Block* merge_unmapped(Block* b);
  static bool mergeable(const Block* a, const Block* b);
  void erase_free(Block* b);
  void index_free(Block* b);
  void process_events();
  bool steal(bool wait);
  void mark_ready(Stream s, std::uint64_t seq);
  void wait_all();
  std::size_t release_free(std::size_t goal);
  std::size_t release_block(Block* b);
  void free_block(Block* b);
  void trace(Action a, std::uintptr_t addr, std::size_t size, Stream s);
  void fail_oom(std::size_t requested, std::size_t rounded, const std::string& why);
  void fill_computed(Stats* st) const;
  Block* find_block_at(std::uintptr_t addr) const;
  Block* new_block();
  void delete_block(Block* b);
  void call_hooks(std::uintptr_t addr, std::size_t bytes, bool mapped);

  std::unique_ptr<Backend> backend_;
  PoolOptions options_;
  std::size_t limit_ = 0;
  std::string injected_;  // the injected growth failure of the allocation under way (fault.h)
  std::size_t page_ = 0;
  bool expandable_ = false;

  mutable std::mutex mu_;
  Arena small_, large_;
  PtrMap live_;
  std::vector<PendingFree> pending_;
  std::vector<Steal> steals_;
  std::uint64_t seq_ = 0;
  Stats stats_;
  History history_;
  std::vector<Block*> spare_blocks_;
  // Addresses freed lately, direct-mapped by address: a second free of one of them is a double
  // free even after its block merged into a neighbour (a free on another thread at the same
  // time), not a foreign pointer. Guarded by mu_; no allocation on the free path.
  static constexpr std::size_t kRecentFrees = 1024;
  std::array<std::uintptr_t, kRecentFrees> recent_frees_{};
  static std::size_t recent_slot(std::uintptr_t addr) { return (addr >> 9) % kRecentFrees; }

  std::mutex cb_mu_;  // guards pressure_ (callbacks run without mu_)
  std::vector<std::pair<int, PressureCallback>> pressure_;
  std::vector<std::pair<int, SegmentHook>> hooks_;  // guarded by mu_
  std::atomic<int> next_id_{1};
};

}  // namespace bgl::alloc
