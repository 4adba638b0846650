// C ABI (bgl/alloc.h) over the process-wide Allocator.
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "allocator/detail/fault.h"
#include "allocator/global.h"
#include "allocator/snapshot.h"
#include "base/units.h"
#include "bgl/alloc.h"

namespace bgl::alloc {

// One status vocabulary: the C ABI's numbers are the C++ Status values.
#define BGL_SAME_STATUS(c, k) static_assert(c == static_cast<int>(Status::k), #c)
BGL_SAME_STATUS(BGL_OK, kOk);
BGL_SAME_STATUS(BGL_ERR_INVALID_ARGUMENT, kInvalidArgument);
BGL_SAME_STATUS(BGL_ERR_OUT_OF_MEMORY, kOutOfMemory);
BGL_SAME_STATUS(BGL_ERR_FOREIGN_POINTER, kForeignPointer);
BGL_SAME_STATUS(BGL_ERR_DOUBLE_FREE, kDoubleFree);
BGL_SAME_STATUS(BGL_ERR_WRONG_SIZE, kWrongSize);
BGL_SAME_STATUS(BGL_ERR_WRONG_DEVICE, kWrongDevice);
BGL_SAME_STATUS(BGL_ERR_BACKEND, kBackendError);
BGL_SAME_STATUS(BGL_ERR_NOT_INITIALIZED, kNotInitialized);
BGL_SAME_STATUS(BGL_ERR_BUFFER_TOO_SMALL, kBufferTooSmall);
BGL_SAME_STATUS(BGL_ERR_ALREADY_INITIALIZED, kAlreadyInitialized);
BGL_SAME_STATUS(BGL_ERR_UNKNOWN_HANDLE, kUnknownHandle);
BGL_SAME_STATUS(BGL_ERR_DUPLICATE, kDuplicate);
BGL_SAME_STATUS(BGL_ERR_INVALID_STATE, kInvalidState);
BGL_SAME_STATUS(BGL_ERR_CONFLICT, kConflict);
BGL_SAME_STATUS(BGL_ERR_PINNED_EXHAUSTED, kPinnedExhausted);
BGL_SAME_STATUS(BGL_ERR_CALLBACK, kCallbackError);
BGL_SAME_STATUS(BGL_ERR_INTERNAL, kInternal);
#undef BGL_SAME_STATUS
static_assert(kStatusCount == BGL_ERR_INTERNAL + 1);

namespace {

std::mutex g_mu;
std::atomic<Allocator*> g_alloc{nullptr};
std::vector<Allocator*>* g_retired = nullptr;  // replaced allocators, kept alive

Allocator* build(const char* conf) {
  Config c;
  std::string error;
  if (conf != nullptr && !parse_config(conf, &c, &error)) {
    report_error(true, error);
    return nullptr;
  }
  auto a = Allocator::create(c, &error);
  if (a == nullptr) {
    report_error(c.pool.log, error);
    return nullptr;
  }
  return a.release();
}

int status(Status s) { return static_cast<int>(s); }

Pool* pool_or_error(int device) {
  Allocator* a = global_allocator();
  if (a == nullptr) return nullptr;
  return a->pool(device);
}

int copy_out(const std::string& s, char* buf, std::size_t cap, std::size_t* needed) {
  if (needed != nullptr) *needed = s.size() + 1;
  if (buf == nullptr || cap < s.size() + 1) {
    report_error(false, "buffer too small: need " + std::to_string(s.size() + 1) + " bytes");
    return status(Status::kBufferTooSmall);
  }
  std::memcpy(buf, s.c_str(), s.size() + 1);
  return BGL_OK;
}

}  // namespace

Allocator* global_allocator() {
  Allocator* a = g_alloc.load(std::memory_order_acquire);
  if (a != nullptr) return a;
  std::lock_guard<std::mutex> lock(g_mu);
  a = g_alloc.load(std::memory_order_acquire);
  if (a != nullptr) return a;
  a = build(std::getenv("BGL_ALLOC_CONF"));
  g_alloc.store(a, std::memory_order_release);
  return a;
}

Status configure_global(const char* conf) {
  std::lock_guard<std::mutex> lock(g_mu);
  Allocator* old = g_alloc.load(std::memory_order_acquire);
  if (old != nullptr) {
    for (int d = 0; d < old->device_count(); ++d) {
      Pool* p = old->existing_pool(d);
      if (p != nullptr && p->stats().allocations.current != 0) {
        report_error(true, "bgl_alloc_configure: allocations are live on device " +
                               std::to_string(d) + "; configuration unchanged");
        return Status::kAlreadyInitialized;
      }
    }
  }
  Allocator* a = build(conf == nullptr ? "" : conf);
  if (a == nullptr) return Status::kInvalidArgument;
  if (old != nullptr) {
    if (g_retired == nullptr) g_retired = new std::vector<Allocator*>();
    g_retired->push_back(old);  // other threads may still hold it
  }
  g_alloc.store(a, std::memory_order_release);
  return Status::kOk;
}

bool global_owns(const void* ptr, int* device) {
  Allocator* a = g_alloc.load(std::memory_order_acquire);
  if (a == nullptr || ptr == nullptr) return false;
  for (int d = 0; d < a->device_count(); ++d) {
    Pool* p = a->existing_pool(d);
    if (p != nullptr && p->is_allocated(ptr)) {
      *device = d;
      return true;
    }
  }
  return false;
}

}  // namespace bgl::alloc

