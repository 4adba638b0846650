// The C ABIs of libbgl_alloc.so and libbgl_enforce.so (bgl/alloc.h, bgl/enforce.h), found at run
// time in the libraries the package loaded, and the Python types that call them without ctypes.
// Thread safety: as the C ABIs (every function is thread safe); the Python objects are used with
// the GIL held.
#ifndef BGL_TORCH_CALLS_H_
#define BGL_TORCH_CALLS_H_

#include <Python.h>

#include <cstddef>
#include <cstdint>

#include "bgl/enforce.h"

namespace bgl::torch_ext {

// Adds the types Enforcer (the enforcer's hot calls) and Pool (the simulated device's blocks)
// to `module`; false with a Python error set on failure.
bool AddCallTypes(PyObject* module);

// A saved storage as the enforcer's register-and-move calls take it.
struct SavedDesc {
  void* ptr = nullptr;
  size_t bytes = 0;
  int dtype = 0;
  int producer_op = 0;
  int micro_batch = 0;
  int64_t need_order = 0;
  int consumer = -1;  // -1: none yet
  void* stream = nullptr;
};

// The lifetime of an enforcer (enforce/enforcer.py destroys its library handle once nothing is
// outstanding): fields of the binding's Enforcer that Python reads and writes as its attributes
// live_blocks, tracked, closing and destroyed, and the hot path updates here.
struct EnforcerLife {
  long long live_blocks = 0;  // blocks PyTorch still holds
  long long tracked = 0;      // registered tensors the package has not retired
  char closing = 0;           // close() was called: destroy once nothing is outstanding
  char destroyed = 0;
};
// The lifetime of an Enforcer (`enforcer` must be one: IsEnforcer).
EnforcerLife* LifeOf(PyObject* enforcer);

// Whether `obj` is an Enforcer.
bool IsEnforcer(PyObject* obj);

// bgl_enf_register_saved through an Enforcer (the holder first, then desc.consumer): the status;
// *handle as the C ABI sets it.
int RegisterSaved(PyObject* enforcer, const SavedDesc& desc, uint64_t* handle);

// bgl_enf_offload_saved through an Enforcer (the holder first, then desc.consumer): the status;
// *handle as the C ABI sets it.
int OffloadSaved(PyObject* enforcer, const SavedDesc& desc, uint64_t* handle);

// bgl_enf_store_fp8_saved through an Enforcer: the status; *handle and *fp8_bytes as the C ABI
// sets them.
int StoreFp8Saved(PyObject* enforcer, const SavedDesc& desc, uint64_t* handle, size_t* fp8_bytes);

// bgl_enf_acquire(handle, any consumer, stream) through an Enforcer: the status, *ptr the data.
int Acquire(PyObject* enforcer, uint64_t handle, void* stream, void** ptr);

// bgl_enf_release(handle, any consumer, stream) through an Enforcer: the status.
int ReleaseBlock(PyObject* enforcer, uint64_t handle, void* stream);

// bgl_enf_unregister through an Enforcer: the status.
int Unregister(PyObject* enforcer, uint64_t handle);

// Where the data of a record whose storage is gone is, from bgl_enf_query of `handle` through an
// Enforcer (a bgl_placement): the enforcer's placement, except that data reloaded or uncast ahead
// of its consumer is where what moved it put it (host, FP8) until the record acquires it. The
// status (BGL_ERR_UNKNOWN_HANDLE for a handle, or an enforcer, that is gone).
int QueryPlacement(PyObject* enforcer, uint64_t handle, int* placement);

// Where an offload of a tensor stands, from bgl_enf_query of `handle` through an Enforcer (its
// one state machine, the enforcer's TrackedTensor): *waiting, the plan's strategy is offload and
// nothing moved the tensor yet (the plan's issue order will); *issued, an offload moved it to
// the host (its copy issued, perhaps still running: what it read is PyTorch's until the package
// lets go of it). The status (BGL_ERR_UNKNOWN_HANDLE for a handle that is gone).
int QueryOffload(PyObject* enforcer, uint64_t handle, bool* waiting, bool* issued);

// bgl_enf_schedule_at through an Enforcer: the status, *passed the stages compute passed.
int ScheduleAt(PyObject* enforcer, int chain, int op, int* passed);

// bgl_enf_schedule_begin through an Enforcer: the status.
int ScheduleBegin(PyObject* enforcer, const bgl_enf_issue_item* items, size_t count,
                  int offload_micro_batch, int recover_micro_batch);

// bgl_enf_enum_value of the Enforcer's library: the status, *value the number of `name`.
int EnumValue(PyObject* enforcer, const char* kind, const char* name, int* value);

// Whether `obj` is a Pool.
bool IsPool(PyObject* obj);

// bgl_alloc of `nbytes` (at least 1) on the pool's device: the block, 0 when there is no room.
long long PoolAllocRaw(PyObject* pool, long long nbytes);

// bgl_free of a block PoolAllocRaw gave.
void PoolFreeRaw(PyObject* pool, long long block, long long nbytes);

}  // namespace bgl::torch_ext

#endif  // BGL_TORCH_CALLS_H_
