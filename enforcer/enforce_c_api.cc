// C ABI of the enforcer (bgl/enforce.h) over the process-wide Allocator's pools. Every shim is
// one call of Call (an enforcer handle) or Guard (none): they resolve the handle, check the
// required pointers, turn exceptions into a status and set the error text, in one place.
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <unordered_set>

#include "allocator/detail/fault.h"
#include "allocator/global.h"
#include "bgl/enforce.h"
#include "enforcer/detail/fault_injecting_ops.h"
#include "enforcer/emulated_link_ops.h"
#include "enforcer/enforcer.h"
#include "governor/planner/assignment.h"
#include "governor/planner/dual_batch.h"
#include "governor/planner/hardware.h"
#include "governor/planner/json_limits.h"

// The C ABI's strategy numbers are the planner's (and so the proto's: convert.cc checks those).
static_assert(BGL_STRATEGY_KEEP == static_cast<int>(bgl::plan::Strategy::kKeep));
static_assert(BGL_STRATEGY_RECOMPUTE == static_cast<int>(bgl::plan::Strategy::kRecompute));
static_assert(BGL_STRATEGY_OFFLOAD == static_cast<int>(bgl::plan::Strategy::kOffload));
static_assert(BGL_STRATEGY_FP8 == static_cast<int>(bgl::plan::Strategy::kFp8));
static_assert(BGL_STRATEGY_FP8 + 1 == bgl::plan::kStrategyCount);
static_assert(BGL_PLACE_DROPPED == static_cast<int>(bgl::enf::Placement::kDropped));
static_assert(BGL_DTYPE_BYTES == static_cast<int>(bgl::enf::ElemType::kBytes));

struct bgl_enforcer {
  std::unique_ptr<bgl::enf::Enforcer> impl;
};

