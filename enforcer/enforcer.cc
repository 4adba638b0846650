#include "enforcer/enforcer.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>

#include "kernels/fp8_cast.h"

namespace bgl::enf {
namespace {

std::string tensor_name(std::uint64_t h) { return "tensor " + std::to_string(h); }

bool is_float(ElemType t) {
  return t == ElemType::kF32 || t == ElemType::kF16 || t == ElemType::kBF16;
}
std::size_t elem_size(ElemType t) {
  return t == ElemType::kF32 ? 4 : t == ElemType::kBytes ? 1 : 2;
}

// Marks a tensor busy for the scope, so pressure eviction (which may run inside a pool
// allocation made by the operation) leaves it alone.
class Busy {
 public:
  explicit Busy(TrackedTensor& t) : t_(t) { ++t_.busy; }
  ~Busy() { --t_.busy; }
  Busy(const Busy&) = delete;
  Busy& operator=(const Busy&) = delete;

 private:
  TrackedTensor& t_;
};

// Adds the scope's duration to a counter of blocked waits (stats' copy_wait_ns); a wait
// inside another (a synchronize's pump waiting for a scheduled copy) counts once.
class WaitTimer {
 public:
  explicit WaitTimer(std::atomic<std::uint64_t>& ns)
      : ns_(ns), start_(std::chrono::steady_clock::now()) {
    ++depth_;
  }
  ~WaitTimer() {
    if (--depth_ > 0) return;
    ns_.fetch_add(static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                 std::chrono::steady_clock::now() - start_)
                                                 .count()),
                  std::memory_order_relaxed);
  }
  WaitTimer(const WaitTimer&) = delete;
  WaitTimer& operator=(const WaitTimer&) = delete;

 private:
  static thread_local int depth_;
  std::atomic<std::uint64_t>& ns_;
  const std::chrono::steady_clock::time_point start_;
};

thread_local int WaitTimer::depth_ = 0;

}  // namespace

std::unique_ptr<Enforcer> Enforcer::create(Pool* pool, std::unique_ptr<DeviceOps> ops,
                                           const EnforcerOptions& options, std::string* error) {
  if (pool == nullptr || ops == nullptr) {
    *error = "enforcer: no pool or device operations";
    return nullptr;
  }
  if (options.fp8_block == 0 || options.fp8_block > (std::size_t{1} << 20)) {
    *error = "enforcer: fp8_block must be in 1..1048576, not " + std::to_string(options.fp8_block);
    return nullptr;
  }
  if (options.max_inflight < 1) {
    *error = "enforcer: max_inflight must be >= 1, not " + std::to_string(options.max_inflight);
    return nullptr;
  }
  std::unique_ptr<Enforcer> e(new Enforcer(pool, std::move(ops), options));
  for (auto [stream, own] :
       {std::pair{&e->options_.d2h, &e->own_d2h_}, std::pair{&e->options_.h2d, &e->own_h2d_}}) {
    if (options.sync_copies) *stream = nullptr;  // the calling thread: no copy threads
    if (*stream != nullptr || options.sync_copies) continue;
    if (e->ops_->create_stream(stream) != Status::kOk) {
      *error = "enforcer: cannot create a copy stream: " + e->ops_->last_error();
      return nullptr;
    }
    *own = true;
  }
  if (options.pressure_eviction) {
    Enforcer* self = e.get();
    e->pressure_id_ = pool->add_pressure_callback([self](int, std::size_t needed) {
      std::size_t freed = 0;
      self->evict(needed, &freed);
      std::lock_guard<std::recursive_mutex> lock(self->mu_);
      ++self->stats_.pressure_calls;
      return freed;
    });
  }
  return e;
}

Enforcer::Enforcer(Pool* pool, std::unique_ptr<DeviceOps> ops, const EnforcerOptions& options)
    : pool_(pool),
      ops_(std::move(ops)),
      options_(options),
      pinned_(std::make_unique<PinnedPool>(ops_.get(), options.pinned_capacity)),
      sched_(this, options.max_inflight) {}

Enforcer::~Enforcer() {
  if (pressure_id_ != 0) pool_->remove_pressure_callback(pressure_id_);
  std::lock_guard<std::recursive_mutex> lock(mu_);
  std::string ignored;
  // The destructor waits as long as the work takes (a stalled copy included): the memory it
  // frees may be in use until then. Every other wait is bounded (BGL_WAIT_TIMEOUT_MS).
  auto drain = [this](Stream s) {
    while (ops_->synchronize(s) != Status::kOk) {
      report_error(true, "enforcer: still waiting at destruction: " + ops_->last_error());
    }
  };
  while (sched_.finish(&ignored) != Status::kOk && sched_.inflight() != 0) {
  }
  drain(options_.d2h);
  drain(options_.h2d);
  std::vector<std::uint64_t> handles;
  for (auto& [h, t] : tracker_.tensors()) handles.push_back(h);
  for (std::uint64_t h : handles) {
    TrackedTensor* t = tracker_.find(h);
    drain(t->alloc_stream);
    retire_locked(*t, t->alloc_stream);
  }
  drain(options_.d2h);
  drain(options_.h2d);
  pinned_.reset();
  if (own_d2h_) ops_->destroy_stream(options_.d2h);
  if (own_h2d_) ops_->destroy_stream(options_.h2d);
}

