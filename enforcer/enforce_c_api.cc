// C ABI of the enforcer (bgl/enforce.h) over the process-wide Allocator's pools.
#include <memory>
#include <mutex>
#include <unordered_set>

#include "allocator/global.h"
#include "bgl/enforce.h"
#include "enforcer/enforcer.h"
#include "governor/planner/assignment.h"
#include "governor/planner/dual_batch.h"

// The C ABI's strategy numbers are the planner's (and so the proto's: convert.cc checks those).
static_assert(BGL_STRATEGY_KEEP == static_cast<int>(bgl::plan::Strategy::kKeep));
static_assert(BGL_STRATEGY_RECOMPUTE == static_cast<int>(bgl::plan::Strategy::kRecompute));
static_assert(BGL_STRATEGY_OFFLOAD == static_cast<int>(bgl::plan::Strategy::kOffload));
static_assert(BGL_STRATEGY_FP8 == static_cast<int>(bgl::plan::Strategy::kFp8));

struct bgl_enforcer {
  std::unique_ptr<bgl::alloc::Enforcer> impl;
};

namespace bgl::alloc {
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

int bad(Status s, const std::string& message) {
  report_error(false, message);
  return code(s);
}

// The enforcer behind a handle, or null (with the error set) for an unknown one.
Enforcer* resolve(bgl_enforcer* enf, const char* fn) {
  std::lock_guard<std::mutex> lock(live_mu());
  if (enf == nullptr || live().count(enf) == 0) {
    report_error(false, std::string(fn) + ": unknown enforcer handle");
    return nullptr;
  }
  return enf->impl.get();
}

}  // namespace
}  // namespace bgl::alloc

using namespace bgl::alloc;  // NOLINT: C ABI implementation file

#define BGL_ENF_RESOLVE(fn)       \
  Enforcer* e = resolve(enf, fn); \
  if (e == nullptr) return BGL_ERR_UNKNOWN_HANDLE

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
}

BGL_ALLOC_API int bgl_enf_create(const bgl_enf_options* options, bgl_enforcer** out) {
  if (out == nullptr) return bad(Status::kInvalidArgument, "bgl_enf_create: out is null");
  bgl_enf_options o;
  bgl_enf_default_options(&o);
  if (options != nullptr) o = *options;
  Allocator* a = global_allocator();
  if (a == nullptr) return BGL_ERR_NOT_INITIALIZED;
  Pool* pool = a->pool(o.device);
  if (pool == nullptr) return BGL_ERR_INVALID_ARGUMENT;
  std::string error;
  auto ops = make_device_ops(pool->backend().name(), o.device, &error);
  if (ops == nullptr) return bad(Status::kBackendError, "bgl_enf_create: " + error);
  EnforcerOptions eo;
  eo.pinned_capacity = o.pinned_capacity;
  eo.fp8_block = o.fp8_block;
  eo.max_inflight = o.max_inflight;
  eo.d2h = o.d2h_stream;
  eo.h2d = o.h2d_stream;
  eo.pressure_eviction = o.pressure_eviction != 0;
  eo.log = o.log != 0;
  auto impl = Enforcer::create(pool, std::move(ops), eo, &error);
  if (impl == nullptr) return bad(Status::kInvalidArgument, "bgl_enf_create: " + error);
  auto* h = new bgl_enforcer{std::move(impl)};
  {
    std::lock_guard<std::mutex> lock(live_mu());
    live().insert(h);
  }
  *out = h;
  return BGL_OK;
}

BGL_ALLOC_API int bgl_enf_destroy(bgl_enforcer* enf) {
  if (enf == nullptr) return BGL_OK;
  {
    std::lock_guard<std::mutex> lock(live_mu());
    if (live().erase(enf) == 0) {
      return bad(Status::kUnknownHandle, "bgl_enf_destroy: unknown enforcer handle");
    }
  }
  delete enf;
  return BGL_OK;
}

