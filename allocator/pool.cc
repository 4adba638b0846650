#include "allocator/pool.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <limits>

#include "allocator/detail/fault.h"

namespace bgl::alloc {
namespace {

constexpr std::size_t kMinBlock = 512;
constexpr std::size_t kMaxRequest = std::size_t{1} << 60;

std::uintptr_t round_up(std::uintptr_t v, std::size_t a) { return (v + a - 1) / a * a; }
std::uintptr_t round_down(std::uintptr_t v, std::size_t a) { return v / a * a; }

std::string hex(std::uintptr_t p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%" PRIxPTR, p);
  return buf;
}

}  // namespace

Pool::Pool(std::unique_ptr<Backend> backend, const PoolOptions& options)
    : backend_(std::move(backend)), options_(options) {
  page_ = backend_->page_size();
  expandable_ = backend_->supports_reserve();
  const std::size_t phys = backend_->physical_capacity();
  if (options_.limit_bytes != 0) {
    limit_ = std::min(options_.limit_bytes, phys);
  } else {
    double f = std::clamp(options_.limit_fraction, 0.0, 1.0);
    limit_ = static_cast<std::size_t>(static_cast<double>(phys) * f);
  }
  limit_ = round_down(limit_, page_);
  options_.small_max = std::max(options_.small_max, kMinBlock);
  options_.small_segment = round_up(std::max(options_.small_segment, options_.small_max), page_);
  stats_.limit_bytes = limit_;
  stats_.physical_bytes = phys;
  history_.set_capacity(options_.history);
  init_arena(small_, true);
  init_arena(large_, false);
}

Pool::~Pool() {
  // Give every mapping and segment back; live allocations die with the pool. Hooks are not
  // called: their owners may already be gone.
  for (Arena* a : {&small_, &large_}) {
    for (Block* head : a->heads) {
      std::uintptr_t run_start = 0;
      bool in_run = false;
      const std::uintptr_t region_start = head->addr;
      std::uintptr_t region_end = region_start;
      for (Block* b = head; b != nullptr;) {
        Block* next = b->next;
        const bool mapped = b->state != BlockState::kUnmapped;
        if (expandable_ && mapped && !in_run) run_start = b->addr;
        if (expandable_ && mapped && (next == nullptr || next->state == BlockState::kUnmapped)) {
          backend_->unmap(reinterpret_cast<void*>(run_start), b->end() - run_start);
        }
        in_run = mapped;
        region_end = b->end();
        delete b;
        b = next;
      }
      if (!expandable_) {
        backend_->free_segment(reinterpret_cast<void*>(region_start), region_end - region_start);
      }
    }
    if (expandable_ && a->base != 0) {
      backend_->unreserve(reinterpret_cast<void*>(a->base), a->va_size);
    }
  }
  for (Block* b : spare_blocks_) delete b;
}

void Pool::init_arena(Arena& a, bool small) {
  a.small = small;
  if (!expandable_) return;
  // Virtual space is cheap: twice the limit leaves room for address-space fragmentation before
  // anything must be unmapped. The small arena gets as much: under a small limit every request
  // is small, and with only the limit's worth of addresses a request could fail while the pages
  // it needs are free but scattered between live blocks.
  std::size_t va = round_up(std::max(limit_, page_) * 2, page_);
  void* base = backend_->reserve(va);
  if (base == nullptr) {
    report_error(options_.log, "device " + std::to_string(backend_->device()) +
                                   ": cannot reserve " + format_bytes(va) +
                                   " of address space: " + backend_->last_error());
    return;
  }
  a.base = reinterpret_cast<std::uintptr_t>(base);
  a.va_size = va;
  Block* b = new_block();
  b->addr = a.base;
  b->size = va;
  b->state = BlockState::kUnmapped;
  b->arena = &a;
  a.heads.insert(b);
  a.unmapped.insert(b);
}

std::size_t Pool::round_size(std::size_t bytes) const {
  if (bytes <= kMinBlock) return kMinBlock;
  if (bytes > kMaxRequest) return bytes;  // rejected by the caller
  if (options_.round_divisions > 1) {
    std::size_t p = std::size_t{1} << (63 - __builtin_clzll(bytes));
    if (p != bytes) {
      std::size_t step = std::max(p / options_.round_divisions, kMinBlock);
      return round_up(bytes, step);
    }
  }
  return round_up(bytes, kMinBlock);
}

Block* Pool::new_block() {
  if (spare_blocks_.empty()) return new Block();
  Block* b = spare_blocks_.back();
  spare_blocks_.pop_back();
  *b = Block();
  return b;
}

void Pool::delete_block(Block* b) {
  b->state = BlockState::kDead;
  b->uses.clear();
  spare_blocks_.push_back(b);
}

void Pool::trace(Action a, std::uintptr_t addr, std::size_t size, Stream s) {
  if (history_.enabled()) history_.add(TraceEntry{a, addr, size, s, now_us()});
}

void Pool::call_hooks(std::uintptr_t addr, std::size_t bytes, bool mapped) {
  for (auto& [id, hook] : hooks_)
    hook(backend_->device(), reinterpret_cast<void*>(addr), bytes, mapped);
}

// ---------------------------------------------------------------------------------------------
// Allocation

void* Pool::allocate(std::size_t bytes, Stream stream) {
  if (bytes == 0) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.num_invalid_size;
    }
    report_error(options_.log, "allocation of 0 bytes on device " +
                                   std::to_string(backend_->device()) +
                                   " requested; returning null");
    return nullptr;
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (bytes > limit_ || bytes > kMaxRequest) {
    ++stats_.num_invalid_size;
    fail_oom(bytes, bytes,
             "the request is larger than the capacity limit of " + format_bytes(limit_));
    return nullptr;
  }
  if (!pending_.empty() || !steals_.empty()) process_events();
  const std::size_t n = round_size(bytes);
  Arena& a = arena_for(n);
  Block* b = find_fit(a, stream, n);
  if (b == nullptr) b = allocate_slow(a, stream, n, bytes, lock);
  if (b == nullptr) return nullptr;
  return reinterpret_cast<void*>(take(b, n, bytes, stream)->addr);
}

