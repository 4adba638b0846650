// libFuzzer target: call sequences over the allocator's and the enforcer's C ABIs (bgl/alloc.h,
// bgl/enforce.h) on the host backend. The allocator is configured once (a 64 MiB pool: a
// process has one); per input a fresh enforcer (options from the input: pinned capacity, FP8
// block, in-flight pieces, eviction, synchronous copies or copy threads), then up to 96 calls
// chosen by the input over up to 16 tensors whose sizes, dtypes, micro-batches, consumers and
// ownership come from the input: register (plain, saved, offload or FP8 at once), strategy,
// apply, offload, reload, FP8, drop (the recompute callback refills the data), acquire, release,
// wait, query, lookup, movable, prefetch, evict, pinned capacity, stats, unregister; and
// allocator calls (alloc, free, record_stream, stats, snapshot, empty_cache). Handles are
// valid ones mostly, sometimes stale or made up. At the end the enforcer is destroyed and every
// allocation the target still owns is freed, so no state survives an input; the pool must then
// be back to 0 allocated bytes.
//
// Findings: a crash or sanitizer report (use after free, double free, overflow); an error code
// with no message; a status outside bgl_status; the pool not back to 0 after an input.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "bgl/alloc.h"
#include "bgl/enforce.h"
#include "fuzz/fuzz_util.h"