BGL_ALLOC_API int bgl_enf_stream_create(bgl_enforcer* enf, void** stream) {
  BGL_ENF_RESOLVE("bgl_enf_stream_create");
  if (stream == nullptr) return bad(Status::kInvalidArgument, "bgl_enf_stream_create: null out");
  return code(e->ops().create_stream(stream));
}

BGL_ALLOC_API int bgl_enf_stream_destroy(bgl_enforcer* enf, void* stream) {
  BGL_ENF_RESOLVE("bgl_enf_stream_destroy");
  e->ops().destroy_stream(stream);
  return BGL_OK;
}

BGL_ALLOC_API int bgl_enf_stream_synchronize(bgl_enforcer* enf, void* stream) {
  BGL_ENF_RESOLVE("bgl_enf_stream_synchronize");
  e->ops().synchronize(stream);
  return BGL_OK;
}

BGL_ALLOC_API int bgl_enf_register(bgl_enforcer* enf, const bgl_enf_tensor_desc* desc,
                                   uint64_t* handle) {
  BGL_ENF_RESOLVE("bgl_enf_register");
  if (desc == nullptr || handle == nullptr) {
    return bad(Status::kInvalidArgument, "bgl_enf_register: null desc or handle");
  }
  if (desc->dtype < 0 || desc->dtype > BGL_DTYPE_BYTES) {
    return bad(Status::kInvalidArgument,
               "bgl_enf_register: dtype " + std::to_string(desc->dtype) + " unknown");
  }
  TensorDesc d;
  d.ptr = desc->ptr;
  d.bytes = desc->bytes;
  d.dtype = static_cast<ElemType>(desc->dtype);
  d.producer_op = desc->producer_op;
  d.graph_tensor = desc->graph_tensor;
  d.micro_batch = desc->micro_batch;
  d.stream = desc->stream;
  d.owned = (desc->flags & BGL_ENF_OWNED) != 0;
  return code(e->register_tensor(d, handle));
}

BGL_ALLOC_API int bgl_enf_add_consumer(bgl_enforcer* enf, uint64_t handle, int consumer_op) {
  BGL_ENF_RESOLVE("bgl_enf_add_consumer");
  return code(e->add_consumer(handle, consumer_op));
}

BGL_ALLOC_API int bgl_enf_lookup(bgl_enforcer* enf, const void* ptr, uint64_t* handle) {
  BGL_ENF_RESOLVE("bgl_enf_lookup");
  if (handle == nullptr) return bad(Status::kInvalidArgument, "bgl_enf_lookup: null handle");
  return code(e->lookup(ptr, handle));
}

BGL_ALLOC_API int bgl_enf_query(bgl_enforcer* enf, uint64_t handle, bgl_enf_tensor_info* out) {
  BGL_ENF_RESOLVE("bgl_enf_query");
  if (out == nullptr) return bad(Status::kInvalidArgument, "bgl_enf_query: null out");
  return code(e->info(handle, out));
}

BGL_ALLOC_API int bgl_enf_unregister(bgl_enforcer* enf, uint64_t handle) {
  BGL_ENF_RESOLVE("bgl_enf_unregister");
  return code(e->unregister(handle));
}

BGL_ALLOC_API int bgl_enf_movable(bgl_enforcer* enf, int micro_batch, int strategy, size_t* bytes,
                                  size_t* count) {
  BGL_ENF_RESOLVE("bgl_enf_movable");
  if (strategy < 0 || strategy > BGL_STRATEGY_FP8) {
    return bad(Status::kInvalidArgument,
               "bgl_enf_movable: strategy " + std::to_string(strategy) + " unknown");
  }
  return code(e->movable(micro_batch, static_cast<Strategy>(strategy), bytes, count));
}

BGL_ALLOC_API int bgl_enf_set_need_order(bgl_enforcer* enf, uint64_t handle, int64_t order) {
  BGL_ENF_RESOLVE("bgl_enf_set_need_order");
  return code(e->set_need_order(handle, order));
}