Block* Pool::find_fit(Arena& a, Stream s, std::size_t n) {
  Block key;
  key.size = n;
  key.addr = 0;
  key.ready = true;
  Block* best = nullptr;
  auto it = a.free.lower_bound(&key);
  if (it != a.free.end() && (*it)->ready) best = *it;
  key.ready = false;
  key.stream = s;
  it = a.free.lower_bound(&key);
  if (it != a.free.end() && !(*it)->ready && (*it)->stream == s) {
    if (best == nullptr || (*it)->size <= best->size) best = *it;
  }
  return best;
}

Block* Pool::split_at(Block* b, std::uintptr_t at) {
  Block* r = new_block();
  r->addr = at;
  r->size = b->end() - at;
  r->state = b->state;
  r->ready = b->ready;
  r->stream = b->stream;
  r->free_seq = b->free_seq;
  r->arena = b->arena;
  r->prev = b;
  r->next = b->next;
  if (b->next != nullptr) b->next->prev = r;
  b->next = r;
  b->size = at - b->addr;
  return r;
}

Block* Pool::take(Block* b, std::size_t n, std::size_t requested, Stream s) {
  erase_free(b);
  if (b->size - n >= kMinBlock) {
    // The remainder keeps the block's free attributes; it cannot merge with its successor
    // (the block was merged as far as possible before).
    Block* rest = split_at(b, b->addr + n);
    index_free(rest);
  }
  b->state = BlockState::kAllocated;
  b->requested = requested;
  b->stream = s;
  b->ready = false;
  b->uses.clear();
  live_.insert(b->addr, b);
  stats_.allocated_bytes.add(static_cast<std::int64_t>(b->size));
  stats_.requested_bytes.add(static_cast<std::int64_t>(requested));
  stats_.active_bytes.add(static_cast<std::int64_t>(b->size));
  stats_.allocations.add(1);
  ++stats_.num_allocs;
  trace(Action::kAlloc, b->addr, b->size, s);
  return b;
}

namespace {

std::string injected_device_failure() {
  return "fault injection: device operation #" +
         std::to_string(detail::fault_operations(detail::FaultKind::kDevice)) + " failed";
}

}  // namespace