Status Enforcer::fail(Status s, const std::string& message) {
  report_error(options_.log, message);
  return s;
}

template <typename Body>
Status Enforcer::with_tensor(std::uint64_t handle, const char* fn, Body&& body) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  TrackedTensor* t = tracker_.find(handle);
  if (t == nullptr) {
    return fail(Status::kUnknownHandle,
                std::string(fn) + ": unknown tensor handle " + std::to_string(handle));
  }
  return body(*t);
}

// ---- tracker ------------------------------------------------------------------------------

Status Enforcer::register_tensor(const TensorDesc& desc, std::uint64_t* handle) {
  if (desc.ptr == nullptr || desc.bytes == 0) {
    return fail(Status::kInvalidArgument, "register: null pointer or zero bytes");
  }
  if (static_cast<int>(desc.dtype) > static_cast<int>(ElemType::kBytes)) {
    return fail(Status::kInvalidArgument,
                "register: dtype " + std::to_string(static_cast<int>(desc.dtype)) + " unknown");
  }
  if (desc.owned && !pool_->is_allocated(desc.ptr)) {
    return fail(Status::kForeignPointer,
                "register: an owned tensor must be a live allocation of the device's pool");
  }
  std::lock_guard<std::recursive_mutex> lock(mu_);
  std::string error;
  const Status s = tracker_.add(desc, handle, &error);
  if (s != Status::kOk) return fail(s, "register: " + error);
  ++stats_.registered;
  return Status::kOk;
}

Status Enforcer::register_saved(const TensorDesc& desc, std::int64_t need_order,
                                const int* consumers, std::size_t count, std::uint64_t* handle) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const Status s = register_tensor(desc, handle);
  if (s != Status::kOk) return s;
  TrackedTensor* t = tracker_.find(*handle);
  tracker_.set_need_order(*t, need_order);
  for (std::size_t i = 0; i < count; ++i) {
    const bool known = std::any_of(t->consumers.begin(), t->consumers.end(),
                                   [&](const Consumer& c) { return c.op == consumers[i]; });
    if (!known) t->consumers.push_back({consumers[i], false});
  }
  return Status::kOk;
}

Status Enforcer::add_consumer(std::uint64_t handle, int consumer_op) {
  return with_tensor(handle, "add_consumer", [&](TrackedTensor& t) {
    for (const auto& c : t.consumers) {
      if (c.op == consumer_op) {
        return fail(Status::kDuplicate, "add_consumer: operator " + std::to_string(consumer_op) +
                                            " already consumes " + tensor_name(handle));
      }
    }
    t.consumers.push_back({consumer_op, false});
    return Status::kOk;
  });
}

Status Enforcer::lookup(const void* ptr, std::uint64_t* handle) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const std::uint64_t h = tracker_.lookup(ptr);
  if (h == 0) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%p", ptr);
    return fail(Status::kUnknownHandle, std::string("lookup: no tracked tensor at ") + buf);
  }
  *handle = h;
  return Status::kOk;
}

Status Enforcer::info(std::uint64_t handle, bgl_enf_tensor_info* out) {
  return with_tensor(handle, "query", [&](TrackedTensor& t) {
    *out = bgl_enf_tensor_info{};
    out->placement = static_cast<int>(t.placement);
    out->applied = static_cast<int>(t.applied);
    out->planned = static_cast<int>(t.planned);
    out->pending =
        (t.has_offload && !ops_->query(t.offload_done)) || (t.has_ready && !ops_->query(t.ready));
    out->num_consumers = static_cast<int>(t.consumers.size());
    out->num_released = static_cast<int>(t.num_released());
    out->bytes = t.desc.bytes;
    out->device_ptr = t.ptr;
    out->host_ptr = t.host;
    out->fp8_ptr = t.fp8;
    out->fp8_bytes = t.fp8_bytes;
    out->need_order = t.need_order;
    return Status::kOk;
  });
}

Status Enforcer::unregister(std::uint64_t handle) {
  return with_tensor(handle, "unregister", [&](TrackedTensor& t) {
    if (t.busy != 0)
      return fail(Status::kInvalidState, "unregister: " + tensor_name(handle) + " is busy");
    if (Status s = wait_events(t, "unregister"); s != Status::kOk) return s;
    retire_locked(t, t.alloc_stream);
    return Status::kOk;
  });
}

std::size_t Enforcer::fp8_data_bytes(const TrackedTensor& t) const {
  const std::size_t n = t.desc.bytes / elem_size(t.desc.dtype);
  return (n + 15) / 16 * 16 + kern::fp8_num_blocks(n, options_.fp8_block) * sizeof(float);
}

