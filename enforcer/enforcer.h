// Enforcer: carries out a plan on one device. Offload to pinned host (D2H stream; the device
// block is reused only after the copy), reload (H2D stream, after the offload's event), FP8
// storage (cast on the producer's stream, original freed), drop for recompute (callback when
// needed), the stream scheduler's O/R pieces and pressure eviction. C ABI: bgl/enforce.h.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "bgl/enforce.h"
#include "enforcer/device_ops.h"
#include "enforcer/pinned_pool.h"
#include "enforcer/stream_scheduler.h"
#include "enforcer/tracker.h"

namespace bgl::enf {

// Options (defaults as documented in bgl/enforce.h).
struct EnforcerOptions {
  std::size_t pinned_capacity = std::size_t{16} << 30;
  std::size_t fp8_block = 128;
  int max_inflight = 4;
  Stream d2h = nullptr;  // null: created and owned by the enforcer
  Stream h2d = nullptr;
  bool pressure_eviction = true;
  bool log = false;
  // Host backend only: no copy streams; copies and casts run on the calling thread (a null
  // stream there), so a copy the caller waits for costs no thread hand-off.
  bool sync_copies = false;
};

// Counters (the C ABI's struct).
using EnforcerStats = bgl_enf_stats;

// Recreates a dropped tensor; returns 0 and its data in *out on success.
using RecomputeFn =
    std::function<int(std::uint64_t handle, int producer_op, int micro_batch, void** out)>;

// See file comment. Thread safe (one recursive lock: callbacks may call back in).
class Enforcer final : private WorkIssuer {
 public:
  // Null with `error` set when the options are invalid or streams cannot be created.
  static std::unique_ptr<Enforcer> create(Pool* pool, std::unique_ptr<DeviceOps> ops,
                                          const EnforcerOptions& options, std::string* error);
  ~Enforcer() override;
  Enforcer(const Enforcer&) = delete;
  Enforcer& operator=(const Enforcer&) = delete;

  // Tracker.
  Status register_tensor(const TensorDesc& desc, std::uint64_t* handle);
  // register_tensor, its need order and its consumers (repeats ignored) under one lock.
  Status register_saved(const TensorDesc& desc, std::int64_t need_order, const int* consumers,
                        std::size_t count, std::uint64_t* handle);
  Status add_consumer(std::uint64_t handle, int consumer_op);
  Status lookup(const void* ptr, std::uint64_t* handle);
  Status info(std::uint64_t handle, bgl_enf_tensor_info* out);
  Status unregister(std::uint64_t handle);
  Status movable(int micro_batch, Strategy s, std::size_t* bytes, std::size_t* count);
  Status set_need_order(std::uint64_t handle, std::int64_t order);
  // Where the tensor is in the planner's stage graph (the issue order names these indices).
  Status set_graph_index(std::uint64_t handle, int producer_op, int graph_tensor);

  // Enforcement.
  Status set_strategy(std::uint64_t handle, Strategy s);
  Status apply(std::uint64_t handle, Strategy s);
  Status offload(std::uint64_t handle);
  Status reload(std::uint64_t handle);
  Status store_fp8(std::uint64_t handle);
  Status drop(std::uint64_t handle);
  void set_recompute(RecomputeFn fn);

  // Consumers.
  Status acquire(std::uint64_t handle, int consumer_op, Stream stream, void** ptr);
  Status release(std::uint64_t handle, int consumer_op, Stream stream);
  Status wait_tensor(std::uint64_t handle);
  Status synchronize();