Block* Pool::allocate_slow(Arena& a, Stream s, std::size_t n, std::size_t requested,
                           std::unique_lock<std::mutex>& lock) {
  injected_.clear();
  // 1. Other streams' cached blocks whose last use has already finished.
  if (steal(/*wait=*/false)) {
    if (Block* b = find_fit(a, s, n)) return b;
  }
  // 2. Map more memory.
  if (Block* b = grow(a, s, n)) return b;
  // 3. Free cached pages: wait for every pending free, unmap all free pages, retry.
  wait_all();
  if (Block* b = find_fit(a, s, n)) return b;
  release_free(std::numeric_limits<std::size_t>::max());
  if (Block* b = grow(a, s, n)) return b;
  // 4. Pressure callbacks (e.g. activation eviction), called without the lock.
  std::vector<PressureCallback> callbacks;
  {
    std::lock_guard<std::mutex> cb_lock(cb_mu_);
    for (auto& [id, cb] : pressure_) callbacks.push_back(cb);
  }
  if (!callbacks.empty()) {
    const std::size_t free_now = limit_ - static_cast<std::size_t>(stats_.reserved_bytes.current);
    const std::size_t needed = n > free_now ? n - free_now : n;
    const int device = backend_->device();
    lock.unlock();
    std::size_t freed = 0;
    for (auto& cb : callbacks) {
      freed += cb(device, needed);
      if (freed >= needed) break;
    }
    lock.lock();
    stats_.num_pressure_calls += callbacks.size();
    stats_.pressure_bytes_freed += freed;
    process_events();
    if (Block* b = find_fit(a, s, n)) return b;
    wait_all();
    if (Block* b = find_fit(a, s, n)) return b;
    release_free(std::numeric_limits<std::size_t>::max());
    if (Block* b = grow(a, s, n)) return b;
  }
  fail_oom(requested, n, injected_);
  injected_.clear();
  return nullptr;
}

Block* Pool::grow(Arena& a, Stream s, std::size_t n) {
  Block* b = expandable_ ? grow_expandable(a, s, n) : grow_segment(a, s, n);
  if (b != nullptr && b->size < n) return find_fit(a, s, n);  // defensive; plans are exact
  return b;
}

Block* Pool::grow_expandable(Arena& a, Stream s, std::size_t n) {
  if (a.base == 0) return nullptr;
  const auto reserved = static_cast<std::size_t>(stats_.reserved_bytes.current);
  if (options_.defrag) {
    // Keep reserved memory close to what is allocated: unmap free pages elsewhere rather than
    // map more than the slack allows.
    const double target =
        static_cast<double>(stats_.allocated_bytes.current + n) * (1.0 + options_.defrag_slack);
    const std::size_t need = round_up(n, page_);
    if (static_cast<double>(reserved + need) > target) {
      steal(/*wait=*/false);
      if (Block* b = find_fit(a, s, n)) return b;
      release_free(reserved + need - static_cast<std::size_t>(target));
    }
  }
  auto usable = [&](const Block* b) {
    return b != nullptr && b->state == BlockState::kFree && (b->ready || b->stream == s);
  };
  // Pick the placement that maps the fewest pages, preferring to extend a free neighbour so
  // that the new pages coalesce with it.
  Block* best_u = nullptr;
  std::uintptr_t best_addr = 0;
  std::size_t best_pages = std::numeric_limits<std::size_t>::max();
  for (Block* u : a.unmapped) {
    const std::size_t upages = u->size / page_;
    const std::size_t left = usable(u->prev) ? u->prev->size : 0;
    const std::size_t right = usable(u->next) ? u->next->size : 0;
    auto consider = [&](std::size_t pages, std::uintptr_t addr) {
      if (pages == 0 || pages > upages || pages >= best_pages) return;
      best_pages = pages;
      best_u = u;
      best_addr = addr;
    };
    const std::size_t fresh = round_up(n, page_) / page_;
    if (left > 0 && left < n) consider(round_up(n - left, page_) / page_, u->addr);
    if (right > 0 && right < n) {
      std::size_t k = round_up(n - right, page_) / page_;
      if (k <= upages) consider(k, u->end() - k * page_);
    }
    if (left + u->size + right >= n && (left > 0 || right > 0)) consider(upages, u->addr);
    consider(fresh, u->addr);
  }
  if (best_u == nullptr) return nullptr;
  const std::size_t bytes = best_pages * page_;
  if (reserved + bytes > limit_) return nullptr;
  if (detail::fault_point(detail::FaultKind::kDevice) == detail::FaultAction::kFail) {
    injected_ = injected_device_failure();  // as a device out of memory; the OOM names it
    return nullptr;
  }
  if (!backend_->map(reinterpret_cast<void*>(best_addr), bytes)) return nullptr;
  return map_range(a, best_u, best_addr, bytes, s);
}