Status Enforcer::movable(int micro_batch, Strategy s, std::size_t* bytes, std::size_t* count) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  std::size_t b = 0, c = 0;
  for (auto& [h, t] : tracker_.tensors()) {
    if (micro_batch != -1 && t.desc.micro_batch != micro_batch) continue;
    if (t.placement != Placement::kDevice || t.applied != Strategy::kKeep) continue;
    if (s == Strategy::kKeep) continue;
    if (s == Strategy::kFp8) {
      if (!is_float(t.desc.dtype)) continue;
      const std::size_t f = fp8_data_bytes(t);
      b += t.desc.bytes > f ? t.desc.bytes - f : 0;
    } else {
      b += t.desc.bytes;
    }
    ++c;
  }
  if (bytes != nullptr) *bytes = b;
  if (count != nullptr) *count = c;
  return Status::kOk;
}

Status Enforcer::set_need_order(std::uint64_t handle, std::int64_t order) {
  return with_tensor(handle, "set_need_order", [&](TrackedTensor& t) {
    tracker_.set_need_order(t, order);
    return Status::kOk;
  });
}

Status Enforcer::set_graph_index(std::uint64_t handle, int producer_op, int graph_tensor) {
  return with_tensor(handle, "set_graph_index", [&](TrackedTensor& t) {
    if (producer_op < -1 || graph_tensor < -1) {
      return fail(Status::kInvalidArgument,
                  "set_graph_index: indices must be -1 (unknown) or more, not producer " +
                      std::to_string(producer_op) + ", tensor " + std::to_string(graph_tensor));
    }
    t.desc.producer_op = producer_op;
    t.desc.graph_tensor = graph_tensor;
    return Status::kOk;
  });
}

// ---- enforcement ------------------------------------------------------------------------------

namespace {

// Strategies arrive as integers through the C API; only the planner's four exist.
bool KnownStrategy(Strategy s) { return static_cast<int>(s) <= static_cast<int>(Strategy::kFp8); }

std::string UnknownStrategy(const char* call, Strategy s) {
  return std::string(call) + ": strategy " + std::to_string(static_cast<int>(s)) + " unknown";
}

}  // namespace

Status Enforcer::set_strategy(std::uint64_t handle, Strategy s) {
  return with_tensor(handle, "set_strategy", [&](TrackedTensor& t) {
    if (!KnownStrategy(s))
      return fail(Status::kInvalidArgument, UnknownStrategy("set_strategy", s));
    t.planned = s;
    return Status::kOk;
  });
}

Status Enforcer::apply(std::uint64_t handle, Strategy s) {
  return with_tensor(handle, "apply", [&](TrackedTensor& t) {
    if (!KnownStrategy(s)) return fail(Status::kInvalidArgument, UnknownStrategy("apply", s));
    if (t.applied == s) return Status::kOk;  // already moved by this strategy: moved once
    if (t.applied != Strategy::kKeep) {
      return fail(Status::kConflict, "apply: " + tensor_name(handle) + " was already moved by " +
                                         strategy_name(t.applied) + "; the plan now asks " +
                                         strategy_name(s));
    }
    switch (s) {
      case Strategy::kKeep:
        return Status::kOk;
      case Strategy::kOffload:
        return offload_locked(t);
      case Strategy::kFp8:
        return fp8_locked(t);
      case Strategy::kRecompute:
        return drop_locked(t);
    }
    return Status::kInvalidArgument;
  });
}

Status Enforcer::offload(std::uint64_t handle) {
  return with_tensor(handle, "offload", [&](TrackedTensor& t) { return offload_locked(t); });
}
Status Enforcer::reload(std::uint64_t handle) {
  return with_tensor(handle, "reload", [&](TrackedTensor& t) { return reload_locked(t); });
}
Status Enforcer::store_fp8(std::uint64_t handle) {
  return with_tensor(handle, "store_fp8", [&](TrackedTensor& t) { return fp8_locked(t); });
}
Status Enforcer::drop(std::uint64_t handle) {
  return with_tensor(handle, "drop", [&](TrackedTensor& t) { return drop_locked(t); });
}

void Enforcer::set_recompute(RecomputeFn fn) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  recompute_ = std::move(fn);
}

Status Enforcer::after(Stream s, const Event& e, const std::string& what) {
  // On a null stream (synchronous copies) this is a host wait, bounded: work that was to
  // follow `e` must not start when it did not complete.
  std::optional<WaitTimer> timer;  // stream ordered (non-null): the caller does not wait
  if (s == nullptr) timer.emplace(copy_wait_ns_);
  if (ops_->stream_wait(s, e) == Status::kOk) return Status::kOk;
  return fail(Status::kBackendError, what + ": " + ops_->last_error());
}

Status Enforcer::order_after_data(TrackedTensor& t, Stream s, const std::string& what) {
  // Work on `s` must follow whatever wrote the device data: a reload/uncast event, or the
  // producer's stream.
  if (t.has_ready) return after(s, t.ready, what + ": its reload or cast");
  if (t.desc.stream != s) {
    const Event e = ops_->record(t.desc.stream);
    const Status st = after(s, e, what + ": its producer's stream");
    ops_->release(e);
    return st;
  }
  return Status::kOk;
}

void Enforcer::set_ready(TrackedTensor& t, Stream s) {
  if (t.has_ready) ops_->release(t.ready);
  t.ready = ops_->record(s);
  t.has_ready = true;
}