  // Stream scheduler.
  Status schedule_begin(const std::vector<plan::IssueItem>& order, int offload_micro_batch,
                        int recover_micro_batch);
  Status schedule_reached(plan::Chain chain, int stage);
  // StreamScheduler::at under the lock; *passed as there.
  Status schedule_at(plan::Chain chain, int op, int* passed);
  Status schedule_poll(std::size_t* waiting);
  Status schedule_finish();
  // Up to `cap` handles whose offload, issued by the scheduler, completed since the last call
  // (a tensor retired meanwhile is left out); *count gets how many.
  Status take_offloaded(std::uint64_t* out, std::size_t cap, std::size_t* count);
  // Reloads offloaded tensors of `micro_batch` in need order (smallest first) while fewer than
  // max_inflight of its reloads wait for their first consumer; *issued (may be null) gets how
  // many started. kOutOfMemory when the pool has no room (the acquire reloads it later).
  Status prefetch(int micro_batch, std::size_t* issued);

  // Resizes the pinned host pool (see PinnedPool::set_capacity).
  Status set_pinned_capacity(std::size_t bytes);
  // Frees device memory until `needed` bytes: offloads owned, idle, never-moved tensors, needed
  // last first, then gives back reloads no consumer took yet (their pinned copy is kept).
  Status evict(std::size_t needed, std::size_t* freed);
  EnforcerStats stats();

  DeviceOps& ops() { return *ops_; }
  Pool& pool() { return *pool_; }
  Stream d2h_stream() const { return options_.d2h; }
  Stream h2d_stream() const { return options_.h2d; }
  std::size_t fp8_block() const { return options_.fp8_block; }

 private:
  Enforcer(Pool* pool, std::unique_ptr<DeviceOps> ops, const EnforcerOptions& options);

  Status fail(Status s, const std::string& message);
  // Under the lock, `body(TrackedTensor&)` on the tensor behind `handle`, or kUnknownHandle with
  // an error naming `fn` when there is none: the prologue of every per-tensor call.
  template <typename Body>
  Status with_tensor(std::uint64_t handle, const char* fn, Body&& body);
  Status offload_locked(TrackedTensor& t);
  Status reload_locked(TrackedTensor& t);
  Status fp8_locked(TrackedTensor& t);
  Status uncast_locked(TrackedTensor& t, Stream s);
  Status drop_locked(TrackedTensor& t);
  // Waits (bounded) for the tensor's offload and ready events; kBackendError naming `fn`.
  Status wait_events(TrackedTensor& t, const char* fn);
  Status recompute_locked(TrackedTensor& t, Stream s);
  Status unreload_locked(TrackedTensor& t);
  // The device data leaves after `s`'s queued work: freed when owned, else marked used on `s`
  // (borrowed pool memory); the ready event goes.
  void leave_device(TrackedTensor& t, Stream s);
  // Work queued on `s` from now on follows `e` (a bounded host wait on a null stream);
  // kBackendError naming `what` when it timed out.
  Status after(Stream s, const Event& e, const std::string& what);
  Status order_after_data(TrackedTensor& t, Stream s, const std::string& what);
  void set_ready(TrackedTensor& t, Stream s);
  void retire_locked(TrackedTensor& t, Stream s);
  std::size_t fp8_data_bytes(const TrackedTensor& t) const;

  // WorkIssuer (the scheduler's pieces).
  Status issue(const plan::IssueItem& item, Event* done, std::string* error) override;
  bool query(const Event& e) override { return ops_->query(e); }
  Status wait(const Event& e) override;
  void release(const Event& e) override { ops_->release(e); }

  Pool* pool_;
  std::unique_ptr<DeviceOps> ops_;
  EnforcerOptions options_;
  bool own_d2h_ = false, own_h2d_ = false;
  std::recursive_mutex mu_;
  ActivationTracker tracker_;
  std::unique_ptr<PinnedPool> pinned_;
  StreamScheduler sched_;
  RecomputeFn recompute_;
  int pressure_id_ = 0;
  int offload_mb_ = -1, recover_mb_ = -1;
  std::vector<std::uint64_t> scheduled_offloads_;  // issued by O pieces, not yet taken
  EnforcerStats stats_{};
  // stats_.copy_wait_ns, added to by waits that may run without mu_ (Enforcer::wait).
  std::atomic<std::uint64_t> copy_wait_ns_{0};
};

}  // namespace bgl::enf