BGL_ALLOC_API int bgl_enf_set_graph_index(bgl_enforcer* enf, uint64_t handle, int producer_op,
                                          int graph_tensor) {
  BGL_ENF_RESOLVE("bgl_enf_set_graph_index");
  return code(e->set_graph_index(handle, producer_op, graph_tensor));
}

BGL_ALLOC_API int bgl_enf_enum_value(const char* kind, const char* name, int* value) {
  if (kind == nullptr || name == nullptr || value == nullptr) {
    return bad(Status::kInvalidArgument, "bgl_enf_enum_value: null argument");
  }
  const std::string k(kind), n(name);
  // The planner's own names: one vocabulary, nothing retyped.
  auto find = [&](int count, auto name_of) {
    for (int i = 0; i < count; ++i) {
      if (n == name_of(i)) {
        *value = i;
        return 0;
      }
    }
    return bad(Status::kInvalidArgument,
               "bgl_enf_enum_value: no " + k + " is called '" + n.substr(0, 64) + "'");
  };
  using bgl::plan::Chain;
  using bgl::plan::Resource;
  if (k == "strategy") {
    return find(BGL_STRATEGY_FP8 + 1,
                [](int i) { return bgl::plan::StrategyName(static_cast<Strategy>(i)); });
  }
  if (k == "chain") {
    return find(bgl::plan::kChainCount,
                [](int i) { return bgl::plan::ChainName(static_cast<Chain>(i)); });
  }
  if (k == "resource") {
    return find(bgl::plan::kResourceCount,
                [](int i) { return bgl::plan::ResourceName(static_cast<Resource>(i)); });
  }
  return bad(Status::kInvalidArgument, "bgl_enf_enum_value: kind '" + k.substr(0, 32) +
                                           "' unknown (strategy, chain or resource)");
}

BGL_ALLOC_API int bgl_enf_set_strategy(bgl_enforcer* enf, uint64_t handle, int strategy) {
  BGL_ENF_RESOLVE("bgl_enf_set_strategy");
  if (strategy < 0 || strategy > BGL_STRATEGY_FP8) {
    return bad(Status::kInvalidArgument,
               "bgl_enf_set_strategy: strategy " + std::to_string(strategy) + " unknown");
  }
  return code(e->set_strategy(handle, static_cast<Strategy>(strategy)));
}

BGL_ALLOC_API int bgl_enf_apply(bgl_enforcer* enf, uint64_t handle, int strategy) {
  BGL_ENF_RESOLVE("bgl_enf_apply");
  if (strategy < 0 || strategy > BGL_STRATEGY_FP8) {
    return bad(Status::kInvalidArgument,
               "bgl_enf_apply: strategy " + std::to_string(strategy) + " unknown");
  }
  return code(e->apply(handle, static_cast<Strategy>(strategy)));
}

BGL_ALLOC_API int bgl_enf_offload(bgl_enforcer* enf, uint64_t handle) {
  BGL_ENF_RESOLVE("bgl_enf_offload");
  return code(e->offload(handle));
}

BGL_ALLOC_API int bgl_enf_reload(bgl_enforcer* enf, uint64_t handle) {
  BGL_ENF_RESOLVE("bgl_enf_reload");
  return code(e->reload(handle));
}

BGL_ALLOC_API int bgl_enf_store_fp8(bgl_enforcer* enf, uint64_t handle) {
  BGL_ENF_RESOLVE("bgl_enf_store_fp8");
  return code(e->store_fp8(handle));
}

BGL_ALLOC_API int bgl_enf_drop(bgl_enforcer* enf, uint64_t handle) {
  BGL_ENF_RESOLVE("bgl_enf_drop");
  return code(e->drop(handle));
}

BGL_ALLOC_API int bgl_enf_set_recompute_callback(bgl_enforcer* enf, bgl_enf_recompute_fn fn,
                                                 void* user) {
  BGL_ENF_RESOLVE("bgl_enf_set_recompute_callback");
  if (fn == nullptr) {
    e->set_recompute(nullptr);
  } else {
    e->set_recompute([fn, user](std::uint64_t h, int producer, int mb, void** out) {
      return fn(h, producer, mb, user, out);
    });
  }
  return BGL_OK;
}

