/* bgl/enforce.h — C ABI of the BaGuaLu enforcer, exported by libbgl_enforce.so (which links
 * libbgl_alloc.so and works on its pool; load libbgl_alloc.so first).
 *
 * The enforcer carries out a plan on one device: it tracks saved activations (one tracked tensor
 * per storage, with every consumer that saved it), moves them where the plan says (offload to a
 * pinned host pool, FP8 e4m3 with per-block scales, drop for recompute), brings them back before
 * their consumers run, and issues that work on side streams at the stage boundaries of the plan's
 * dual-batch issue order. It also registers a pressure callback with the allocator so that an
 * allocation that would fail first offloads the tracked activations needed last.
 *
 * Conventions
 *  - Every function returns a bgl_status (bgl/alloc.h: one status enum for both libraries); on
 *    failure the calling thread's message is available from bgl_enf_last_error() (same text as
 *    bgl_alloc_last_error()) and the enforcer's state is unchanged. A C++ exception never crosses
 *    the ABI: it becomes BGL_ERR_OUT_OF_MEMORY (host memory) or BGL_ERR_INTERNAL, with its text.
 *  - Pointers are device pointers (host-backend pointers without a GPU); sizes are bytes.
 *  - Streams are cudaStream_t on CUDA backends and host-stream handles (bgl_enf_stream_create)
 *    on the host backend, passed as void*. A null stream is the legacy default stream (CUDA) or
 *    "run synchronously on the calling thread" (host backend).
 *  - Handles are uint64_t, never 0, never reused within one enforcer.
 *  - All functions are thread safe. Callbacks (recompute) run on the calling thread and may call
 *    back into the enforcer and the allocator.
 *
 * Ownership of device memory (bgl_enf_tensor_desc.flags)
 *  - BGL_ENF_OWNED: `ptr` is a live bgl_alloc allocation of this device that the caller hands
 *    over; the enforcer frees it (stream ordered) when the tensor leaves the device or is retired.
 *    The caller must not bgl_free it.
 *  - borrowed (flags 0): the caller keeps the memory and frees it itself once the tensor has left
 *    the device (placement != DEVICE). If it is a bgl_alloc allocation, the enforcer marks it used
 *    on the copy stream (bgl_alloc_record_stream), so an early free is still safe; foreign memory
 *    must not be freed before bgl_enf_wait_tensor returns.
 *  Memory the enforcer creates (reloads, FP8 copies, uncast results) is always owned by it and is
 *  freed when the tensor is retired (all consumers released) or unregistered.
 *
 * Consistency rules
 *  - A tensor with several consumers is moved once; every consumer gets the same pointer back.
 *  - A reload never starts before its offload finished (the H2D stream waits on the D2H event).
 *  - An FP8 and a full-precision copy of one tensor never coexist once the plan is applied: an
 *    owned original is freed as soon as the cast is queued; the FP8 copy is freed as soon as the
 *    uncast is queued.
 *
 * Use by the PyTorch package (integrations/pytorch/bagualu: enforcer.py, record.py, issue.py):
 *   forward pack:    bgl_enf_register_saved(desc, need order, first saver) (borrowed),
 *                    bgl_enf_add_consumer(op) per later saver;
 *                    bgl_enf_set_strategy(h, s); FP8 and recompute right after the producer
 *                    (bgl_enf_store_fp8, bgl_enf_drop + the recompute callback); an offload is
 *                    issued at once (bgl_enf_offload) or left to the issue order
 *   forward end:     bgl_enf_set_graph_index, bgl_enf_set_need_order for planned offloads
 *   schedule point:  bgl_enf_schedule_begin(issue order); bgl_enf_schedule_at(chain, op) at
 *                    every operator call (F) and unpack (B); bgl_enf_take_offloaded (after
 *                    bgl_enf_schedule_poll) to let go of offloaded device data;
 *                    bgl_enf_schedule_finish at the next point or iteration end
 *   backward:        bgl_enf_prefetch(micro_batch); bgl_enf_acquire(h, -1, stream, &ptr) ...
 *                    bgl_enf_release(h, -1, stream) when PyTorch lets go of the block;
 *                    bgl_enf_unregister when the record is gone
 * Functions marked "Test and tool support" are not used by the package: they exist for the C++
 * and C ABI tests, benchmarks and integrations that drive the enforcer by hand.
 */