Block* Pool::map_range(Arena& a, Block* u, std::uintptr_t addr, std::size_t bytes, Stream s) {
  a.unmapped.erase(u);
  Block* m = u;
  if (addr > u->addr) {
    m = split_at(u, addr);
    a.unmapped.insert(u);
  }
  if (m->end() > addr + bytes) a.unmapped.insert(split_at(m, addr + bytes));
  const bool left_mapped = m->prev != nullptr && m->prev->state != BlockState::kUnmapped;
  const bool right_mapped = m->next != nullptr && m->next->state != BlockState::kUnmapped;
  stats_.segments.add(1 - static_cast<int>(left_mapped) - static_cast<int>(right_mapped));
  m->state = BlockState::kFree;
  m->ready = false;  // owned by `s` with nothing pending: merges with s-usable neighbours only
  m->stream = s;
  m->free_seq = 0;
  stats_.reserved_bytes.add(static_cast<std::int64_t>(bytes));
  ++stats_.num_maps;
  trace(Action::kSegmentMap, addr, bytes, s);
  call_hooks(addr, bytes, true);
  m = merge_free(m);
  index_free(m);
  return m;
}

Block* Pool::grow_segment(Arena& a, Stream s, std::size_t n) {
  const std::size_t size = a.small ? options_.small_segment : round_up(n, page_);
  if (static_cast<std::size_t>(stats_.reserved_bytes.current) + size > limit_) return nullptr;
  if (detail::fault_point(detail::FaultKind::kDevice) == detail::FaultAction::kFail) {
    injected_ = injected_device_failure();  // as a device out of memory; the OOM names it
    return nullptr;
  }
  void* p = backend_->allocate_segment(size, s);
  if (p == nullptr) return nullptr;
  Block* b = new_block();
  b->addr = reinterpret_cast<std::uintptr_t>(p);
  b->size = size;
  b->state = BlockState::kFree;
  b->stream = s;
  b->arena = &a;
  a.heads.insert(b);
  index_free(b);
  stats_.reserved_bytes.add(static_cast<std::int64_t>(size));
  stats_.segments.add(1);
  ++stats_.num_maps;
  trace(Action::kSegmentAlloc, b->addr, size, s);
  call_hooks(b->addr, size, true);
  return b;
}

// ---------------------------------------------------------------------------------------------
// Free lists

void Pool::erase_free(Block* b) {
  Arena& a = *b->arena;
  auto it = a.free.find(b);
  if (it == a.free.end()) return;
  if (a.spare_nodes.size() < 4096) {
    a.spare_nodes.push_back(a.free.extract(it));
  } else {
    a.free.erase(it);
  }
}

void Pool::index_free(Block* b) {
  Arena& a = *b->arena;
  if (a.spare_nodes.empty()) {
    a.free.insert(b);
    return;
  }
  Arena::FreeSet::node_type node = std::move(a.spare_nodes.back());
  a.spare_nodes.pop_back();
  node.value() = b;
  a.free.insert(std::move(node));
}

bool Pool::mergeable(const Block* a, const Block* b) {
  return a->state == BlockState::kFree && b->state == BlockState::kFree &&
         (a->ready || b->ready || a->stream == b->stream);
}

Block* Pool::merge_free(Block* b) {
  // Ready + owned merges into owned: still safe on the owner, reusable elsewhere after its event.
  auto absorb = [this](Block* lo, Block* hi) {
    if (!hi->ready) {
      if (lo->ready) {
        lo->stream = hi->stream;
        lo->free_seq = hi->free_seq;
      } else {
        lo->free_seq = std::max(lo->free_seq, hi->free_seq);
      }
      lo->ready = false;
    }
    lo->size += hi->size;
    lo->next = hi->next;
    if (hi->next != nullptr) hi->next->prev = lo;
    delete_block(hi);
  };
  if (b->prev != nullptr && mergeable(b->prev, b)) {
    Block* p = b->prev;
    erase_free(p);
    absorb(p, b);
    b = p;
  }
  if (b->next != nullptr && mergeable(b, b->next)) {
    erase_free(b->next);
    absorb(b, b->next);
  }
  return b;
}

Block* Pool::merge_unmapped(Block* b) {
  Arena& a = *b->arena;
  if (b->prev != nullptr && b->prev->state == BlockState::kUnmapped) {
    Block* p = b->prev;
    a.unmapped.erase(p);
    p->size += b->size;
    p->next = b->next;
    if (b->next != nullptr) b->next->prev = p;
    delete_block(b);
    b = p;
  }
  if (b->next != nullptr && b->next->state == BlockState::kUnmapped) {
    Block* n = b->next;
    a.unmapped.erase(n);
    b->size += n->size;
    b->next = n->next;
    if (n->next != nullptr) n->next->prev = b;
    delete_block(n);
  }
  return b;
}

void Pool::insert_free(Block* b) {
  b->state = BlockState::kFree;
  b = merge_free(b);
  index_free(b);
}

// ---------------------------------------------------------------------------------------------
// Free