namespace bgl::enf {
namespace {

std::mutex& live_mu() {
  static std::mutex mu;
  return mu;
}
std::unordered_set<const bgl_enforcer*>& live() {
  static auto* set = new std::unordered_set<const bgl_enforcer*>();
  return *set;
}

int code(Status s) { return static_cast<int>(s); }

Status bad(Status s, const std::string& message) {
  alloc::report_error(false, message);
  return s;
}

// The enforcer behind a handle, or null for an unknown one.
Enforcer* resolve(const bgl_enforcer* enf) {
  std::lock_guard<std::mutex> lock(live_mu());
  return enf != nullptr && live().count(enf) != 0 ? enf->impl.get() : nullptr;
}

// Runs `body()` (returning a Status) for the C function `fn` once every pointer in `required`
// is non-null; no exception leaves the library: running out of host memory is
// BGL_ERR_OUT_OF_MEMORY, anything else BGL_ERR_INTERNAL, each with a message naming `fn`.
template <typename Body>
int Guard(const char* fn, std::initializer_list<const void*> required, Body&& body) {
  for (const void* p : required) {
    if (p == nullptr)
      return code(bad(Status::kInvalidArgument, std::string(fn) + ": null argument"));
  }
  try {
    return code(body());
  } catch (const std::bad_alloc&) {
    return code(bad(Status::kOutOfMemory, std::string(fn) + ": out of host memory"));
  } catch (const std::exception& e) {
    return code(bad(Status::kInternal, std::string(fn) + ": " + e.what()));
  } catch (...) {
    return code(bad(Status::kInternal, std::string(fn) + ": unknown exception"));
  }
}

// Guard for a call on an enforcer: `body(Enforcer&)`, or BGL_ERR_UNKNOWN_HANDLE.
template <typename Body>
int Call(bgl_enforcer* enf, const char* fn, std::initializer_list<const void*> required,
         Body&& body) {
  return Guard(fn, required, [&] {
    Enforcer* e = resolve(enf);
    if (e == nullptr)
      return bad(Status::kUnknownHandle, std::string(fn) + ": unknown enforcer handle");
    return body(*e);
  });
}

// A strategy number from the C ABI, or InvalidArgument naming `fn`.
Status CheckStrategy(const char* fn, int strategy) {
  if (strategy >= 0 && strategy < plan::kStrategyCount) return Status::kOk;
  return bad(Status::kInvalidArgument,
             std::string(fn) + ": strategy " + std::to_string(strategy) + " unknown");
}

// One kind of the ABI's vocabulary: the names of its values 0 .. count-1.
struct EnumKind {
  const char* kind;
  int count;
  const char* (*name)(int value);
};
const EnumKind kEnumKinds[] = {
    {"strategy", plan::kStrategyCount,
     [](int i) { return plan::StrategyName(static_cast<plan::Strategy>(i)); }},
    {"chain", plan::kChainCount,
     [](int i) { return plan::ChainName(static_cast<plan::Chain>(i)); }},
    {"resource", plan::kResourceCount,
     [](int i) { return plan::ResourceName(static_cast<plan::Resource>(i)); }},
    {"placement", BGL_PLACE_DROPPED + 1,
     [](int i) { return placement_name(static_cast<Placement>(i)); }},
    {"dtype", BGL_DTYPE_BYTES + 1, [](int i) { return elem_type_name(static_cast<ElemType>(i)); }},
    {"status", alloc::kStatusCount, [](int i) { return alloc::status_name(i); }},
};

// The kind called `kind`, or null with the error set (naming `fn` and the kinds there are).
const EnumKind* FindKind(const char* fn, const std::string& kind) {
  std::string kinds;
  for (const EnumKind& k : kEnumKinds) {
    if (kind == k.kind) return &k;
    kinds += std::string(kinds.empty() ? "" : ", ") + k.kind;
  }
  bad(Status::kInvalidArgument,
      std::string(fn) + ": kind '" + kind.substr(0, 32) + "' unknown (" + kinds + ")");
  return nullptr;
}

// The link times of options.emulated_link (a calibration document read by the planner's own
// parser); false with `error` set when it is no such document or the options cannot emulate.
bool emulated_link_times(const bgl_enf_options& o, const std::string& backend, LinkTimes* times,
                         std::string* error) {
  if (backend != "host") {
    *error = "only the host backend emulates a link (this pool's backend is '" + backend + "')";
    return false;
  }
  if (o.sync_copies != 0) {
    *error = "needs the copy threads (sync_copies 0): a link's copies run beside compute";
    return false;
  }
  const std::string text = o.emulated_link;
  // Checked before parsing: a deeply nested document never reaches the parser's recursion.
  bgl::Status depth =
      bgl::plan::CheckJsonNesting(text, bgl::plan::kDefaultMaxJsonDepth, "calibration");
  if (!depth.ok()) {
    *error = depth.message();
    return false;
  }
  const nlohmann::json doc = nlohmann::json::parse(text, nullptr, false);
  if (doc.is_discarded()) {
    *error = "not valid JSON";
    return false;
  }
  auto profile = bgl::plan::HardwareProfileByName("host");
  bgl::Status s = bgl::plan::ApplyCalibration(doc, *profile);
  if (!s.ok()) {
    *error = s.message();
    return false;
  }
  if (profile->emulated_link.empty()) {
    *error = "the calibration has no 'emulated_link' section (what the link stands for)";
    return false;
  }
  times->offload = profile->offload;
  times->reload = profile->reload;
  return true;
}

}  // namespace
}  // namespace bgl::enf

using namespace bgl::enf;  // NOLINT: C ABI implementation file