#ifndef BGL_ENFORCE_H_
#define BGL_ENFORCE_H_

#include <stddef.h>
#include <stdint.h>

#include "bgl/alloc.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Element types (FP8 storage accepts F32, F16, BF16; BYTES can be offloaded or dropped only). */
typedef enum bgl_dtype {
  BGL_DTYPE_F32 = 0,
  BGL_DTYPE_F16 = 1,
  BGL_DTYPE_BF16 = 2,
  BGL_DTYPE_BYTES = 3
} bgl_dtype;

/* Strategies, numbered as the planner's Strategy (governor/planner/assignment.h). */
typedef enum bgl_strategy {
  BGL_STRATEGY_KEEP = 0,
  BGL_STRATEGY_RECOMPUTE = 1,
  BGL_STRATEGY_OFFLOAD = 2,
  BGL_STRATEGY_FP8 = 3
} bgl_strategy;

/* Where a tracked tensor's data is. */
typedef enum bgl_placement {
  BGL_PLACE_DEVICE = 0, /* full precision on the device (possibly still being reloaded) */
  BGL_PLACE_HOST = 1,   /* in the pinned host pool (possibly still being offloaded) */
  BGL_PLACE_FP8 = 2,    /* on the device as e4m3 plus per-block FP32 scales */
  BGL_PLACE_DROPPED = 3 /* freed; the recompute callback recreates it */
} bgl_placement;

/* Dual-batch chains and resources, numbered as the planner's Chain and Resource
 * (governor/planner/dual_batch.h). */
typedef enum bgl_chain {
  BGL_CHAIN_FORWARD = 0,
  BGL_CHAIN_BACKWARD = 1,
  BGL_CHAIN_OFFLOAD = 2,
  BGL_CHAIN_RECOVER = 3
} bgl_chain;
typedef enum bgl_resource {
  BGL_RES_COMPUTE = 0,
  BGL_RES_COMM = 1,
  BGL_RES_D2H = 2,
  BGL_RES_H2D = 3
} bgl_resource;

#define BGL_ENF_OWNED 1u /* bgl_enf_tensor_desc.flags: the enforcer owns ptr (see above) */

typedef struct bgl_enforcer bgl_enforcer; /* opaque */

/* Options of bgl_enf_create; fill with bgl_enf_default_options first. */
typedef struct bgl_enf_options {
  int device;             /* device whose allocator pool the enforcer uses (default 0) */
  size_t pinned_capacity; /* bytes of page-locked host memory (default 16 GiB) */
  size_t fp8_block;       /* elements per FP8 scale (default 128) */
  int max_inflight;       /* scheduled offload/reload pieces in flight at most (default 4) */
  void* d2h_stream;       /* null: the enforcer creates (and destroys) its own */
  void* h2d_stream;       /* null: the enforcer creates (and destroys) its own */
  int pressure_eviction;  /* 1 (default): offload activations when an allocation would fail */
  int log;                /* 1: echo errors to stderr as "bgl_enf: ..." (default 0) */
  int sync_copies;        /* 1: the host backend's copies and casts run on the calling thread,
                             without copy threads (where they would not overlap compute anyway:
                             no hand-off per copy); ignored on CUDA (default 0) */
  const char* emulated_link; /* null (default), or a calibration document (JSON text, the
                             planner's format) with an "emulated_link" section: the host
                             backend's offload and reload copies then take the time of its
                             offload and reload rooflines (docs/planner.md, "An emulated device
                             link"); host backend and sync_copies 0 only */
} bgl_enf_options;

/* Description of a saved activation for bgl_enf_register. */
typedef struct bgl_enf_tensor_desc {
  void* ptr;        /* device data */
  size_t bytes;     /* size in bytes (> 0; a multiple of the element size for FP8) */
  int dtype;        /* bgl_dtype */
  int producer_op;  /* operator index that produced it (stage graph order) */
  int graph_tensor; /* tensor index in the planner's stage graph (-1: unknown) */
  int micro_batch;  /* micro-batch id */
  void* stream;     /* stream the producer wrote it on; casts and drops are ordered there */
  uint32_t flags;   /* BGL_ENF_OWNED or 0 */
} bgl_enf_tensor_desc;