Status Enforcer::offload_locked(TrackedTensor& t) {
  const std::string name = "offload " + tensor_name(t.handle);
  if (t.placement != Placement::kDevice) {
    return fail(Status::kInvalidState,
                name + ": it is on " + placement_name(t.placement) + ", not the device");
  }
  if (t.acquired > 0 || t.busy > 0) {
    return fail(Status::kInvalidState, name + ": a consumer or an operation is using it");
  }
  if (t.reload_unused) {
    // Reloaded ahead of a consumer that has not taken it: the pinned copy is still there, so
    // offloading again only gives the device block back (a second copy would leak the first).
    return unreload_locked(t);
  }
  Busy busy(t);
  void* host = nullptr;
  std::string error;
  if (pinned_->allocate(t.desc.bytes, &host, &error) != Status::kOk) {
    return fail(Status::kPinnedExhausted, name + ": " + error);
  }
  const Stream d2h = options_.d2h;
  if (Status st = order_after_data(t, d2h, name); st != Status::kOk) {
    pinned_->free_after(host, Event{});
    return st;
  }
  if (ops_->copy(host, t.ptr, t.desc.bytes, d2h) != Status::kOk) {
    pinned_->free_after(host, Event{});
    return fail(Status::kBackendError, name + ": " + ops_->last_error());
  }
  if (t.has_offload) ops_->release(t.offload_done);
  t.offload_done = ops_->record(d2h);
  t.has_offload = true;
  // The device block goes back to the pool ordered after the copy: a free on another stream
  // than the allocation stream is reused only after an event on that stream (record_stream).
  leave_device(t, d2h);
  t.host = host;
  tracker_.set_placement(t, Placement::kHost);
  t.applied = Strategy::kOffload;
  ++stats_.offloads;
  stats_.bytes_d2h += t.desc.bytes;
  return Status::kOk;
}

Status Enforcer::reload_locked(TrackedTensor& t) {
  const std::string name = "reload " + tensor_name(t.handle);
  if (t.placement == Placement::kDevice) {
    if (t.applied == Strategy::kOffload) return Status::kOk;  // already reloaded (moved once)
    return fail(Status::kInvalidState, name + ": it was never offloaded");
  }
  if (t.placement != Placement::kHost) {
    return fail(Status::kInvalidState,
                name + ": it is " + placement_name(t.placement) + ", not offloaded");
  }
  if (t.busy > 0) return fail(Status::kInvalidState, name + ": an operation is under way");
  Busy busy(t);
  const Stream h2d = options_.h2d;
  void* dev = pool_->allocate(t.desc.bytes, h2d);
  if (dev == nullptr) return fail(Status::kOutOfMemory, name + ": " + last_error());
  // The race in Megatron-LM's fine-grained offloading: never start before the D2H finished.
  if (Status st = after(h2d, t.offload_done, name + ": its offload copy"); st != Status::kOk) {
    pool_->deallocate(dev, 0, h2d);
    return st;
  }
  if (ops_->copy(dev, t.host, t.desc.bytes, h2d) != Status::kOk) {
    pool_->deallocate(dev, 0, h2d);
    return fail(Status::kBackendError, name + ": " + ops_->last_error());
  }
  set_ready(t, h2d);
  // The pinned copy stays until a consumer takes the reload: until then pressure may give the
  // device block back (unreload_locked) and the data is still on the host.
  tracker_.set_ptr(t, dev);
  t.owned = true;
  t.alloc_stream = h2d;
  tracker_.set_placement(t, Placement::kDevice);
  tracker_.set_reload_unused(t, true);
  ++stats_.reloads;
  stats_.bytes_h2d += t.desc.bytes;
  return Status::kOk;
}

Status Enforcer::fp8_locked(TrackedTensor& t) {
  const std::string name = "store_fp8 " + tensor_name(t.handle);
  if (!is_float(t.desc.dtype) || t.desc.bytes % elem_size(t.desc.dtype) != 0) {
    return fail(Status::kInvalidArgument,
                name + ": FP8 needs an F32/F16/BF16 tensor of whole elements");
  }
  if (t.placement != Placement::kDevice) {
    return fail(Status::kInvalidState,
                name + ": it is on " + placement_name(t.placement) + ", not the device");
  }
  if (t.acquired > 0 || t.busy > 0) {
    return fail(Status::kInvalidState, name + ": a consumer or an operation is using it");
  }
  Busy busy(t);
  const Stream s = t.desc.stream;
  const std::size_t n = t.desc.bytes / elem_size(t.desc.dtype);
  const std::size_t total = fp8_data_bytes(t);
  auto* f = static_cast<std::uint8_t*>(pool_->allocate(total, s));
  if (f == nullptr) return fail(Status::kOutOfMemory, name + ": " + last_error());
  if (Status st = order_after_data(t, s, name); st != Status::kOk) {
    pool_->deallocate(f, 0, s);
    return st;
  }
  auto* scales = reinterpret_cast<float*>(f + (n + 15) / 16 * 16);
  if (ops_->cast_to_fp8(t.ptr, static_cast<kern::DType>(t.desc.dtype), n, f, scales,
                        options_.fp8_block, s) != Status::kOk) {
    pool_->deallocate(f, 0, s);
    return fail(Status::kBackendError, name + ": " + ops_->last_error());
  }
  // The full-precision copy goes as soon as the cast is queued (ordered after it on `s`).
  leave_device(t, s);
  t.fp8 = f;
  t.fp8_bytes = total;
  tracker_.set_placement(t, Placement::kFp8);
  t.applied = Strategy::kFp8;
  ++stats_.fp8_casts;
  stats_.bytes_fp8_saved += t.desc.bytes > total ? t.desc.bytes - total : 0;
  return Status::kOk;
}