Status Pool::deallocate(void* ptr, std::size_t bytes, Stream stream) {
  if (ptr == nullptr) return Status::kOk;
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  std::unique_lock<std::mutex> lock(mu_);
  Block* b = live_.find(addr);
  if (b == nullptr) {
    b = find_block_at(addr);
    std::string msg;
    Status st;
    if ((b != nullptr && b->state != BlockState::kAllocated) ||
        recent_frees_[recent_slot(addr)] == addr) {
      ++stats_.num_double_free;
      st = Status::kDoubleFree;
      msg = "double free of " + hex(addr) + " on device " + std::to_string(backend_->device()) +
            ": the block is not allocated; ignored";
    } else {
      ++stats_.num_foreign_free;
      st = Status::kForeignPointer;
      msg = "free of " + hex(addr) + " on device " + std::to_string(backend_->device()) +
            ", which is not an allocation of this allocator; ignored";
    }
    lock.unlock();
    report_error(options_.log, msg);
    return st;
  }
  Status st = Status::kOk;
  std::string msg;
  if (bytes != 0 && bytes != b->requested) {
    ++stats_.num_wrong_size;
    st = Status::kWrongSize;
    msg = "free of " + hex(addr) + " with size " + std::to_string(bytes) +
          ", but it was allocated with size " + std::to_string(b->requested) + "; freed anyway";
  }
  if (stream != b->stream && std::find(b->uses.begin(), b->uses.end(), stream) == b->uses.end()) {
    b->uses.push_back(stream);
  }
  live_.erase(addr);
  recent_frees_[recent_slot(addr)] = addr;
  stats_.allocated_bytes.sub(static_cast<std::int64_t>(b->size));
  stats_.requested_bytes.sub(static_cast<std::int64_t>(b->requested));
  stats_.allocations.sub(1);
  ++stats_.num_frees;
  trace(Action::kFreeRequested, b->addr, b->size, b->stream);
  if (b->uses.empty()) {
    free_block(b);
  } else {
    b->state = BlockState::kPendingFree;
    for (Stream u : b->uses) {
      pending_.push_back(PendingFree{backend_->record(u), b});
      ++b->pending_events;
    }
    b->uses.clear();
  }
  if (st != Status::kOk) {
    lock.unlock();
    report_error(options_.log, msg);
  }
  return st;
}

void Pool::free_block(Block* b) {
  stats_.active_bytes.sub(static_cast<std::int64_t>(b->size));
  trace(Action::kFreeCompleted, b->addr, b->size, b->stream);
  b->ready = false;
  b->free_seq = ++seq_;
  insert_free(b);  // owned by its allocation stream
}

Status Pool::record_stream(void* ptr, Stream stream) {
  std::lock_guard<std::mutex> lock(mu_);
  Block* b = live_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (b == nullptr) return Status::kForeignPointer;
  if (stream != b->stream && std::find(b->uses.begin(), b->uses.end(), stream) == b->uses.end()) {
    b->uses.push_back(stream);
  }
  return Status::kOk;
}

// ---------------------------------------------------------------------------------------------
// Events

void Pool::process_events() {
  for (std::size_t i = 0; i < pending_.size();) {
    if (!backend_->query(pending_[i].event)) {
      ++i;
      continue;
    }
    backend_->release(pending_[i].event);
    Block* b = pending_[i].block;
    pending_[i] = pending_.back();
    pending_.pop_back();
    if (--b->pending_events == 0) free_block(b);
  }
  for (std::size_t i = 0; i < steals_.size();) {
    if (!backend_->query(steals_[i].event)) {
      ++i;
      continue;
    }
    backend_->release(steals_[i].event);
    Steal s = steals_[i];
    steals_[i] = steals_.back();
    steals_.pop_back();
    mark_ready(s.stream, s.seq);
  }
}

bool Pool::steal(bool wait) {
  bool any = false;
  for (Arena* a : {&small_, &large_}) {
    Block key;
    key.ready = false;
    key.stream = nullptr;
    key.size = 0;
    auto it = a->free.lower_bound(&key);
    while (it != a->free.end()) {
      Stream t = (*it)->stream;
      const bool outstanding = std::any_of(steals_.begin(), steals_.end(),
                                           [&](const Steal& s) { return s.stream == t; });
      if (!outstanding) {
        steals_.push_back(Steal{backend_->record(t), t, seq_});
        ++stats_.num_steals;
        any = true;
      }
      Block hi;
      hi.ready = false;
      hi.stream = t;
      hi.size = std::numeric_limits<std::size_t>::max();
      hi.addr = std::numeric_limits<std::uintptr_t>::max();
      it = a->free.upper_bound(&hi);
    }
  }
  if (wait) {
    for (Steal& s : steals_) {
      backend_->wait_for(s.event, detail::wait_timeout());  // bounded: process_events checks
      ++stats_.num_syncs;
    }
  }
  process_events();
  return any;
}