/* State of one tracked tensor. */
typedef struct bgl_enf_tensor_info {
  int placement; /* bgl_placement */
  int applied;   /* bgl_strategy that moved it (KEEP: never moved) */
  int planned;   /* bgl_strategy from bgl_enf_set_strategy */
  int pending;   /* 1 while a copy/cast it depends on may still run */
  int num_consumers, num_released;
  size_t bytes;
  void* device_ptr;   /* null unless placement is DEVICE */
  void* host_ptr;     /* pinned copy (placement HOST) */
  void* fp8_ptr;      /* e4m3 data followed by the scales (placement FP8) */
  size_t fp8_bytes;   /* bytes of the FP8 buffer (data, padding to 16, scales) */
  int64_t need_order; /* eviction order key: larger = needed later */
} bgl_enf_tensor_info;

/* Counters of one enforcer. */
typedef struct bgl_enf_stats {
  uint64_t tracked, registered, retired;
  uint64_t offloads, reloads, fp8_casts, fp8_uncasts, drops, recomputes;
  uint64_t bytes_d2h, bytes_h2d, bytes_fp8_saved;
  uint64_t evictions, evicted_bytes, pressure_calls;
  uint64_t unreloads; /* reloads no consumer took, given back under pressure (data on host) */
  uint64_t scheduled_issued, scheduled_max_inflight;
  uint64_t device_bytes, host_bytes, fp8_bytes; /* of tracked tensors, by placement */
  uint64_t pinned_in_use, pinned_cached, pinned_peak, pinned_capacity;
  uint64_t pinned_allocs, pinned_hits, pinned_failures;
  /* Nanoseconds callers spent blocked in the enforcer waiting for copies and casts to finish
   * (a consumer's reload, a release's offload, a synchronize): the copy time compute did not
   * hide. Host waits only; on CUDA, stream-ordered waits cost the caller nothing. */
  uint64_t copy_wait_ns;
} bgl_enf_stats;

/* One item of the plan's dual-batch issue order (planner IssueItem). first/last: tensor indices
 * (graph_tensor) for OFFLOAD items and RECOVER items on H2D (reloads); producer operator indices
 * for RECOVER items on COMPUTE (recomputes) and for FORWARD/BACKWARD items. */
typedef struct bgl_enf_issue_item {
  int chain;    /* bgl_chain */
  int stage;    /* index within its chain, increasing */
  int round;    /* DP round, non-decreasing along the order */
  int resource; /* bgl_resource */
  int first, last;
} bgl_enf_issue_item;

/* Recreates a dropped tensor: run the producer again and return its data in *out_ptr (bytes of
 * the registered size, same ownership as the registration). Return 0 on success. Called at most
 * once per drop, when the tensor is first needed (schedule or acquire). */
typedef int (*bgl_enf_recompute_fn)(uint64_t handle, int producer_op, int micro_batch, void* user,
                                    void** out_ptr);

/* --- lifetime -------------------------------------------------------------------------------- */
BGL_ALLOC_API void bgl_enf_default_options(bgl_enf_options* options);
/* Creates an enforcer over the allocator's pool of options->device. */
BGL_ALLOC_API int bgl_enf_create(const bgl_enf_options* options, bgl_enforcer** out);
/* Waits for all queued work, frees everything the enforcer owns, unregisters the pressure
 * callback. Null is accepted. */
BGL_ALLOC_API int bgl_enf_destroy(bgl_enforcer* enf);

/* --- streams (mainly for the host backend and tests) ------------------------------------------ */
/* Test and tool support.
 * A new stream of the allocator's backend (host stream, or a non-blocking cudaStream_t). */
BGL_ALLOC_API int bgl_enf_stream_create(bgl_enforcer* enf, void** stream);
BGL_ALLOC_API int bgl_enf_stream_destroy(bgl_enforcer* enf, void* stream);
BGL_ALLOC_API int bgl_enf_stream_synchronize(bgl_enforcer* enf, void* stream);