Status Enforcer::uncast_locked(TrackedTensor& t, Stream s) {
  const std::string name = "uncast " + tensor_name(t.handle);
  Busy busy(t);
  const std::size_t n = t.desc.bytes / elem_size(t.desc.dtype);
  void* dev = pool_->allocate(t.desc.bytes, s);
  if (dev == nullptr) return fail(Status::kOutOfMemory, name + ": " + last_error());
  auto* f = static_cast<std::uint8_t*>(t.fp8);
  if (s != t.desc.stream) {
    const Event e = ops_->record(t.desc.stream);
    const Status st = after(s, e, name + ": its cast");
    ops_->release(e);
    if (st != Status::kOk) {
      pool_->deallocate(dev, 0, s);
      return st;
    }
  }
  const auto* scales = reinterpret_cast<const float*>(f + (n + 15) / 16 * 16);
  if (ops_->cast_from_fp8(f, scales, n, options_.fp8_block, static_cast<kern::DType>(t.desc.dtype),
                          dev, s) != Status::kOk) {
    pool_->deallocate(dev, 0, s);
    return fail(Status::kBackendError, name + ": " + ops_->last_error());
  }
  pool_->deallocate(f, 0, s);  // FP8 copy freed once the uncast is queued
  t.fp8 = nullptr;
  t.fp8_bytes = 0;
  tracker_.set_ptr(t, dev);
  t.owned = true;
  t.alloc_stream = s;
  set_ready(t, s);
  tracker_.set_placement(t, Placement::kDevice);
  ++stats_.fp8_uncasts;
  return Status::kOk;
}

Status Enforcer::drop_locked(TrackedTensor& t) {
  const std::string name = "drop " + tensor_name(t.handle);
  if (t.placement != Placement::kDevice) {
    return fail(Status::kInvalidState,
                name + ": it is on " + placement_name(t.placement) + ", not the device");
  }
  if (t.acquired > 0 || t.busy > 0) {
    return fail(Status::kInvalidState, name + ": a consumer or an operation is using it");
  }
  if (t.owned) pool_->deallocate(t.ptr, 0, t.alloc_stream);
  if (t.has_ready) {
    ops_->release(t.ready);
    t.has_ready = false;
  }
  tracker_.set_ptr(t, nullptr);
  tracker_.set_placement(t, Placement::kDropped);
  t.applied = Strategy::kRecompute;
  ++stats_.drops;
  return Status::kOk;
}

Status Enforcer::recompute_locked(TrackedTensor& t, Stream s) {
  const std::string name = "recompute " + tensor_name(t.handle);
  if (t.busy > 0) return fail(Status::kInvalidState, name + ": already being recomputed");
  if (!recompute_) return fail(Status::kCallbackError, name + ": no recompute callback is set");
  Busy busy(t);
  void* p = nullptr;
  const int rc = recompute_(t.handle, t.desc.producer_op, t.desc.micro_batch, &p);
  if (rc != 0 || p == nullptr) {
    return fail(Status::kCallbackError, name + ": the callback returned " + std::to_string(rc) +
                                            (p == nullptr ? " and no data" : ""));
  }
  tracker_.set_ptr(t, p);
  t.owned = t.desc.owned;
  t.alloc_stream = s;
  set_ready(t, s);
  tracker_.set_placement(t, Placement::kDevice);
  ++stats_.recomputes;
  return Status::kOk;
}

// ---- consumers --------------------------------------------------------------------------------

Status Enforcer::acquire(std::uint64_t handle, int consumer_op, Stream stream, void** ptr) {
  return with_tensor(handle, "acquire", [&](TrackedTensor& t) {
    Status st = Status::kOk;
    Consumer* c = nullptr;
    if (consumer_op != -1) {
      for (auto& x : t.consumers) c = x.op == consumer_op ? &x : c;
      if (c == nullptr) {
        return fail(Status::kInvalidArgument, "acquire: operator " + std::to_string(consumer_op) +
                                                  " is not a consumer of " + tensor_name(handle));
      }
      if (c->released) {
        return fail(Status::kInvalidState, "acquire: operator " + std::to_string(consumer_op) +
                                               " already released " + tensor_name(handle));
      }
    }
    switch (t.placement) {
      case Placement::kHost:
        st = reload_locked(t);
        break;
      case Placement::kFp8:
        st = uncast_locked(t, stream);
        break;
      case Placement::kDropped:
        st = recompute_locked(t, stream);
        break;
      case Placement::kDevice:
        st = Status::kOk;
        break;
    }
    if (st != Status::kOk) return st;
    if (t.has_ready) {
      // Not acquired when its data did not arrive in time: a later acquire waits again.
      st = after(stream, t.ready, "acquire " + tensor_name(handle) + ": its reload or cast");
      if (st != Status::kOk) return st;
    }
    ++t.acquired;
    if (t.reload_unused) {  // the first consumer takes the reload: the pinned copy goes
      pinned_->free_after(t.host, ops_->record(options_.h2d));
      t.host = nullptr;
      tracker_.set_reload_unused(t, false);
    }
    *ptr = t.ptr;
    return Status::kOk;
  });
}