void Pool::mark_ready(Stream s, std::uint64_t seq) {
  for (Arena* a : {&small_, &large_}) {
    Block lo;
    lo.ready = false;
    lo.stream = s;
    lo.size = 0;
    lo.addr = 0;
    std::vector<Block*> blocks;
    for (auto it = a->free.lower_bound(&lo); it != a->free.end(); ++it) {
      Block* b = *it;
      if (b->ready || b->stream != s) break;
      if (b->free_seq <= seq) blocks.push_back(b);
    }
    if (blocks.empty()) continue;
    for (Block* b : blocks) {
      erase_free(b);
      b->ready = true;
      b->stream = nullptr;
    }
    // Merge in address order; a block absorbed by an earlier one is marked dead and skipped.
    std::sort(blocks.begin(), blocks.end(), AddrOrder());
    for (Block* b : blocks) {
      if (b->state == BlockState::kDead) continue;
      b = merge_free(b);
      index_free(b);
    }
  }
}

void Pool::wait_all() {
  // Pending frees first: once complete they become owned free blocks, which the steal below
  // then makes ready.
  for (PendingFree& p : pending_) {
    backend_->wait_for(p.event, detail::wait_timeout());  // bounded: process_events checks
    ++stats_.num_syncs;
  }
  process_events();
  steal(/*wait=*/true);
}

// ---------------------------------------------------------------------------------------------
// Release

std::size_t Pool::release_free(std::size_t goal) {
  std::size_t released = 0;
  ++stats_.num_releases;
  for (Arena* a : {&small_, &large_}) {
    // Largest ready blocks first: most pages for the fewest unmap calls.
    std::vector<Block*> ready;
    for (Block* b : a->free) {
      if (!b->ready) break;
      ready.push_back(b);
    }
    for (auto it = ready.rbegin(); it != ready.rend() && released < goal; ++it) {
      released += release_block(*it);
    }
  }
  return released;
}

std::size_t Pool::release_block(Block* b) {
  Arena& a = *b->arena;
  if (!expandable_) {
    if (b->prev != nullptr || b->next != nullptr) return 0;  // not a whole segment
    erase_free(b);
    call_hooks(b->addr, b->size, false);
    backend_->free_segment(reinterpret_cast<void*>(b->addr), b->size);
    a.heads.erase(b);
    stats_.reserved_bytes.sub(static_cast<std::int64_t>(b->size));
    stats_.segments.sub(1);
    ++stats_.num_unmaps;
    trace(Action::kSegmentFree, b->addr, b->size, nullptr);
    const std::size_t size = b->size;
    delete_block(b);
    return size;
  }
  const std::uintptr_t lo = round_up(b->addr, page_);
  const std::uintptr_t hi = round_down(b->end(), page_);
  if (hi <= lo) return 0;
  erase_free(b);
  call_hooks(lo, hi - lo, false);
  backend_->unmap(reinterpret_cast<void*>(lo), hi - lo);
  Block* mid = b;
  if (lo > b->addr) {
    mid = split_at(b, lo);
    index_free(b);
  }
  if (hi < mid->end()) index_free(split_at(mid, hi));
  const bool left_mapped = mid->prev != nullptr && mid->prev->state != BlockState::kUnmapped;
  const bool right_mapped = mid->next != nullptr && mid->next->state != BlockState::kUnmapped;
  stats_.segments.add(static_cast<int>(left_mapped) + static_cast<int>(right_mapped) - 1);
  mid->state = BlockState::kUnmapped;
  mid->ready = false;
  mid->stream = nullptr;
  mid->free_seq = 0;
  stats_.reserved_bytes.sub(static_cast<std::int64_t>(hi - lo));
  ++stats_.num_unmaps;
  trace(Action::kSegmentUnmap, lo, hi - lo, nullptr);
  a.unmapped.insert(merge_unmapped(mid));
  return hi - lo;
}

std::size_t Pool::empty_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  wait_all();
  return release_free(std::numeric_limits<std::size_t>::max());
}

// ---------------------------------------------------------------------------------------------
// OOM and statistics