using namespace bgl::alloc;  // NOLINT: C ABI implementation file

extern "C" {

BGL_ALLOC_API void* bgl_alloc(size_t size, int device, void* stream) {
  // PyTorch asks for empty tensors' memory too; like its own allocator, answer null quietly
  // (no message, no last error), but count it (num_invalid_size) as the docs say.
  if (size == 0) {
    if (Allocator* a = global_allocator();
        a != nullptr && device >= 0 && device < a->device_count()) {
      if (Pool* p = a->pool(device)) p->count_empty_request();
    }
    return nullptr;
  }
  Allocator* a = global_allocator();
  return a == nullptr ? nullptr : a->allocate(size, device, stream);
}

BGL_ALLOC_API void bgl_free(void* ptr, size_t size, int device, void* stream) {
  Allocator* a = global_allocator();
  if (a != nullptr) a->deallocate(ptr, size, device, stream);
}

BGL_ALLOC_API int bgl_alloc_configure(const char* conf) { return status(configure_global(conf)); }

BGL_ALLOC_API int bgl_alloc_get_stats(int device, bgl_alloc_stats* out) {
  if (out == nullptr) {
    report_error(false, "bgl_alloc_get_stats: out is null");
    return BGL_ERR_INVALID_ARGUMENT;
  }
  Pool* p = pool_or_error(device);
  if (p == nullptr) return BGL_ERR_INVALID_ARGUMENT;
  const Stats s = p->stats();
  *out = bgl_alloc_stats{};
  out->allocated_bytes = s.allocated_bytes.current;
  out->allocated_bytes_peak = s.allocated_bytes.peak;
  out->requested_bytes = s.requested_bytes.current;
  out->requested_bytes_peak = s.requested_bytes.peak;
  out->active_bytes = s.active_bytes.current;
  out->active_bytes_peak = s.active_bytes.peak;
  out->reserved_bytes = s.reserved_bytes.current;
  out->reserved_bytes_peak = s.reserved_bytes.peak;
  out->allocations = s.allocations.current;
  out->allocations_peak = s.allocations.peak;
  out->segments = s.segments.current;
  out->segments_peak = s.segments.peak;
  out->num_allocs = s.num_allocs;
  out->num_frees = s.num_frees;
  out->num_maps = s.num_maps;
  out->num_unmaps = s.num_unmaps;
  out->num_ooms = s.num_ooms;
  out->num_steals = s.num_steals;
  out->num_syncs = s.num_syncs;
  out->num_releases = s.num_releases;
  out->num_pressure_calls = s.num_pressure_calls;
  out->pressure_bytes_freed = s.pressure_bytes_freed;
  out->num_invalid_size = s.num_invalid_size;
  out->num_foreign_free = s.num_foreign_free;
  out->num_double_free = s.num_double_free;
  out->num_wrong_size = s.num_wrong_size;
  out->num_wrong_device = s.num_wrong_device;
  out->inactive_bytes = s.inactive_bytes;
  out->largest_free_block = s.largest_free_block;
  out->limit_bytes = s.limit_bytes;
  out->physical_bytes = s.physical_bytes;
  out->fragmentation = s.fragmentation;
  return BGL_OK;
}

BGL_ALLOC_API int bgl_alloc_reset_peak_stats(int device) {
  Pool* p = pool_or_error(device);
  if (p == nullptr) return BGL_ERR_INVALID_ARGUMENT;
  p->reset_peak_stats();
  return BGL_OK;
}

BGL_ALLOC_API int bgl_alloc_fault_configure(const char* spec, int64_t wait_timeout_ms) {
  std::string error;
  if (!detail::configure_faults(spec == nullptr ? "" : spec, &error)) {
    report_error(false, "bgl_alloc_fault_configure: " + error);
    return BGL_ERR_INVALID_ARGUMENT;
  }
  if (wait_timeout_ms > 0) detail::set_wait_timeout(std::chrono::milliseconds(wait_timeout_ms));
  return BGL_OK;
}

BGL_ALLOC_API int bgl_alloc_fault_get_stats(bgl_alloc_fault_stats* out) {
  if (out == nullptr) {
    report_error(false, "bgl_alloc_fault_get_stats: null argument");
    return BGL_ERR_INVALID_ARGUMENT;
  }
  out->device_ops = detail::fault_operations(detail::FaultKind::kDevice);
  out->pinned_ops = detail::fault_operations(detail::FaultKind::kPinned);
  out->copy_ops = detail::fault_operations(detail::FaultKind::kCopy);
  out->fired = detail::faults_fired();
  out->pinned_blocks_live = detail::pinned_blocks_live();
  return BGL_OK;
}

BGL_ALLOC_API int bgl_alloc_stats_json(int device, char* buf, size_t cap, size_t* needed) {
  Pool* p = pool_or_error(device);
  if (p == nullptr) return BGL_ERR_INVALID_ARGUMENT;
  return copy_out(stats_to_json(p->stats()).dump(), buf, cap, needed);
}

BGL_ALLOC_API int bgl_alloc_snapshot_json(char* buf, size_t cap, size_t* needed) {
  Allocator* a = global_allocator();
  if (a == nullptr) return BGL_ERR_NOT_INITIALIZED;
  return copy_out(a->snapshot_json(), buf, cap, needed);
}

BGL_ALLOC_API int bgl_alloc_record_history(int device, size_t max_entries) {
  Pool* p = pool_or_error(device);
  if (p == nullptr) return BGL_ERR_INVALID_ARGUMENT;
  p->set_history(max_entries);
  return BGL_OK;
}

BGL_ALLOC_API int bgl_alloc_empty_cache(int device, size_t* released) {
  Allocator* a = global_allocator();
  if (a == nullptr) return BGL_ERR_NOT_INITIALIZED;
  std::size_t total = 0;
  if (device == -1) {
    for (int d = 0; d < a->device_count(); ++d) {
      if (Pool* p = a->existing_pool(d)) total += p->empty_cache();
    }
  } else {
    Pool* p = a->pool(device);
    if (p == nullptr) return BGL_ERR_INVALID_ARGUMENT;
    total = p->empty_cache();
  }
  if (released != nullptr) *released = total;
  return BGL_OK;
}

BGL_ALLOC_API int bgl_alloc_record_stream(void* ptr, int device, void* stream) {
  Pool* p = pool_or_error(device);
  if (p == nullptr) return BGL_ERR_INVALID_ARGUMENT;
  Status s = p->record_stream(ptr, stream);
  if (s != Status::kOk) report_error(false, "bgl_alloc_record_stream: not a live allocation");
  return status(s);
}

BGL_ALLOC_API int bgl_alloc_add_pressure_callback(int device, bgl_pressure_fn fn, void* user,
                                                  int* handle) {
  Pool* p = pool_or_error(device);
  if (p == nullptr) return BGL_ERR_INVALID_ARGUMENT;
  if (fn == nullptr) {
    report_error(false, "bgl_alloc_add_pressure_callback: fn is null");
    return BGL_ERR_INVALID_ARGUMENT;
  }
  int id = p->add_pressure_callback(
      [fn, user](int dev, std::size_t needed) { return fn(dev, needed, user); });
  if (handle != nullptr) *handle = id;
  return BGL_OK;
}

BGL_ALLOC_API int bgl_alloc_remove_pressure_callback(int device, int handle) {
  Pool* p = pool_or_error(device);
  if (p == nullptr) return BGL_ERR_INVALID_ARGUMENT;
  p->remove_pressure_callback(handle);
  return BGL_OK;
}

BGL_ALLOC_API int bgl_alloc_add_segment_hook(int device, bgl_segment_fn fn, void* user,
                                             int* handle) {
  Pool* p = pool_or_error(device);
  if (p == nullptr) return BGL_ERR_INVALID_ARGUMENT;
  if (fn == nullptr) {
    report_error(false, "bgl_alloc_add_segment_hook: fn is null");
    return BGL_ERR_INVALID_ARGUMENT;
  }
  int id = p->add_segment_hook([fn, user](int dev, void* addr, std::size_t bytes, bool mapped) {
    fn(dev, addr, bytes, mapped ? 1 : 0, user);
  });
  if (handle != nullptr) *handle = id;
  return BGL_OK;
}

BGL_ALLOC_API int bgl_alloc_remove_segment_hook(int device, int handle) {
  Pool* p = pool_or_error(device);
  if (p == nullptr) return BGL_ERR_INVALID_ARGUMENT;
  p->remove_segment_hook(handle);
  return BGL_OK;
}

BGL_ALLOC_API const char* bgl_status_name(int s) { return status_name(s); }

BGL_ALLOC_API int bgl_status_value(const char* name, int* value) {
  if (name == nullptr || value == nullptr) {
    report_error(false, "bgl_status_value: null name or value");
    return BGL_ERR_INVALID_ARGUMENT;
  }
  for (int s = 0; s < kStatusCount; ++s) {
    if (std::strcmp(name, status_name(s)) == 0) {
      *value = s;
      return BGL_OK;
    }
  }
  report_error(false,
               "bgl_status_value: no status is called '" + std::string(name).substr(0, 64) + "'");
  return BGL_ERR_INVALID_ARGUMENT;
}

BGL_ALLOC_API int bgl_parse_bytes(const char* text, const char* what, int64_t* bytes) {
  if (text == nullptr || bytes == nullptr) {
    report_error(false, "bgl_parse_bytes: null text or bytes");
    return BGL_ERR_INVALID_ARGUMENT;
  }
  const bgl::Result<int64_t> parsed =
      bgl::ParseBytes(text, what == nullptr || *what == '\0' ? "size" : what);
  if (!parsed.ok()) {
    report_error(false, parsed.status().message());
    return BGL_ERR_INVALID_ARGUMENT;
  }
  *bytes = *parsed;
  return BGL_OK;
}

BGL_ALLOC_API const char* bgl_alloc_last_error(void) { return last_error().c_str(); }

BGL_ALLOC_API int bgl_alloc_device_count(void) {
  Allocator* a = global_allocator();
  return a == nullptr ? -1 : a->device_count();
}

}  // extern "C"