Status Enforcer::release(std::uint64_t handle, int consumer_op, Stream stream) {
  return with_tensor(handle, "release", [&](TrackedTensor& t) {
    if (consumer_op != -1) {
      Consumer* c = nullptr;
      for (auto& x : t.consumers) c = x.op == consumer_op ? &x : c;
      if (c == nullptr) {
        return fail(Status::kInvalidArgument, "release: operator " + std::to_string(consumer_op) +
                                                  " is not a consumer of " + tensor_name(handle));
      }
      if (c->released) {
        return fail(Status::kInvalidState, "release: operator " + std::to_string(consumer_op) +
                                               " already released " + tensor_name(handle));
      }
      c->released = true;
    }
    if (t.acquired > 0) --t.acquired;
    if (t.ptr != nullptr && t.owned && stream != t.alloc_stream) {
      pool_->record_stream(t.ptr, stream);  // its memory is reused only after this consumer
    }
    if (t.num_released() == t.consumers.size()) retire_locked(t, stream);
    return Status::kOk;
  });
}

void Enforcer::retire_locked(TrackedTensor& t, Stream s) {
  if (t.ptr != nullptr && t.owned) pool_->deallocate(t.ptr, 0, s);
  if (t.fp8 != nullptr) pool_->deallocate(t.fp8, 0, s);
  if (t.host != nullptr) {
    // After every copy that may still touch the pinned block: the offload writes it on d2h, a
    // reload reads it on h2d. An event on d2h alone let a retire during a reload cache the
    // block while the reload still read it, and a smaller pinned capacity then freed it under
    // the copy (issue 45, enforcer_capi_fuzz).
    pinned_->free_after_both(t.host, ops_->record(options_.d2h), ops_->record(options_.h2d));
  }
  if (t.has_ready) ops_->release(t.ready);
  if (t.has_offload) ops_->release(t.offload_done);
  tracker_.remove(t.handle);  // t is gone after this
  ++stats_.retired;
}

Status Enforcer::wait_tensor(std::uint64_t handle) {
  return with_tensor(handle, "wait_tensor", [&](TrackedTensor& t) {
    if (Status s = wait_events(t, "wait_tensor"); s != Status::kOk) return s;
    if (t.placement != Placement::kFp8) return Status::kOk;
    WaitTimer timer(copy_wait_ns_);
    if (ops_->synchronize(t.desc.stream) != Status::kOk) {
      return fail(Status::kBackendError, "wait_tensor: " + tensor_name(t.handle) +
                                             ": the FP8 cast: " + ops_->last_error());
    }
    return Status::kOk;
  });
}

Status Enforcer::wait_events(TrackedTensor& t, const char* fn) {
  if (!t.has_offload && !t.has_ready) return Status::kOk;  // nothing to wait for
  WaitTimer timer(copy_wait_ns_);
  if (t.has_offload && ops_->wait(t.offload_done) != Status::kOk) {
    return fail(Status::kBackendError, std::string(fn) + ": " + tensor_name(t.handle) +
                                           ": its offload copy: " + ops_->last_error());
  }
  if (t.has_ready && ops_->wait(t.ready) != Status::kOk) {
    return fail(Status::kBackendError, std::string(fn) + ": " + tensor_name(t.handle) +
                                           ": its reload or cast: " + ops_->last_error());
  }
  return Status::kOk;
}

Status Enforcer::wait(const Event& e) {
  Status st = Status::kOk;
  {
    WaitTimer timer(copy_wait_ns_);
    st = ops_->wait(e);
  }
  if (st == Status::kOk) return Status::kOk;
  return fail(Status::kBackendError, "scheduled copy: " + ops_->last_error());
}

Status Enforcer::synchronize() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  WaitTimer timer(copy_wait_ns_);
  for (Stream s : {options_.d2h, options_.h2d}) {
    if (ops_->synchronize(s) != Status::kOk) {
      return fail(Status::kBackendError, std::string("synchronize: the ") +
                                             (s == options_.d2h ? "offload" : "reload") +
                                             " stream: " + ops_->last_error());
    }
  }
  std::string ignored;
  sched_.pump(&ignored);
  return Status::kOk;
}

// ---- scheduler ----------------------------------------------------------------------------------