/* --- tracker --------------------------------------------------------------------------------- */
/* Tracks a saved activation. BGL_ERR_DUPLICATE when ptr is already a tracked device tensor (use
 * bgl_enf_lookup + bgl_enf_add_consumer for a storage saved twice). */
BGL_ALLOC_API int bgl_enf_register(bgl_enforcer* enf, const bgl_enf_tensor_desc* desc,
                                   uint64_t* handle);
/* bgl_enf_register, bgl_enf_set_need_order(need_order) and bgl_enf_add_consumer of each of the
 * `count` operators in `consumers` (may be null when count is 0; repeats are ignored) in one
 * call: what a saved-tensor hook does per new storage, without a crossing of the ABI per step.
 * BGL_ERR_DUPLICATE as bgl_enf_register (nothing registered). */
BGL_ALLOC_API int bgl_enf_register_saved(bgl_enforcer* enf, const bgl_enf_tensor_desc* desc,
                                         int64_t need_order, const int* consumers, size_t count,
                                         uint64_t* handle);
/* bgl_enf_register_saved, then bgl_enf_offload of the new tensor, in one call: the pack of a
 * storage whose operator's strategy is offload, carried out at once. When the registration
 * fails nothing is registered (*handle 0); when the offload fails (e.g. the pinned pool is full)
 * the tensor stays registered and on the device: *handle is set and the offload's error is
 * returned. */
BGL_ALLOC_API int bgl_enf_offload_saved(bgl_enforcer* enf, const bgl_enf_tensor_desc* desc,
                                        int64_t need_order, const int* consumers, size_t count,
                                        uint64_t* handle);
/* bgl_enf_register_saved, then bgl_enf_store_fp8 of the new tensor, in one call: the pack of a
 * storage whose operator's strategy is fp8, carried out at once; *fp8_bytes (may be null) gets
 * the FP8 buffer's bytes (bgl_enf_tensor_info.fp8_bytes). Failures as bgl_enf_offload_saved's:
 * a failed registration registers nothing (*handle 0); a failed cast (not F32/F16/BF16, or no
 * room for the FP8 buffer) leaves the tensor registered on the device, *handle set and the
 * cast's error returned. */
BGL_ALLOC_API int bgl_enf_store_fp8_saved(bgl_enforcer* enf, const bgl_enf_tensor_desc* desc,
                                          int64_t need_order, const int* consumers, size_t count,
                                          uint64_t* handle, size_t* fp8_bytes);
/* Adds a consumer (operator index) that saved the tensor; BGL_ERR_DUPLICATE if already added. */
BGL_ALLOC_API int bgl_enf_add_consumer(bgl_enforcer* enf, uint64_t handle, int consumer_op);
/* Test and tool support.
 * The tracked tensor whose device data is at ptr; BGL_ERR_UNKNOWN_HANDLE if none. */
BGL_ALLOC_API int bgl_enf_lookup(bgl_enforcer* enf, const void* ptr, uint64_t* handle);
BGL_ALLOC_API int bgl_enf_query(bgl_enforcer* enf, uint64_t handle, bgl_enf_tensor_info* out);
/* Forgets a tensor at once, waiting for its queued copies and freeing what the enforcer owns. */
BGL_ALLOC_API int bgl_enf_unregister(bgl_enforcer* enf, uint64_t handle);
/* Test and tool support.
 * Bytes that applying `strategy` to every device-resident tensor of micro_batch (-1: all) would
 * free on the device, and how many tensors that is (either pointer may be null). */
BGL_ALLOC_API int bgl_enf_movable(bgl_enforcer* enf, int micro_batch, int strategy, size_t* bytes,
                                  size_t* count);
/* Eviction order key (larger = needed later; pressure eviction takes the largest first). The
 * default is micro_batch * 2^32 + (2^31 - 1 - producer_op): later micro-batches, and within one,
 * earlier operators (their backward runs last). */
BGL_ALLOC_API int bgl_enf_set_need_order(bgl_enforcer* enf, uint64_t handle, int64_t order);
/* Where the tensor is in the planner's stage graph: its producer operator and its graph tensor
 * index (-1: unknown), as the issue order names them. A tensor registered before the graph was
 * known gets them here. */
