/* bgl/alloc.h — C ABI of libbgl_alloc.so: PyTorch's pluggable-allocator entry points and the
 * control API used by the BaGuaLu integration (ctypes) and tools.
 *
 * PyTorch: torch.cuda.memory.CUDAPluggableAllocator("libbgl_alloc.so", "bgl_alloc", "bgl_free").
 * The library does not export symbols named `alloc` or `free`: a global `free` would interpose
 * libc's free for every object that links or preloads the library (see docs/allocator.md).
 *
 * Functions returning int return a bgl_status; on failure bgl_alloc_last_error() describes it.
 * Everything is thread safe. Streams are cudaStream_t (CUDA backends) or host-stream handles
 * (host backend); pass them as void*. */
#ifndef BGL_ALLOC_H_
#define BGL_ALLOC_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define BGL_ALLOC_API __attribute__((visibility("default")))
#else
#define BGL_ALLOC_API
#endif

/* Result codes: the one status vocabulary of the project's C ABIs (bgl/alloc.h, bgl/enforce.h).
 * Values are stable; bgl_status_name gives each one's name. */
typedef enum bgl_status {
  BGL_OK = 0,
  BGL_ERR_INVALID_ARGUMENT = 1,
  BGL_ERR_OUT_OF_MEMORY = 2,
  BGL_ERR_FOREIGN_POINTER = 3,
  BGL_ERR_DOUBLE_FREE = 4,
  BGL_ERR_WRONG_SIZE = 5,
  BGL_ERR_WRONG_DEVICE = 6,
  BGL_ERR_BACKEND = 7,
  BGL_ERR_NOT_INITIALIZED = 8,
  BGL_ERR_BUFFER_TOO_SMALL = 9,
  BGL_ERR_ALREADY_INITIALIZED = 10,
  /* Returned by the enforcer (bgl/enforce.h). */
  BGL_ERR_UNKNOWN_HANDLE = 11,   /* no live tensor (or enforcer) with that handle */
  BGL_ERR_DUPLICATE = 12,        /* already registered (tensor pointer, consumer) */
  BGL_ERR_INVALID_STATE = 13,    /* e.g. reload of a tensor that was never offloaded */
  BGL_ERR_CONFLICT = 14,         /* the tensor was already moved under another strategy */
  BGL_ERR_PINNED_EXHAUSTED = 15, /* the pinned host pool has no room for the copy */
  BGL_ERR_CALLBACK = 16,         /* the recompute callback failed or is missing */
  BGL_ERR_INTERNAL = 17          /* an unexpected failure inside the library; see the message */
} bgl_status;

/* Pluggable-allocator pair, signatures as PyTorch casts them. Null on failure. `size` in
 * bgl_free is the size passed to bgl_alloc (0: not checked). */
BGL_ALLOC_API void* bgl_alloc(size_t size, int device, void* stream);
BGL_ALLOC_API void bgl_free(void* ptr, size_t size, int device, void* stream);

/* Sets the configuration ("backend:host,capacity:8GiB,...", the BGL_ALLOC_CONF syntax).
 * Without a call, BGL_ALLOC_CONF is read on first use. Reconfiguring is refused
 * (BGL_ERR_ALREADY_INITIALIZED) while any allocation is live. */
BGL_ALLOC_API int bgl_alloc_configure(const char* conf);

/* Counters of one device's pool (sizes in bytes). */
typedef struct bgl_alloc_stats {
  int64_t allocated_bytes, allocated_bytes_peak;
  int64_t requested_bytes, requested_bytes_peak;
  int64_t active_bytes, active_bytes_peak;
  int64_t reserved_bytes, reserved_bytes_peak;
  int64_t allocations, allocations_peak;
  int64_t segments, segments_peak;
  uint64_t num_allocs, num_frees, num_maps, num_unmaps, num_ooms;
  uint64_t num_steals, num_syncs, num_releases, num_pressure_calls, pressure_bytes_freed;
  uint64_t num_invalid_size, num_foreign_free, num_double_free, num_wrong_size, num_wrong_device;
  uint64_t inactive_bytes, largest_free_block, limit_bytes, physical_bytes;
  double fragmentation; /* 1 - largest free block / cached bytes */
} bgl_alloc_stats;

BGL_ALLOC_API int bgl_alloc_get_stats(int device, bgl_alloc_stats* out);
BGL_ALLOC_API int bgl_alloc_reset_peak_stats(int device);
/* The stats as a JSON object into buf (NUL terminated); *needed gets the size required. */
BGL_ALLOC_API int bgl_alloc_stats_json(int device, char* buf, size_t cap, size_t* needed);