Status Enforcer::schedule_begin(const std::vector<plan::IssueItem>& order, int offload_micro_batch,
                                int recover_micro_batch) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  std::string error;
  StreamScheduler probe(this, 1);
  if (probe.load(order, &error) != Status::kOk) {
    return fail(Status::kInvalidArgument, "schedule_begin: " + error);
  }
  // The previous point's leftovers are issued (their micro-batches are named by the order they
  // came with); those in flight complete beside this order.
  Status first = sched_.hand_over(&error);
  if (first != Status::kOk) report_error(options_.log, "schedule_begin: previous order: " + error);
  sched_.load(order, &error);
  offload_mb_ = offload_micro_batch;
  recover_mb_ = recover_micro_batch;
  return Status::kOk;
}

Status Enforcer::schedule_reached(plan::Chain chain, int stage) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  std::string error;
  const Status s = sched_.reached(chain, stage, &error);
  stats_.scheduled_issued = sched_.issued();
  stats_.scheduled_max_inflight = sched_.max_inflight_seen();
  return s == Status::kOk ? s : fail(s, error);
}

Status Enforcer::schedule_at(plan::Chain chain, int op, int* passed) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  std::string error;
  const Status s = sched_.at(chain, op, passed, &error);
  if (*passed > 0) {
    stats_.scheduled_issued = sched_.issued();
    stats_.scheduled_max_inflight = sched_.max_inflight_seen();
  }
  return s == Status::kOk ? s : fail(s, error);
}

Status Enforcer::schedule_poll(std::size_t* waiting) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  std::string error;
  const Status s = sched_.pump(&error);
  stats_.scheduled_issued = sched_.issued();
  stats_.scheduled_max_inflight = sched_.max_inflight_seen();
  if (waiting != nullptr) *waiting = sched_.waiting();
  return s == Status::kOk ? s : fail(s, error);
}

Status Enforcer::schedule_finish() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  std::string error;
  const Status s = sched_.finish(&error);
  stats_.scheduled_issued = sched_.issued();
  stats_.scheduled_max_inflight = sched_.max_inflight_seen();
  return s == Status::kOk ? s : fail(s, error);
}

Status Enforcer::issue(const plan::IssueItem& item, Event* done, std::string* error) {
  Status first = Status::kOk;
  auto note = [&](Status s) {
    if (s != Status::kOk && first == Status::kOk) {
      first = s;
      *error = last_error();
    }
  };
  auto in = [&](int v) { return v >= item.first && v <= item.last; };
  // The micro-batch's tensors only (handle order), taken before any move changes the tracker.
  auto of = [&](int micro_batch) {
    std::vector<TrackedTensor*> picked;
    for (const auto& [h, t] : tracker_.of_micro_batch(micro_batch)) picked.push_back(t);
    return picked;
  };
  if (item.chain == plan::Chain::kOffload) {
    for (TrackedTensor* t : of(offload_mb_)) {
      if (t->desc.micro_batch == offload_mb_ && in(t->desc.graph_tensor) &&
          t->planned == Strategy::kOffload && t->placement == Placement::kDevice &&
          t->applied == Strategy::kKeep) {
        const Status s = offload_locked(*t);
        note(s);
        if (s == Status::kOk) scheduled_offloads_.push_back(t->handle);
      }
    }
    *done = ops_->record(options_.d2h);
  } else if (item.chain == plan::Chain::kRecover && item.resource == plan::Resource::kH2D) {
    for (TrackedTensor* t : of(recover_mb_)) {
      if (t->desc.micro_batch == recover_mb_ && in(t->desc.graph_tensor) &&
          t->placement == Placement::kHost) {
        note(reload_locked(*t));
      }
    }
    *done = ops_->record(options_.h2d);
  } else if (item.chain == plan::Chain::kRecover) {
    // Recomputes in forward order of their producers.
    std::vector<TrackedTensor*> dropped;
    for (TrackedTensor* t : of(recover_mb_)) {
      if (t->desc.micro_batch == recover_mb_ && in(t->desc.producer_op) &&
          t->placement == Placement::kDropped) {
        dropped.push_back(t);
      }
    }
    std::stable_sort(dropped.begin(), dropped.end(),
                     [](auto* a, auto* b) { return a->desc.producer_op < b->desc.producer_op; });
    std::vector<std::uint64_t> handles;
    for (TrackedTensor* t : dropped) handles.push_back(t->handle);
    Stream last = nullptr;
    for (std::uint64_t h : handles) {
      // A callback may bring back other dropped tensors too (one rerun makes them all), or
      // retire some: look each one up again.
      TrackedTensor* t = tracker_.find(h);
      if (t == nullptr || t->placement != Placement::kDropped) continue;
      note(recompute_locked(*t, t->desc.stream));
      last = t->desc.stream;
    }
    *done = ops_->record(last);
  }
  return first;
}

Status Enforcer::take_offloaded(std::uint64_t* out, std::size_t cap, std::size_t* count) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (count == nullptr || (out == nullptr && cap > 0)) {
    return fail(Status::kInvalidArgument, "take_offloaded: null output");
  }
  std::size_t n = 0, kept = 0;
  for (std::uint64_t h : scheduled_offloads_) {
    TrackedTensor* t = tracker_.find(h);
    if (t == nullptr) continue;  // retired meanwhile
    // Until the D2H copy ran, the source must stay: also when a reload was queued behind the
    // copy meanwhile (the tensor is on the device again, but the pinned data is not there yet).
    const bool copying = t->has_offload && !ops_->query(t->offload_done);
    if (copying || n == cap) {
      scheduled_offloads_[kept++] = h;
    } else {
      out[n++] = h;
    }
  }
  scheduled_offloads_.resize(kept);
  *count = n;
  return Status::kOk;
}