BGL_ALLOC_API int bgl_enf_set_graph_index(bgl_enforcer* enf, uint64_t handle, int producer_op,
                                          int graph_tensor);
/* The vocabulary of this ABI by name, so that integrations retype no number: the value of `name`
 * in `kind`, and the name of a value. The kinds, with their names in value order (0, 1, ...):
 *   "strategy"  keep, recompute, offload, fp8 (bgl_strategy; the planner's names)
 *   "chain"     F, B, O, R (bgl_chain; the planner's names)
 *   "resource"  compute, comm, d2h, h2d (bgl_resource; the planner's names)
 *   "placement" device, host, fp8, dropped (bgl_placement)
 *   "dtype"     f32, f16, bf16, bytes (bgl_dtype)
 *   "status"    ok, invalid_argument, ..., internal (bgl_status; as bgl_status_name spells them)
 * BGL_ERR_INVALID_ARGUMENT for an unknown kind, name or value (the output is left unchanged). The
 * returned name is a static string. */
BGL_ALLOC_API int bgl_enf_enum_value(const char* kind, const char* name, int* value);
BGL_ALLOC_API int bgl_enf_enum_name(const char* kind, int value, const char** name);

/* --- enforcement ----------------------------------------------------------------------------- */
/* Records the plan's strategy for a tensor; the stream scheduler applies OFFLOAD (and the
 * RECOVER chain brings HOST/DROPPED tensors back). Does not move anything. */
BGL_ALLOC_API int bgl_enf_set_strategy(bgl_enforcer* enf, uint64_t handle, int strategy);
/* Test and tool support.
 * Applies a strategy now. Idempotent: applying the strategy that already moved the tensor is a
 * no-op (a tensor of several consumers is moved once); another strategy gives BGL_ERR_CONFLICT. */
BGL_ALLOC_API int bgl_enf_apply(bgl_enforcer* enf, uint64_t handle, int strategy);
/* Device -> pinned host on the D2H stream, after the producer's stream. */
BGL_ALLOC_API int bgl_enf_offload(bgl_enforcer* enf, uint64_t handle);
/* Test and tool support.
 * Pinned host -> a new device block on the H2D stream, after the offload's event. A no-op when a
 * reload is already issued; BGL_ERR_INVALID_STATE when the tensor was never offloaded. */
BGL_ALLOC_API int bgl_enf_reload(bgl_enforcer* enf, uint64_t handle);
/* Casts to e4m3 with per-block scales on the producer's stream; frees an owned original. */
BGL_ALLOC_API int bgl_enf_store_fp8(bgl_enforcer* enf, uint64_t handle);
/* Frees (owned) or gives up (borrowed) the device data; the recompute callback recreates it. */
BGL_ALLOC_API int bgl_enf_drop(bgl_enforcer* enf, uint64_t handle);
BGL_ALLOC_API int bgl_enf_set_recompute_callback(bgl_enforcer* enf, bgl_enf_recompute_fn fn,
                                                 void* user);

/* --- consumers ------------------------------------------------------------------------------- */
/* Makes the tensor resident for consumer_op (-1: any) and returns its device pointer in *ptr:
 * reloads (if not yet issued), uncasts FP8, or recomputes; `stream` is made to wait for the data.
 * Every consumer gets the same pointer. */
BGL_ALLOC_API int bgl_enf_acquire(bgl_enforcer* enf, uint64_t handle, int consumer_op, void* stream,
                                  void** ptr);
/* The consumer is done (its work is queued on `stream`). When every registered consumer has
 * released (or at once when none is registered) the tensor is retired and its memory freed after
 * `stream`'s work. */
BGL_ALLOC_API int bgl_enf_release(bgl_enforcer* enf, uint64_t handle, int consumer_op,
                                  void* stream);
/* Blocks until every queued copy/cast of the tensor has completed. */
BGL_ALLOC_API int bgl_enf_wait_tensor(bgl_enforcer* enf, uint64_t handle);
/* Blocks until all enforcer work (both copy streams, scheduled pieces) has completed. */
BGL_ALLOC_API int bgl_enf_synchronize(bgl_enforcer* enf);

