// Trace: allocation events read from a PyTorch snapshot (device_traces) or an RMM-style CSV.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace bgl::alloc::replay {

// One trace event; `slot` names the allocation (dense ids, so replay needs no hashing).
struct TraceOp {
  bool alloc;
  std::size_t size;
  std::uint64_t stream;
  std::uint32_t slot;
};

// A parsed trace: ops in order plus the number of distinct allocations.
struct Trace {
  std::vector<TraceOp> ops;
  std::uint32_t slots = 0;
  std::size_t skipped = 0;  // frees of unknown pointers, failed allocations in the log
};

// Parses `path` (JSON when it starts with '{' or '[', else CSV). For snapshots, `device`
// selects the device_traces entry. False with `error` set on malformed input.
bool load_trace(const std::string& path, int device, Trace* out, std::string* error);

}  // namespace bgl::alloc::replay
