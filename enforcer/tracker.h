// ActivationTracker: the saved activations of one device, one entry per storage with every
// consumer that saved it, its placement, precision and pending copies. Data only: the Enforcer
// does the moving and holds the lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "enforcer/allocator_names.h"
#include "governor/planner/assignment.h"

namespace bgl::enf {

// Where a tracked tensor's data is (values match bgl_placement).
enum class Placement : std::uint8_t { kDevice = 0, kHost = 1, kFp8 = 2, kDropped = 3 };
// Plan strategies: the planner's own (values match bgl_strategy).
using Strategy = plan::Strategy;
// Element types (values match bgl_dtype).
enum class ElemType : std::uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2, kBytes = 3 };

const char* placement_name(Placement p);
// The C ABI's name of an element type ("f32", "f16", "bf16", "bytes").
const char* elem_type_name(ElemType t);
inline const char* strategy_name(Strategy s) { return plan::StrategyName(s); }

// What the integration tells about a saved activation.
struct TensorDesc {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  ElemType dtype = ElemType::kBytes;
  int producer_op = -1;
  int graph_tensor = -1;
  int micro_batch = 0;
  Stream stream = nullptr;
  bool owned = false;
};

// A consumer (operator) that saved the tensor.
struct Consumer {
  int op = -1;
  bool released = false;
};

// One tracked tensor.
struct TrackedTensor {
  std::uint64_t handle = 0;
  TensorDesc desc;
  std::vector<Consumer> consumers;
  Placement placement = Placement::kDevice;  // placement, need_order, reload_unused: written
                                             // by ActivationTracker (it indexes them)
  Strategy planned = Strategy::kKeep;
  Strategy applied = Strategy::kKeep;  // what moved it off the device (kKeep: never moved)
  std::int64_t need_order = 0;
  // Device data (null unless placement is kDevice); `owned`: the enforcer frees it; `stream`:
  // the stream it was allocated on (frees elsewhere are ordered after the last use).
  void* ptr = nullptr;
  bool owned = false;
  Stream alloc_stream = nullptr;
  bool has_ready = false;  // `ready`: the device data is valid after it (reload/uncast)
  Event ready;
  // Pinned host copy and the D2H event after which it is complete.
  void* host = nullptr;
  bool has_offload = false;
  Event offload_done;
  // FP8 copy: n e4m3 bytes, padding to 16, then the scales.
  void* fp8 = nullptr;
  std::size_t fp8_bytes = 0;
  int busy = 0;                // an operation on it is under way (eviction must skip it)
  int acquired = 0;            // consumers holding the device pointer
  bool reload_unused = false;  // reloaded, and no consumer acquired it yet (prefetch counts it)
  std::size_t num_released() const;
};

// See file comment. Not thread safe (the Enforcer's lock guards it).
class ActivationTracker {
 public:
  // Adds a tensor; kDuplicate when desc.ptr is already the device data of a tracked tensor.
  Status add(const TensorDesc& desc, std::uint64_t* handle, std::string* error);
  TrackedTensor* find(std::uint64_t handle);
  // The tensor whose device data is at ptr (0 when none).
  std::uint64_t lookup(const void* ptr) const;
  // Sets t's device data pointer, keeping the pointer index.
  void set_ptr(TrackedTensor& t, void* ptr);
  void remove(std::uint64_t handle);
  std::size_t size() const { return tensors_.size(); }
  // Tensors in handle (registration) order.
  std::map<std::uint64_t, TrackedTensor>& tensors() { return tensors_; }
  // The tensors of one micro-batch, so that the calls that act on one (prefetch, the
  // scheduler's pieces) do not look at the tensors of the other micro-batches in flight.
  struct MicroBatch {
    std::map<std::uint64_t, TrackedTensor*> all;  // handle (registration) order
    // The ones on the host, in reload order: (need_order, handle).
    std::map<std::pair<std::int64_t, std::uint64_t>, TrackedTensor*> host;
    std::size_t reload_unused = 0;  // reloads no consumer took yet
  };
  // The index of `micro_batch` (null when it has no tensor).
  const MicroBatch* micro_batch(int micro_batch) const;
  const std::map<std::uint64_t, TrackedTensor*>& of_micro_batch(int micro_batch) const;
  // The only writers of the indexed fields (placement, reload_unused, need_order).
  void set_placement(TrackedTensor& t, Placement p);
  void set_reload_unused(TrackedTensor& t, bool unused);
  void set_need_order(TrackedTensor& t, std::int64_t order);

 private:
  std::map<std::uint64_t, TrackedTensor> tensors_;
  std::unordered_map<int, MicroBatch> by_micro_batch_;
  std::unordered_map<std::uintptr_t, std::uint64_t> by_ptr_;
  std::uint64_t next_ = 1;
};

}  // namespace bgl::enf