extern "C" {

BGL_ALLOC_API void bgl_enf_default_options(bgl_enf_options* o) {
  if (o == nullptr) return;
  *o = bgl_enf_options{};
  o->device = 0;
  o->pinned_capacity = std::size_t{16} << 30;
  o->fp8_block = 128;
  o->max_inflight = 4;
  o->pressure_eviction = 1;
  o->log = 0;
  o->sync_copies = 0;
}

BGL_ALLOC_API int bgl_enf_create(const bgl_enf_options* options, bgl_enforcer** out) {
  return Guard(__func__, {out}, [&] {
    bgl_enf_options o;
    bgl_enf_default_options(&o);
    if (options != nullptr) o = *options;
    if (const std::string& env = bgl::alloc::detail::environment_error(); !env.empty()) {
      return bad(Status::kInvalidArgument, "bgl_enf_create: " + env);
    }
    bgl::alloc::Allocator* a = bgl::alloc::global_allocator();
    if (a == nullptr) return Status::kNotInitialized;  // the allocator's message stays
    bgl::alloc::Pool* pool = a->pool(o.device);
    if (pool == nullptr) return Status::kInvalidArgument;
    std::string error;
    auto ops = make_device_ops(pool->backend().name(), o.device, &error);
    if (ops == nullptr) return bad(Status::kBackendError, "bgl_enf_create: " + error);
    if (o.emulated_link != nullptr) {
      LinkTimes times;
      if (!emulated_link_times(o, pool->backend().name(), &times, &error)) {
        return bad(Status::kInvalidArgument, "bgl_enf_create: emulated_link: " + error);
      }
      ops = make_emulated_link_ops(std::move(ops), times);
    }
    // Fault injection (BGL_FAULT, bgl_alloc_fault_configure): idle, one atomic load per call.
    ops = std::make_unique<bgl::enf::detail::FaultInjectingOps>(std::move(ops));
    EnforcerOptions eo;
    eo.pinned_capacity = o.pinned_capacity;
    eo.fp8_block = o.fp8_block;
    eo.max_inflight = o.max_inflight;
    eo.d2h = o.d2h_stream;
    eo.h2d = o.h2d_stream;
    eo.pressure_eviction = o.pressure_eviction != 0;
    eo.log = o.log != 0;
    eo.sync_copies = o.sync_copies != 0 && pool->backend().name() == std::string("host");
    auto impl = Enforcer::create(pool, std::move(ops), eo, &error);
    if (impl == nullptr) return bad(Status::kInvalidArgument, "bgl_enf_create: " + error);
    auto* h = new bgl_enforcer{std::move(impl)};
    {
      std::lock_guard<std::mutex> lock(live_mu());
      live().insert(h);
    }
    *out = h;
    return Status::kOk;
  });
}

BGL_ALLOC_API int bgl_enf_destroy(bgl_enforcer* enf) {
  if (enf == nullptr) return BGL_OK;
  return Guard(__func__, {}, [&] {
    {
      std::lock_guard<std::mutex> lock(live_mu());
      if (live().erase(enf) == 0) {
        return bad(Status::kUnknownHandle, "bgl_enf_destroy: unknown enforcer handle");
      }
    }
    delete enf;
    return Status::kOk;
  });
}

BGL_ALLOC_API int bgl_enf_stream_create(bgl_enforcer* enf, void** stream) {
  return Call(enf, __func__, {stream}, [&](Enforcer& e) { return e.ops().create_stream(stream); });
}

BGL_ALLOC_API int bgl_enf_stream_destroy(bgl_enforcer* enf, void* stream) {
  return Call(enf, __func__, {}, [&](Enforcer& e) {
    e.ops().destroy_stream(stream);
    return Status::kOk;
  });
}

BGL_ALLOC_API int bgl_enf_stream_synchronize(bgl_enforcer* enf, void* stream) {
  return Call(enf, __func__, {}, [&](Enforcer& e) {
    const Status s = e.ops().synchronize(stream);
    if (s != Status::kOk) return bad(s, "bgl_enf_stream_synchronize: " + e.ops().last_error());
    return Status::kOk;
  });
}

namespace {

// The C description as the tracker's, or kInvalidArgument for an unknown dtype (`fn` names the
// C function in the message).
Status ToDesc(const bgl_enf_tensor_desc* desc, const char* fn, TensorDesc* d) {
  if (desc->dtype < 0 || desc->dtype > BGL_DTYPE_BYTES) {
    return bad(Status::kInvalidArgument,
               std::string(fn) + ": dtype " + std::to_string(desc->dtype) + " unknown");
  }
  d->ptr = desc->ptr;
  d->bytes = desc->bytes;
  d->dtype = static_cast<ElemType>(desc->dtype);
  d->producer_op = desc->producer_op;
  d->graph_tensor = desc->graph_tensor;
  d->micro_batch = desc->micro_batch;
  d->stream = desc->stream;
  d->owned = (desc->flags & BGL_ENF_OWNED) != 0;
  return Status::kOk;
}

}  // namespace

BGL_ALLOC_API int bgl_enf_register(bgl_enforcer* enf, const bgl_enf_tensor_desc* desc,
                                   uint64_t* handle) {
  return Call(enf, __func__, {desc, handle}, [&](Enforcer& e) {
    TensorDesc d;
    const Status s = ToDesc(desc, "bgl_enf_register", &d);
    return s != Status::kOk ? s : e.register_tensor(d, handle);
  });
}

namespace {

// What a saved storage's registration does next: nothing (bgl_enf_register_saved), an
// offload (bgl_enf_offload_saved) or an FP8 cast (bgl_enf_store_fp8_saved).
enum class ThenMove { kNone, kOffload, kFp8 };

// The one registration path of the three.
int RegisterSaved(bgl_enforcer* enf, const char* fn, const bgl_enf_tensor_desc* desc,
                  int64_t need_order, const int* consumers, size_t count, uint64_t* handle,
                  ThenMove then, size_t* fp8_bytes = nullptr) {
  return Call(enf, fn, {desc, handle, count > 0 ? static_cast<const void*>(consumers) : desc},
              [&](Enforcer& e) {
                *handle = 0;
                TensorDesc d;
                Status s = ToDesc(desc, fn, &d);
                if (s == Status::kOk) s = e.register_saved(d, need_order, consumers, count, handle);
                if (s != Status::kOk || then == ThenMove::kNone) return s;
                if (then == ThenMove::kOffload) return e.offload(*handle);
                s = e.store_fp8(*handle);
                if (s == Status::kOk && fp8_bytes != nullptr) {
                  bgl_enf_tensor_info info;
                  s = e.info(*handle, &info);
                  *fp8_bytes = info.fp8_bytes;
                }
                return s;
              });
}

}  // namespace

BGL_ALLOC_API int bgl_enf_register_saved(bgl_enforcer* enf, const bgl_enf_tensor_desc* desc,
                                         int64_t need_order, const int* consumers, size_t count,
                                         uint64_t* handle) {
  return RegisterSaved(enf, __func__, desc, need_order, consumers, count, handle, ThenMove::kNone);
}

BGL_ALLOC_API int bgl_enf_offload_saved(bgl_enforcer* enf, const bgl_enf_tensor_desc* desc,
                                        int64_t need_order, const int* consumers, size_t count,
                                        uint64_t* handle) {
  return RegisterSaved(enf, __func__, desc, need_order, consumers, count, handle,
                       ThenMove::kOffload);
}

BGL_ALLOC_API int bgl_enf_store_fp8_saved(bgl_enforcer* enf, const bgl_enf_tensor_desc* desc,
                                          int64_t need_order, const int* consumers, size_t count,
                                          uint64_t* handle, size_t* fp8_bytes) {
  return RegisterSaved(enf, __func__, desc, need_order, consumers, count, handle, ThenMove::kFp8,
                       fp8_bytes);
}

BGL_ALLOC_API int bgl_enf_add_consumer(bgl_enforcer* enf, uint64_t handle, int consumer_op) {
  return Call(enf, __func__, {}, [&](Enforcer& e) { return e.add_consumer(handle, consumer_op); });
}

BGL_ALLOC_API int bgl_enf_lookup(bgl_enforcer* enf, const void* ptr, uint64_t* handle) {
  return Call(enf, __func__, {handle}, [&](Enforcer& e) { return e.lookup(ptr, handle); });
}

BGL_ALLOC_API int bgl_enf_query(bgl_enforcer* enf, uint64_t handle, bgl_enf_tensor_info* out) {
  return Call(enf, __func__, {out}, [&](Enforcer& e) { return e.info(handle, out); });
}

BGL_ALLOC_API int bgl_enf_unregister(bgl_enforcer* enf, uint64_t handle) {
  return Call(enf, __func__, {}, [&](Enforcer& e) { return e.unregister(handle); });
}

BGL_ALLOC_API int bgl_enf_movable(bgl_enforcer* enf, int micro_batch, int strategy, size_t* bytes,
                                  size_t* count) {
  return Call(enf, __func__, {}, [&](Enforcer& e) {
    if (Status s = CheckStrategy("bgl_enf_movable", strategy); s != Status::kOk) return s;
    return e.movable(micro_batch, static_cast<Strategy>(strategy), bytes, count);
  });
}

BGL_ALLOC_API int bgl_enf_set_need_order(bgl_enforcer* enf, uint64_t handle, int64_t order) {
  return Call(enf, __func__, {}, [&](Enforcer& e) { return e.set_need_order(handle, order); });
}

BGL_ALLOC_API int bgl_enf_set_graph_index(bgl_enforcer* enf, uint64_t handle, int producer_op,
                                          int graph_tensor) {
  return Call(enf, __func__, {},
              [&](Enforcer& e) { return e.set_graph_index(handle, producer_op, graph_tensor); });
}

BGL_ALLOC_API int bgl_enf_enum_value(const char* kind, const char* name, int* value) {
  return Guard(__func__, {kind, name, value}, [&] {
    const EnumKind* k = FindKind("bgl_enf_enum_value", kind);
    if (k == nullptr) return Status::kInvalidArgument;
    for (int i = 0; i < k->count; ++i) {
      if (std::string(name) == k->name(i)) {
        *value = i;
        return Status::kOk;
      }
    }
    return bad(Status::kInvalidArgument, "bgl_enf_enum_value: no " + std::string(kind) +
                                             " is called '" + std::string(name).substr(0, 64) +
                                             "'");
  });
}

BGL_ALLOC_API int bgl_enf_enum_name(const char* kind, int value, const char** name) {
  return Guard(__func__, {kind, name}, [&] {
    const EnumKind* k = FindKind("bgl_enf_enum_name", kind);
    if (k == nullptr) return Status::kInvalidArgument;
    if (value < 0 || value >= k->count) {
      return bad(Status::kInvalidArgument, "bgl_enf_enum_name: no " + std::string(kind) +
                                               " has the value " + std::to_string(value));
    }
    *name = k->name(value);
    return Status::kOk;
  });
}

BGL_ALLOC_API int bgl_enf_set_strategy(bgl_enforcer* enf, uint64_t handle, int strategy) {
  return Call(enf, __func__, {}, [&](Enforcer& e) {
    if (Status s = CheckStrategy("bgl_enf_set_strategy", strategy); s != Status::kOk) return s;
    return e.set_strategy(handle, static_cast<Strategy>(strategy));
  });
}

BGL_ALLOC_API int bgl_enf_apply(bgl_enforcer* enf, uint64_t handle, int strategy) {
  return Call(enf, __func__, {}, [&](Enforcer& e) {
    if (Status s = CheckStrategy("bgl_enf_apply", strategy); s != Status::kOk) return s;
    return e.apply(handle, static_cast<Strategy>(strategy));
  });
}

BGL_ALLOC_API int bgl_enf_offload(bgl_enforcer* enf, uint64_t handle) {
  return Call(enf, __func__, {}, [&](Enforcer& e) { return e.offload(handle); });
}

BGL_ALLOC_API int bgl_enf_reload(bgl_enforcer* enf, uint64_t handle) {
  return Call(enf, __func__, {}, [&](Enforcer& e) { return e.reload(handle); });
}

BGL_ALLOC_API int bgl_enf_store_fp8(bgl_enforcer* enf, uint64_t handle) {
  return Call(enf, __func__, {}, [&](Enforcer& e) { return e.store_fp8(handle); });
}

BGL_ALLOC_API int bgl_enf_drop(bgl_enforcer* enf, uint64_t handle) {
  return Call(enf, __func__, {}, [&](Enforcer& e) { return e.drop(handle); });
}

BGL_ALLOC_API int bgl_enf_set_recompute_callback(bgl_enforcer* enf, bgl_enf_recompute_fn fn,
                                                 void* user) {
  return Call(enf, __func__, {}, [&](Enforcer& e) {
    if (fn == nullptr) {
      e.set_recompute(nullptr);
    } else {
      e.set_recompute([fn, user](std::uint64_t h, int producer, int mb, void** out) {
        return fn(h, producer, mb, user, out);
      });
    }
    return Status::kOk;
  });
}

BGL_ALLOC_API int bgl_enf_acquire(bgl_enforcer* enf, uint64_t handle, int consumer_op, void* stream,
                                  void** ptr) {
  return Call(enf, __func__, {ptr},
              [&](Enforcer& e) { return e.acquire(handle, consumer_op, stream, ptr); });
}

BGL_ALLOC_API int bgl_enf_release(bgl_enforcer* enf, uint64_t handle, int consumer_op,
                                  void* stream) {
  return Call(enf, __func__, {},
              [&](Enforcer& e) { return e.release(handle, consumer_op, stream); });
}

BGL_ALLOC_API int bgl_enf_wait_tensor(bgl_enforcer* enf, uint64_t handle) {
  return Call(enf, __func__, {}, [&](Enforcer& e) { return e.wait_tensor(handle); });
}

BGL_ALLOC_API int bgl_enf_synchronize(bgl_enforcer* enf) {
  return Call(enf, __func__, {}, [&](Enforcer& e) { return e.synchronize(); });
}

BGL_ALLOC_API int bgl_enf_schedule_begin(bgl_enforcer* enf, const bgl_enf_issue_item* items,
                                         size_t count, int offload_micro_batch,
                                         int recover_micro_batch) {
  return Call(enf, __func__, {}, [&](Enforcer& e) {
    if (items == nullptr && count != 0) {
      return bad(Status::kInvalidArgument, "bgl_enf_schedule_begin: null items");
    }
    std::vector<bgl::plan::IssueItem> order(count);
    for (size_t i = 0; i < count; ++i) {
      order[i].chain = static_cast<bgl::plan::Chain>(items[i].chain);
      order[i].stage = items[i].stage;
      order[i].round = items[i].round;
      order[i].resource = static_cast<bgl::plan::Resource>(items[i].resource);
      order[i].first = items[i].first;
      order[i].last = items[i].last;
    }
    return e.schedule_begin(order, offload_micro_batch, recover_micro_batch);
  });
}

BGL_ALLOC_API int bgl_enf_schedule_reached(bgl_enforcer* enf, int chain, int stage) {
  return Call(enf, __func__, {}, [&](Enforcer& e) {
    return e.schedule_reached(static_cast<bgl::plan::Chain>(chain), stage);
  });
}

BGL_ALLOC_API int bgl_enf_schedule_at(bgl_enforcer* enf, int chain, int op, int* passed) {
  int n = 0;
  const int rc = Call(enf, __func__, {}, [&](Enforcer& e) {
    return e.schedule_at(static_cast<bgl::plan::Chain>(chain), op, &n);
  });
  if (passed != nullptr) *passed = n;
  return rc;
}

BGL_ALLOC_API int bgl_enf_schedule_poll(bgl_enforcer* enf, size_t* waiting) {
  return Call(enf, __func__, {}, [&](Enforcer& e) { return e.schedule_poll(waiting); });
}

BGL_ALLOC_API int bgl_enf_schedule_finish(bgl_enforcer* enf) {
  return Call(enf, __func__, {}, [&](Enforcer& e) { return e.schedule_finish(); });
}

BGL_ALLOC_API int bgl_enf_take_offloaded(bgl_enforcer* enf, uint64_t* handles, size_t cap,
                                         size_t* count) {
  return Call(enf, __func__, {},
              [&](Enforcer& e) { return e.take_offloaded(handles, cap, count); });
}

BGL_ALLOC_API int bgl_enf_prefetch(bgl_enforcer* enf, int micro_batch, size_t* issued) {
  return Call(enf, __func__, {}, [&](Enforcer& e) { return e.prefetch(micro_batch, issued); });
}

BGL_ALLOC_API int bgl_enf_set_pinned_capacity(bgl_enforcer* enf, size_t bytes) {
  return Call(enf, __func__, {}, [&](Enforcer& e) { return e.set_pinned_capacity(bytes); });
}

BGL_ALLOC_API int bgl_enf_evict(bgl_enforcer* enf, size_t bytes_needed, size_t* freed) {
  return Call(enf, __func__, {}, [&](Enforcer& e) { return e.evict(bytes_needed, freed); });
}

BGL_ALLOC_API int bgl_enf_get_stats(bgl_enforcer* enf, bgl_enf_stats* out) {
  return Call(enf, __func__, {out}, [&](Enforcer& e) {
    *out = e.stats();
    return Status::kOk;
  });
}

BGL_ALLOC_API const char* bgl_enf_last_error(void) { return bgl::alloc::last_error().c_str(); }

}  // extern "C"