BGL_ALLOC_API int bgl_enf_acquire(bgl_enforcer* enf, uint64_t handle, int consumer_op, void* stream,
                                  void** ptr) {
  BGL_ENF_RESOLVE("bgl_enf_acquire");
  if (ptr == nullptr) return bad(Status::kInvalidArgument, "bgl_enf_acquire: null ptr out");
  return code(e->acquire(handle, consumer_op, stream, ptr));
}

BGL_ALLOC_API int bgl_enf_release(bgl_enforcer* enf, uint64_t handle, int consumer_op,
                                  void* stream) {
  BGL_ENF_RESOLVE("bgl_enf_release");
  return code(e->release(handle, consumer_op, stream));
}

BGL_ALLOC_API int bgl_enf_wait_tensor(bgl_enforcer* enf, uint64_t handle) {
  BGL_ENF_RESOLVE("bgl_enf_wait_tensor");
  return code(e->wait_tensor(handle));
}

BGL_ALLOC_API int bgl_enf_synchronize(bgl_enforcer* enf) {
  BGL_ENF_RESOLVE("bgl_enf_synchronize");
  return code(e->synchronize());
}

BGL_ALLOC_API int bgl_enf_schedule_begin(bgl_enforcer* enf, const bgl_enf_issue_item* items,
                                         size_t count, int offload_micro_batch,
                                         int recover_micro_batch) {
  BGL_ENF_RESOLVE("bgl_enf_schedule_begin");
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
  return code(e->schedule_begin(order, offload_micro_batch, recover_micro_batch));
}

BGL_ALLOC_API int bgl_enf_schedule_reached(bgl_enforcer* enf, int chain, int stage) {
  BGL_ENF_RESOLVE("bgl_enf_schedule_reached");
  return code(e->schedule_reached(static_cast<bgl::plan::Chain>(chain), stage));
}

BGL_ALLOC_API int bgl_enf_schedule_poll(bgl_enforcer* enf, size_t* waiting) {
  BGL_ENF_RESOLVE("bgl_enf_schedule_poll");
  return code(e->schedule_poll(waiting));
}

BGL_ALLOC_API int bgl_enf_schedule_finish(bgl_enforcer* enf) {
  BGL_ENF_RESOLVE("bgl_enf_schedule_finish");
  return code(e->schedule_finish());
}

BGL_ALLOC_API int bgl_enf_take_offloaded(bgl_enforcer* enf, uint64_t* handles, size_t cap,
                                         size_t* count) {
  BGL_ENF_RESOLVE("bgl_enf_take_offloaded");
  return code(e->take_offloaded(handles, cap, count));
}

BGL_ALLOC_API int bgl_enf_prefetch(bgl_enforcer* enf, int micro_batch, size_t* issued) {
  BGL_ENF_RESOLVE("bgl_enf_prefetch");
  return code(e->prefetch(micro_batch, issued));
}

BGL_ALLOC_API int bgl_enf_set_pinned_capacity(bgl_enforcer* enf, size_t bytes) {
  BGL_ENF_RESOLVE("bgl_enf_set_pinned_capacity");
  return code(e->set_pinned_capacity(bytes));
}

BGL_ALLOC_API int bgl_enf_evict(bgl_enforcer* enf, size_t bytes_needed, size_t* freed) {
  BGL_ENF_RESOLVE("bgl_enf_evict");
  return code(e->evict(bytes_needed, freed));
}

BGL_ALLOC_API int bgl_enf_get_stats(bgl_enforcer* enf, bgl_enf_stats* out) {
  BGL_ENF_RESOLVE("bgl_enf_get_stats");
  if (out == nullptr) return bad(Status::kInvalidArgument, "bgl_enf_get_stats: null out");
  *out = e->stats();
  return BGL_OK;
}

BGL_ALLOC_API const char* bgl_enf_last_error(void) { return last_error().c_str(); }

}  // extern "C"
