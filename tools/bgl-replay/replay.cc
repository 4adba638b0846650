#include "tools/bgl-replay/replay.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <vector>

#include "allocator/allocator.h"

namespace bgl::alloc::replay {

bool run_replay(const Trace& trace, const Config& config, int repeat, ReplayResult* out,
                std::string* error) {
  std::unique_ptr<Allocator> a = Allocator::create(config, error);
  if (a == nullptr) return false;
  Pool* pool = a->pool(0);
  if (pool == nullptr) {
    *error = last_error();
    return false;
  }
  // Trace stream ids become opaque handles (idle streams for the host backend; the default
  // stream for CUDA backends, since ids from another process mean nothing here).
  const bool host = a->config().backend == "host";
  std::vector<void*> slots(trace.slots, nullptr);
  std::int64_t live = 0;
  double total_ns = 0;
  for (int r = 0; r < std::max(1, repeat); ++r) {
    std::size_t ooms = 0;
    auto t0 = std::chrono::steady_clock::now();
    for (const TraceOp& op : trace.ops) {
      Stream s = host ? reinterpret_cast<Stream>(op.stream) : nullptr;
      if (op.alloc) {
        slots[op.slot] = pool->allocate(op.size, s);
        if (slots[op.slot] == nullptr) ++ooms;
      } else if (slots[op.slot] != nullptr) {
        pool->deallocate(slots[op.slot], op.size, s);
        slots[op.slot] = nullptr;
      }
    }
    auto t1 = std::chrono::steady_clock::now();
    const double ns =
        static_cast<double>(std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count());
    total_ns += ns;
    if (r == 0) {
      out->first_ns_per_op = trace.ops.empty() ? 0 : ns / trace.ops.size();
      out->ooms = ooms;
      Stats st = pool->stats();
      out->peak_reserved = st.reserved_bytes.peak;
      out->peak_allocated = st.allocated_bytes.peak;
      out->maps = st.num_maps;
      out->unmaps = st.num_unmaps;
    }
    for (void*& p : slots) {  // a trace cut short leaves allocations live
      if (p != nullptr) pool->deallocate(p, 0, nullptr);
      p = nullptr;
    }
  }
  std::int64_t peak = 0;
  for (const TraceOp& op : trace.ops) {
    live += op.alloc ? static_cast<std::int64_t>(op.size) : -static_cast<std::int64_t>(op.size);
    peak = std::max(peak, live);
  }
  out->ops = trace.ops.size();
  out->peak_live = peak;
  out->ratio = peak > 0 ? static_cast<double>(out->peak_reserved) / static_cast<double>(peak) : 0;
  out->ns_per_op = trace.ops.empty() ? 0 : total_ns / std::max(1, repeat) / trace.ops.size();
  out->warm_ns_per_op =
      repeat > 1 && !trace.ops.empty()
          ? (total_ns - out->first_ns_per_op * trace.ops.size()) / (repeat - 1) / trace.ops.size()
          : out->first_ns_per_op;
  return true;
}

}  // namespace bgl::alloc::replay