namespace {

void Fail(const char* what, int rc) {
  std::fprintf(stderr, "enforcer_capi_fuzz: %s (rc %d: %s)\n", what, rc, bgl_enf_last_error());
  __builtin_trap();
}

int Check(int rc) {
  if (rc == 0) return rc;
  if (bgl_status_name(rc) == nullptr) Fail("a status outside bgl_status", rc);
  if (*bgl_enf_last_error() == '\0') Fail("an error with no message", rc);
  return rc;
}

struct Tensor {
  uint64_t handle = 0;
  void* ptr = nullptr;  // device data the target still owns (borrowed or never handed over)
  size_t bytes = 0;
  bool owned = false;
};

// Refills a dropped tensor: a new allocation of its registered size, owned as the registration
// says (a borrowed tensor's refill is the target's to free at the end).
struct Recompute {
  std::vector<Tensor>* tensors;
  std::vector<void*>* extra;
  static int Run(uint64_t handle, int, int, void* user, void** out) {
    auto* self = static_cast<Recompute*>(user);
    for (const Tensor& t : *self->tensors) {
      if (t.handle != handle) continue;
      void* p = bgl_alloc(t.bytes, 0, nullptr);
      if (p == nullptr) return 1;
      std::memset(p, 0x3c, t.bytes);
      if (!t.owned) self->extra->push_back(p);
      *out = p;
      return 0;
    }
    return 1;  // not a tensor of this input
  }
};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (bgl_alloc_configure("backend:host,capacity:64MiB") != 0) {
    std::fprintf(stderr, "enforcer_capi_fuzz: configure: %s\n", bgl_alloc_last_error());
    std::abort();
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  bgl::fuzz::Choices in(data, size);
  bgl_enf_options opt;
  bgl_enf_default_options(&opt);
  opt.pinned_capacity = static_cast<size_t>(in.In(0, 4)) << 20;
  opt.fp8_block = static_cast<size_t>(16) << in.In(0, 4);
  opt.max_inflight = static_cast<int>(in.In(1, 4));
  opt.pressure_eviction = in.Byte() % 2;
  opt.sync_copies = in.Byte() % 4 != 0;
  bgl_enforcer* enf = nullptr;
  if (Check(bgl_enf_create(&opt, &enf)) != 0) return 0;
  std::vector<void*> extra;  // allocations the target frees at the end
  std::vector<Tensor> tensors;
  Recompute recompute{&tensors, &extra};
  Check(bgl_enf_set_recompute_callback(enf, &Recompute::Run, &recompute));
  auto pick = [&]() -> uint64_t {
    const uint8_t b = in.Byte();
    if (tensors.empty() || b >= 240) return b % 3 == 0 ? 0 : (uint64_t{b} << 20) + 7;
    return tensors[b % tensors.size()].handle;
  };
  for (int i = 0; i < 96 && in.more(); ++i) {
    const uint8_t op = in.Byte();
    switch (op % 20) {
      case 0:
      case 1:
      case 2:
      case 3: {  // register a new tensor
        if (tensors.size() >= 16) break;
        const int dtype = static_cast<int>(in.In(0, 3));
        const size_t bytes = static_cast<size_t>(in.In(1, 64)) * (dtype == 0 ? 64 : 32);
        void* p = bgl_alloc(bytes, 0, nullptr);
        if (p == nullptr) break;
        std::memset(p, static_cast<int>(i), bytes);
        const bool owned = in.Byte() % 2 == 0;
        bgl_enf_tensor_desc d{p,
                              bytes,
                              dtype,
                              static_cast<int>(in.Mostly(0, 31)),
                              static_cast<int>(in.Mostly(-1, 63)),
                              static_cast<int>(in.Mostly(0, 7)),
                              nullptr,
                              owned ? BGL_ENF_OWNED : 0u};
        const int consumers[3] = {static_cast<int>(in.In(0, 40)), static_cast<int>(in.In(0, 40)),
                                  static_cast<int>(in.In(0, 40))};
        const size_t count = static_cast<size_t>(in.In(0, 3));
        uint64_t h = 0;
        int rc = 0;
        switch (op % 4) {
          case 0:
            rc = bgl_enf_register(enf, &d, &h);
            break;
          case 1:
            rc = bgl_enf_register_saved(enf, &d, in.Mostly(0, 1000), consumers, count, &h);
            break;
          case 2:
            rc = bgl_enf_offload_saved(enf, &d, in.Mostly(0, 1000), consumers, count, &h);
            break;
          default:
            rc =
                bgl_enf_store_fp8_saved(enf, &d, in.Mostly(0, 1000), consumers, count, &h, nullptr);
            break;
        }
        Check(rc);
        if (h == 0) {  // nothing registered: the memory is still the target's
          bgl_free(p, bytes, 0, nullptr);
          break;
        }
        tensors.push_back({h, owned ? nullptr : p, bytes, owned});
        break;
      }
      case 4:
        Check(bgl_enf_set_strategy(enf, pick(), static_cast<int>(in.Mostly(0, 3))));
        break;
      case 5:
        Check(bgl_enf_apply(enf, pick(), static_cast<int>(in.Mostly(0, 3))));
        break;
      case 6:
        Check(bgl_enf_offload(enf, pick()));
        break;
      case 7:
        Check(bgl_enf_reload(enf, pick()));
        break;
      case 8:
        Check(bgl_enf_store_fp8(enf, pick()));
        break;
      case 9:
        Check(bgl_enf_drop(enf, pick()));
        break;
      case 10: {
        void* ptr = nullptr;
        Check(bgl_enf_acquire(enf, pick(), static_cast<int>(in.Mostly(-1, 40)), nullptr, &ptr));
        break;
      }
      case 11:
        Check(bgl_enf_release(enf, pick(), static_cast<int>(in.Mostly(-1, 40)), nullptr));
        break;
      case 12:
        Check(bgl_enf_wait_tensor(enf, pick()));
        break;
      case 13: {
        bgl_enf_tensor_info info;
        Check(bgl_enf_query(enf, pick(), &info));
        uint64_t h = 0;
        if (!tensors.empty() && tensors.back().ptr != nullptr) {
          Check(bgl_enf_lookup(enf, tensors.back().ptr, &h));
        }
        Check(bgl_enf_add_consumer(enf, pick(), static_cast<int>(in.In(0, 40))));
        break;
      }
      case 14: {
        size_t bytes = 0, count = 0;
        Check(bgl_enf_movable(enf, static_cast<int>(in.Mostly(0, 7)),
                              static_cast<int>(in.Mostly(0, 3)), &bytes, &count));
        size_t issued = 0;
        Check(bgl_enf_prefetch(enf, static_cast<int>(in.Mostly(0, 7)), &issued));
        break;
      }
      case 15: {
        size_t freed = 0;
        Check(bgl_enf_evict(enf, static_cast<size_t>(in.In(0, 1 << 16)), &freed));
        break;
      }
      case 16:
        Check(bgl_enf_set_pinned_capacity(enf, static_cast<size_t>(in.In(0, 4)) << 20));
        break;
      case 17: {
        bgl_enf_stats st;
        Check(bgl_enf_get_stats(enf, &st));
        Check(bgl_enf_synchronize(enf));
        break;
      }
      case 18: {  // unregister (the target keeps a borrowed tensor's memory)
        const uint64_t h = pick();
        Check(bgl_enf_unregister(enf, h));
        break;
      }
      default: {  // the allocator's own calls
        bgl_alloc_stats st;
        Check(bgl_alloc_get_stats(static_cast<int>(in.Mostly(0, 0)), &st));
        size_t needed = 0;
        char buf[256];
        const int rc = bgl_alloc_stats_json(0, buf, sizeof buf, &needed);
        if (rc != 0 && rc != BGL_ERR_BUFFER_TOO_SMALL) Check(rc);
        void* p = bgl_alloc(static_cast<size_t>(in.Mostly(1, 1 << 20)), 0, nullptr);
        if (p != nullptr) {
          Check(bgl_alloc_record_stream(p, 0, nullptr));
          bgl_free(p, 0, 0, nullptr);
        }
        size_t released = 0;
        Check(bgl_alloc_empty_cache(static_cast<int>(in.Mostly(-1, 0)), &released));
        break;
      }
    }
  }
  Check(bgl_enf_destroy(enf));
  for (const Tensor& t : tensors) {
    if (t.ptr != nullptr) bgl_free(t.ptr, t.bytes, 0, nullptr);
  }
  for (void* p : extra) bgl_free(p, 0, 0, nullptr);
  bgl_alloc_stats st;
  if (bgl_alloc_get_stats(0, &st) == 0 && st.allocated_bytes != 0) {
    std::fprintf(stderr, "enforcer_capi_fuzz: %lld bytes still allocated after an input\n",
                 static_cast<long long>(st.allocated_bytes));
    __builtin_trap();
  }
  return 0;
}