void Pool::fail_oom(std::size_t requested, std::size_t rounded, const std::string& why) {
  ++stats_.num_ooms;
  Stats st = stats_;
  fill_computed(&st);
  const auto reserved = static_cast<std::size_t>(st.reserved_bytes.current);
  const auto allocated = static_cast<std::size_t>(st.allocated_bytes.current);
  const std::size_t free_bytes = limit_ > reserved ? limit_ - reserved : 0;
  trace(Action::kOom, free_bytes, rounded, nullptr);
  char frag[32];
  std::snprintf(frag, sizeof frag, "%.3f", st.fragmentation);
  std::string msg = "out of memory on device " + std::to_string(backend_->device()) +
                    ": requested " + format_bytes(requested) + "; free " +
                    format_bytes(free_bytes) + " (capacity limit " + format_bytes(limit_) +
                    " minus reserved " + format_bytes(reserved) + "); allocated " +
                    format_bytes(allocated) + "; reserved but unallocated " +
                    format_bytes(reserved - std::min(reserved, allocated)) + "; fragmentation " +
                    frag + " (largest free block " + format_bytes(st.largest_free_block) + ")";
  if (!why.empty()) msg += "; " + why;
  const std::string be = backend_->last_error();
  if (!be.empty() && why.empty()) msg += "; backend: " + be;
  report_error(options_.log, msg);
}

void Pool::fill_computed(Stats* st) const {
  std::uint64_t total = 0, largest = 0;
  for (const Arena* a : {&small_, &large_}) {
    for (const Block* b : a->free) {
      total += b->size;
      largest = std::max<std::uint64_t>(largest, b->size);
    }
  }
  st->inactive_bytes = total;
  st->largest_free_block = largest;
  st->fragmentation =
      total == 0 ? 0.0 : 1.0 - static_cast<double>(largest) / static_cast<double>(total);
}

Stats Pool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  Stats st = stats_;
  fill_computed(&st);
  return st;
}

void Pool::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  for (Gauge* g : {&stats_.allocated_bytes, &stats_.requested_bytes, &stats_.active_bytes,
                   &stats_.reserved_bytes, &stats_.allocations, &stats_.segments}) {
    g->reset_peak();
  }
}

void Pool::count_empty_request() {
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.num_invalid_size;
}

void Pool::count_wrong_device() {
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.num_wrong_device;
}

std::vector<SegmentInfo> Pool::segments() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<SegmentInfo> out;
  for (const Arena* a : {&small_, &large_}) {
    for (const Block* head : a->heads) {
      SegmentInfo* seg = nullptr;
      for (const Block* b = head; b != nullptr; b = b->next) {
        if (b->state == BlockState::kUnmapped) {
          seg = nullptr;
          continue;
        }
        if (seg == nullptr) {
          out.push_back(SegmentInfo{b->addr, 0, a->small, expandable_, nullptr, {}});
          seg = &out.back();
        }
        seg->size += b->size;
        if (seg->stream == nullptr && b->state != BlockState::kFree) seg->stream = b->stream;
        seg->blocks.push_back(BlockInfo{b->addr, b->size,
                                        b->state == BlockState::kFree ? 0 : b->requested, b->state,
                                        b->stream});
      }
    }
  }
  return out;
}

std::vector<TraceEntry> Pool::history() const {
  std::lock_guard<std::mutex> lock(mu_);
  return history_.entries();
}

bool Pool::history_overflowed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return history_.overflowed();
}

void Pool::set_history(std::size_t max_entries) {
  std::lock_guard<std::mutex> lock(mu_);
  history_.set_capacity(max_entries);
}

int Pool::add_pressure_callback(PressureCallback cb) {
  std::lock_guard<std::mutex> lock(cb_mu_);
  int id = next_id_++;
  pressure_.emplace_back(id, std::move(cb));
  return id;
}

void Pool::remove_pressure_callback(int id) {
  std::lock_guard<std::mutex> lock(cb_mu_);
  std::erase_if(pressure_, [id](const auto& p) { return p.first == id; });
}

int Pool::add_segment_hook(SegmentHook hook) {
  std::lock_guard<std::mutex> lock(mu_);
  int id = next_id_++;
  hooks_.emplace_back(id, std::move(hook));
  return id;
}

void Pool::remove_segment_hook(int id) {
  std::lock_guard<std::mutex> lock(mu_);
  std::erase_if(hooks_, [id](const auto& p) { return p.first == id; });
}

// ---------------------------------------------------------------------------------------------
// Lookup and invariants

Block* Pool::find_block_at(std::uintptr_t addr) const {
  for (const Arena* a : {&small_, &large_}) {
    for (Block* head : a->heads) {
      for (Block* b = head; b != nullptr; b = b->next) {
        if (b->addr == addr) return b;
        if (b->addr > addr) break;
      }
    }
  }
  return nullptr;
}