/* Snapshot of all devices in PyTorch's memory-snapshot layout (segments, device_traces,
 * allocator_settings) as JSON. Same buffer protocol as bgl_alloc_stats_json. */
BGL_ALLOC_API int bgl_alloc_snapshot_json(char* buf, size_t cap, size_t* needed);
/* Keeps the last max_entries trace events per device (0: stop recording). */
BGL_ALLOC_API int bgl_alloc_record_history(int device, size_t max_entries);

/* Unmaps every cached page of a device (-1: all devices). *released (may be null) gets bytes. */
BGL_ALLOC_API int bgl_alloc_empty_cache(int device, size_t* released);
/* Marks ptr as used on another stream; it is reused only after that stream's work completes. */
BGL_ALLOC_API int bgl_alloc_record_stream(void* ptr, int device, void* stream);

/* Memory pressure: called without allocator locks before an allocation fails; free about
 * bytes_needed (it may call bgl_free) and return the bytes freed. */
typedef size_t (*bgl_pressure_fn)(int device, size_t bytes_needed, void* user);
BGL_ALLOC_API int bgl_alloc_add_pressure_callback(int device, bgl_pressure_fn fn, void* user,
                                                  int* handle);
BGL_ALLOC_API int bgl_alloc_remove_pressure_callback(int device, int handle);

/* Segment hooks: after memory is mapped (mapped=1) and before it is unmapped (mapped=0).
 * Called under the pool lock: must not call back into the allocator. */
typedef void (*bgl_segment_fn)(int device, void* addr, size_t bytes, int mapped, void* user);
BGL_ALLOC_API int bgl_alloc_add_segment_hook(int device, bgl_segment_fn fn, void* user,
                                             int* handle);
BGL_ALLOC_API int bgl_alloc_remove_segment_hook(int device, int handle);

/* The name of a bgl_status value, lower case without the prefix ("ok", "out_of_memory",
 * "pinned_exhausted"); null for a value that is none. */
BGL_ALLOC_API const char* bgl_status_name(int status);
/* The value of a bgl_status name as bgl_status_name spells it (BGL_ERR_INVALID_ARGUMENT for an
 * unknown one, *value unchanged). */
BGL_ALLOC_API int bgl_status_value(const char* name, int* value);

/* Parses a byte size as every part of the project reads one (flags, YAML, BGL_ALLOC_CONF, model
 * files): a bare number or "B" is bytes, KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB powers
 * of 1000 (any case), fractions are rounded to whole bytes ("1.5GiB"); a bare K/M/G/T is refused
 * as ambiguous. `what` (may be null) names the value in the error message. On failure returns
 * BGL_ERR_INVALID_ARGUMENT, leaves *bytes unchanged, and bgl_alloc_last_error() says why, e.g.
 * "capacity: '8G' is ambiguous: write 8GiB (2^30 bytes each) or 8GB (10^9)". */
BGL_ALLOC_API int bgl_parse_bytes(const char* text, const char* what, int64_t* bytes);

/* Fault injection (docs/operations.md, "Fault injection"; BGL_FAULT reads the same spec at
 * start): "device:N", "pinned:N", "copy:N" fail the Nth operation of that kind counted from
 * this call (device: the pool's growth; pinned: the enforcer's page-locked host allocations;
 * copy: its copies and FP8 casts), "stall:N" holds the Nth copy's stream for
 * BGL_FAULT_STALL_MS (default twice BGL_WAIT_TIMEOUT_MS), several separated by commas; "count"
 * only counts; "" or null turns injection off. Every host wait for stream work gives up with
 * BGL_ERR_BACKEND after BGL_WAIT_TIMEOUT_MS (default 60000); wait_timeout_ms > 0 sets it. */
BGL_ALLOC_API int bgl_alloc_fault_configure(const char* spec, int64_t wait_timeout_ms);
typedef struct bgl_alloc_fault_stats {
  uint64_t device_ops, pinned_ops, copy_ops; /* operations seen since the last configure */
  uint64_t fired;                            /* faults injected */
  int64_t pinned_blocks_live; /* page-locked blocks the enforcers hold (injection on or off) */
} bgl_alloc_fault_stats;
BGL_ALLOC_API int bgl_alloc_fault_get_stats(bgl_alloc_fault_stats* out);

/* The calling thread's last error message ("" when none). Valid until the next call. */
BGL_ALLOC_API const char* bgl_alloc_last_error(void);
/* Number of devices of the configured backend (initializing it if needed); -1 on error. */
BGL_ALLOC_API int bgl_alloc_device_count(void);

#ifdef __cplusplus
}
#endif

#endif /* BGL_ALLOC_H_ */