Status Enforcer::prefetch(int micro_batch, std::size_t* issued) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (issued != nullptr) *issued = 0;
  const ActivationTracker::MicroBatch* mb = tracker_.micro_batch(micro_batch);
  if (mb == nullptr) return Status::kOk;
  // The micro-batch's index holds its untaken reloads' count and its offloaded tensors in
  // need order (ties: registration order): the cost is the reloads issued, not the tensors.
  const std::size_t waiting = mb->reload_unused;
  const std::size_t bound = static_cast<std::size_t>(std::max(options_.max_inflight, 1));
  std::vector<TrackedTensor*> host;  // taken first: each reload changes the index
  for (const auto& [key, t] : mb->host) {
    if (waiting + host.size() >= bound) break;
    if (t->busy == 0) host.push_back(t);
  }
  std::size_t n = 0;
  for (TrackedTensor* t : host) {
    if (waiting + n >= bound) break;
    const Status s = reload_locked(*t);
    if (s != Status::kOk) return s;  // e.g. no room yet: the acquire reloads it
    ++n;
    if (issued != nullptr) *issued = n;
  }
  return Status::kOk;
}

// ---- pressure ---------------------------------------------------------------------------------

void Enforcer::leave_device(TrackedTensor& t, Stream s) {
  if (t.owned) {
    pool_->deallocate(t.ptr, 0, s);
  } else if (pool_->is_allocated(t.ptr)) {
    pool_->record_stream(t.ptr, s);
  }
  if (t.has_ready) {
    ops_->release(t.ready);
    t.has_ready = false;
  }
  tracker_.set_ptr(t, nullptr);
}

Status Enforcer::set_pinned_capacity(std::size_t bytes) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  pinned_->set_capacity(bytes);
  return Status::kOk;
}

Status Enforcer::unreload_locked(TrackedTensor& t) {
  // The device block is freed after the H2D copy (stream order); the pinned copy is intact.
  leave_device(t, options_.h2d);
  t.owned = false;
  tracker_.set_placement(t, Placement::kHost);
  tracker_.set_reload_unused(t, false);
  ++stats_.unreloads;
  return Status::kOk;
}

Status Enforcer::evict(std::size_t needed, std::size_t* freed) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  std::vector<TrackedTensor*> candidates, prefetched;
  for (auto& [h, t] : tracker_.tensors()) {
    if (t.busy != 0 || t.acquired != 0 || t.placement != Placement::kDevice) continue;
    if (t.reload_unused) {
      // A reload no consumer took yet: giving its block back costs only the copy.
      prefetched.push_back(&t);
    } else if (t.owned && t.applied == Strategy::kKeep) {
      // Owned (freeing it helps the pool), idle, and never moved.
      candidates.push_back(&t);
    }
  }
  auto needed_last_first = [](auto* a, auto* b) { return a->need_order > b->need_order; };
  std::stable_sort(candidates.begin(), candidates.end(), needed_last_first);
  std::stable_sort(prefetched.begin(), prefetched.end(), needed_last_first);
  std::size_t got = 0;
  for (TrackedTensor* t : candidates) {
    if (got >= needed) break;
    const std::size_t bytes = pool_->round_size(t->desc.bytes);
    if (offload_locked(*t) == Status::kOk) {
      got += bytes;
      ++stats_.evictions;
      stats_.evicted_bytes += t->desc.bytes;
    }
  }
  for (TrackedTensor* t : prefetched) {
    if (got >= needed) break;
    got += pool_->round_size(t->desc.bytes);
    unreload_locked(*t);
  }
  alloc::clear_last_error();
  if (freed != nullptr) *freed = got;
  return Status::kOk;
}

EnforcerStats Enforcer::stats() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  EnforcerStats s = stats_;
  s.tracked = tracker_.size();
  s.device_bytes = s.host_bytes = s.fp8_bytes = 0;
  for (auto& [h, t] : tracker_.tensors()) {
    switch (t.placement) {
      case Placement::kDevice:
        s.device_bytes += t.desc.bytes;
        break;
      case Placement::kHost:
        s.host_bytes += t.desc.bytes;
        break;
      case Placement::kFp8:
        s.fp8_bytes += t.fp8_bytes;
        break;
      case Placement::kDropped:
        break;
    }
  }
  const PinnedStats p = pinned_->stats();
  s.pinned_in_use = p.in_use;
  s.pinned_cached = p.cached;
  s.pinned_peak = p.peak;
  s.pinned_capacity = p.capacity;
  s.pinned_allocs = p.allocs;
  s.pinned_hits = p.hits;
  s.pinned_failures = p.failures;
  s.scheduled_issued = sched_.issued();
  s.scheduled_max_inflight = sched_.max_inflight_seen();
  s.copy_wait_ns = copy_wait_ns_.load(std::memory_order_relaxed);
  return s;
}

}  // namespace bgl::enf