/* --- stream scheduler ------------------------------------------------------------------------ */
/* Loads a scheduling point's issue order. OFFLOAD items move tensors of offload_micro_batch whose
 * planned strategy is OFFLOAD; RECOVER items bring back tensors of recover_micro_batch. Items of
 * a chain must have increasing stages and rounds must not decrease (BGL_ERR_INVALID_ARGUMENT).
 * Work left from a previous order is issued first (waiting only where max_inflight holds an
 * issue back); what is still in flight completes beside the new order and counts against its
 * bound: no wait for the previous point's copies (bgl_enf_schedule_finish waits for all). */
BGL_ALLOC_API int bgl_enf_schedule_begin(bgl_enforcer* enf, const bgl_enf_issue_item* items,
                                         size_t count, int offload_micro_batch,
                                         int recover_micro_batch);
/* Compute reached the start of stage `stage` of chain FORWARD or BACKWARD: issues every OFFLOAD/
 * RECOVER item of that round or earlier, in order, keeping at most max_inflight in flight (the
 * rest are issued by later calls as earlier pieces complete). */
BGL_ALLOC_API int bgl_enf_schedule_reached(bgl_enforcer* enf, int chain, int stage);
/* Compute of chain FORWARD entered operator `op`, or compute of chain BACKWARD needs what `op`
 * produced (stage-graph operator indices; the items' `first`): every stage of that chain compute
 * passed since the last call is reached (as bgl_enf_schedule_reached): the forward passes a stage
 * once op >= its first operator, the backward once op <= it. *passed (may be null) gets how many
 * (0, the common case: nothing else happens). op < 0: nothing passed. Cheap enough to call at
 * every operator call and every unpack. */
BGL_ALLOC_API int bgl_enf_schedule_at(bgl_enforcer* enf, int chain, int op, int* passed);
/* Retires completed pieces and issues what the bound allowed; *waiting (may be null) gets the
 * number of items not yet issued. */
BGL_ALLOC_API int bgl_enf_schedule_poll(bgl_enforcer* enf, size_t* waiting);
/* Issues everything left (respecting the bound) and waits for all of it. */
BGL_ALLOC_API int bgl_enf_schedule_finish(bgl_enforcer* enf);
/* Up to `cap` handles (in issue order) whose offload, issued by an O piece, has completed since
 * the last call: the integration lets go of the device data it still holds for them (borrowed
 * tensors). *count gets how many; call again while it equals cap. */
BGL_ALLOC_API int bgl_enf_take_offloaded(bgl_enforcer* enf, uint64_t* handles, size_t cap,
                                         size_t* count);
/* Reloads offloaded tensors of micro_batch in need order (smallest first) while fewer than
 * max_inflight of its reloads wait for their first acquire; *issued (may be null) gets how many
 * started. Call when its backward starts and after each acquire. BGL_ERR_OUT_OF_MEMORY when the
 * pool has no room yet (the acquire reloads the tensor when it is needed). */
BGL_ALLOC_API int bgl_enf_prefetch(bgl_enforcer* enf, int micro_batch, size_t* issued);

/* --- memory pressure and statistics ---------------------------------------------------------- */
/* Resizes the pinned host pool (the governor's host grant for this process changed): cached
 * blocks beyond the new capacity are freed at once; copies in use above it stay until they come
 * back, and offloads fail with BGL_ERR_PINNED_EXHAUSTED until the pool fits. */
BGL_ALLOC_API int bgl_enf_set_pinned_capacity(bgl_enforcer* enf, size_t bytes);
/* Frees device memory until bytes_needed are freed or nothing is left: offloads owned, idle,
 * never-moved tensors in need order (needed last first), then gives back reloads no consumer
 * took yet (their pinned copy is still there: the acquire reloads again). *freed (may be null)
 * gets the bytes freed. The pool's pressure callback (pressure_eviction) and the package's own
 * pressure handler call this. */
BGL_ALLOC_API int bgl_enf_evict(bgl_enforcer* enf, size_t bytes_needed, size_t* freed);
BGL_ALLOC_API int bgl_enf_get_stats(bgl_enforcer* enf, bgl_enf_stats* out);
/* Same as bgl_alloc_last_error(). */
BGL_ALLOC_API const char* bgl_enf_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* BGL_ENFORCE_H_ */