bool Pool::contains(const void* ptr) const {
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(mu_);
  for (const Arena* a : {&small_, &large_}) {
    if (expandable_) {
      if (a->base != 0 && addr >= a->base && addr < a->base + a->va_size) return true;
      continue;
    }
    for (const Block* head : a->heads) {
      const Block* b = head;
      while (b->next != nullptr) b = b->next;
      if (addr >= head->addr && addr < b->end()) return true;
    }
  }
  return false;
}

bool Pool::is_allocated(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mu_);
  return live_.find(reinterpret_cast<std::uintptr_t>(ptr)) != nullptr;
}

bool Pool::check_invariants(std::string* why) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto fail = [&](const std::string& m) {
    if (why != nullptr) *why = m;
    return false;
  };
  std::int64_t allocated = 0, requested = 0, reserved = 0, active = 0, runs = 0;
  std::size_t n_free = 0, n_unmapped = 0, n_live = 0;
  for (const Arena* a : {&small_, &large_}) {
    for (const Block* head : a->heads) {
      if (head->prev != nullptr) return fail("head has a predecessor");
      std::uintptr_t region_size = 0;
      bool in_run = false;
      for (const Block* b = head; b != nullptr; b = b->next) {
        const std::string at = " at " + hex(b->addr);
        if (b->arena != a) return fail("block in wrong arena" + at);
        if (b->size == 0) return fail("empty block" + at);
        if (b->next != nullptr && b->next->prev != b) return fail("broken links" + at);
        if (b->next != nullptr && b->next->addr != b->end()) return fail("gap or overlap" + at);
        region_size += b->size;
        switch (b->state) {
          case BlockState::kAllocated:
            ++n_live;
            allocated += static_cast<std::int64_t>(b->size);
            active += static_cast<std::int64_t>(b->size);
            requested += static_cast<std::int64_t>(b->requested);
            if (live_.find(b->addr) != b) {
              return fail("allocated block missing from live map" + at);
            }
            break;
          case BlockState::kPendingFree:
            active += static_cast<std::int64_t>(b->size);
            break;
          case BlockState::kFree:
            ++n_free;
            if (a->free.count(const_cast<Block*>(b)) == 0)
              return fail("free block not indexed" + at);
            if (b->next != nullptr && mergeable(b, b->next))
              return fail("unmerged free blocks" + at);
            break;
          case BlockState::kUnmapped:
            ++n_unmapped;
            if (b->addr % page_ != 0 || b->size % page_ != 0)
              return fail("unaligned unmapped" + at);
            if (b->next != nullptr && b->next->state == BlockState::kUnmapped) {
              return fail("unmerged unmapped blocks" + at);
            }
            if (a->unmapped.count(const_cast<Block*>(b)) == 0) {
              return fail("unmapped block not indexed" + at);
            }
            break;
          case BlockState::kDead:
            return fail("dead block linked" + at);
        }
        if (b->state != BlockState::kUnmapped) {
          reserved += static_cast<std::int64_t>(b->size);
          if (!in_run) ++runs;
          in_run = true;
        } else {
          in_run = false;
        }
      }
      if (expandable_ && region_size != a->va_size)
        return fail("region does not cover reservation");
    }
    if (a->free.size() > n_free) return fail("stale entries in free index");
    if (a->unmapped.size() > n_unmapped) return fail("stale entries in unmapped index");
    n_free -= a->free.size();
    n_unmapped -= a->unmapped.size();
  }
  if (n_free != 0 || n_unmapped != 0) return fail("index sizes differ from block counts");
  if (n_live != live_.size()) return fail("live map has extra entries");
  if (allocated != stats_.allocated_bytes.current) return fail("allocated_bytes mismatch");
  if (requested != stats_.requested_bytes.current) return fail("requested_bytes mismatch");
  if (active != stats_.active_bytes.current) return fail("active_bytes mismatch");
  if (reserved != stats_.reserved_bytes.current) return fail("reserved_bytes mismatch");
  if (static_cast<std::int64_t>(n_live) != stats_.allocations.current)
    return fail("count mismatch");
  if (runs != stats_.segments.current) return fail("segment count mismatch");
  if (expandable_ && reserved % static_cast<std::int64_t>(page_) != 0)
    return fail("reserved unaligned");
  if (static_cast<std::size_t>(reserved) > limit_) return fail("reserved above limit");
  return true;
}

}  // namespace bgl::alloc
