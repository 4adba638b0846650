// Internals shared by record.cc, packed.cc and hooks.cc (saved.h is the interface): the objects'
// layouts, the attribute names they use, and the calls between them.
// Thread safety: as saved.h (the GIL held throughout).
#ifndef BGL_TORCH_DETAIL_SAVED_TYPES_H_
#define BGL_TORCH_DETAIL_SAVED_TYPES_H_

#include <ATen/core/Tensor.h>
#include <Python.h>

#include <array>
#include <cstdint>
#include <vector>

namespace bgl::torch_ext::detail {

// Attribute and method names, interned once (InternNames).
struct Names {
  PyObject *light, *packs_seen, *micro_batch, *param_keys, *light_sets, *scope, *live, *unkeyed,
      *capture, *producers, *strategy_of, *min_move_bytes, *by_mb, *counters, *seq, *pack_py,
      *add_consumer, *device_alloc, *device_free, *sizes, *release, *materialize, *issuer, *records,
      *current_stream, *device, *dtype, *hooks, *scheduled, *op_ids, *offloads, *bytes_d2h,
      *reloads, *bytes_h2d, *acquired, *retire, *enforcer, *regenerators, *destroy_if_done, *layer,
      *fp8_casts, *fp8_uncasts, *used, *reserved, *grow, *store, *light_set, *light_grain,
      *operators, *external, *small_kept, *policy, *forced, *per_unit, *qualname_slot;
};
extern Names names;
bool InternNames();

// A new reference to obj.<name>, or nullptr with the error set.
inline PyObject* Get(PyObject* obj, PyObject* name) { return PyObject_GetAttr(obj, name); }
// obj.<name> as an integer; false with the error set.
bool GetInt(PyObject* obj, PyObject* name, long long* out);
bool SetInt(PyObject* obj, PyObject* name, long long value);
// dict[key] += by (a dict of ints; a missing key counts from 0).
bool AddTo(PyObject* dict, PyObject* key, long long by);

// The fields of record.py's Record, by its names.
struct RecordObject {
  PyObject_HEAD long long ptr, nbytes, micro_batch, seq, refs, pool_block, pool_bytes, enf;
  char in_backward, enf_block, live_block, released, regenerating, lazy;
  PyObject *tracker, *dtype, *device, *producer, *consumers, *storage, *ref, *packs, *regen,
      *stream;
  PyObject* weakreflist;
};

// Where a record's data is: record.py's placements (vocabulary.py's DEVICE, HOST, FP8_PLACE,
// DROPPED), numbered as the C ABI's bgl_placement.
enum class Placement : int { kDevice = 0, kHost = 1, kFp8 = 2, kDropped = 3 };
// A record's placement has one owner; no field mirrors it. While the record holds its storage
// the data is on the device (kept, or an issued offload whose copy still reads it); else a
// registered record's placement is the enforcer's (host, FP8, dropped; reloaded or uncast ahead:
// still host or FP8 for the record, calls.h QueryPlacement); else it was dropped for a rerun
// (regen) or is on the device. False with the error set when the enforcer cannot say (an unknown
// handle).
bool PlacementOf(RecordObject* r, Placement* out);
// Where the record's offload stands (record.py's planned and issued), from the same one owner:
// *issued, an offload moved its data to the host (issued behind the copy threads, or by the
// plan's issue order) while the record still holds the device data the copy reads; *planned,
// that, or its offload is left to the plan's issue order. Both false, with no enforcer call,
// where the record holds no storage, is not tracked or holds an enforcer block (its data came
// back). False with the error set when the enforcer cannot say (an unknown handle).
bool OffloadOf(RecordObject* r, bool* planned, bool* issued);
// The placement's name, a borrowed interned string ("device", "host", "fp8", "dropped").
PyObject* PlacementName(Placement p);
extern PyTypeObject* record_base;
bool AddRecordType(PyObject* module);

// The strategies of vocabulary.py and its operator outside every layer (set by the first Hooks).
struct Constants {
  PyObject *keep = nullptr, *offload = nullptr, *fp8 = nullptr, *outside = nullptr;
};
extern Constants constants;

// How to rebuild a saved tensor on whatever storage holds its data then.
struct ViewMeta {
  int64_t offset = 0;
  std::vector<int64_t> sizes, strides;
  at::TensorOptions options;
  // The view's lazy math bits (a conjugate or negative view reads its storage through them: the
  // storage holds the data before the bit applies), put back on the rebuilt view.
  bool conj = false, neg = false;
};

// The hooks over one tracker and what their fast paths need of it.
struct HooksObject {
  PyObject_HEAD PyObject* tracker;
  PyObject* record_type;  // record.py's Record (a RecordBase subclass)
  PyObject* pool;         // the simulated device's _C.Pool, or nullptr (Python accounts)
  PyObject* enforcer;     // the tracker's Enforcer (Python) or None
  PyObject* fast;         // its _C.Enforcer, or nullptr
  PyObject* dtype_codes;  // the enforcer's torch.dtype -> bgl_dtype, or nullptr
  long long dtype_other;  // bgl_dtype of any other dtype (bytes)
  bool enforcer_cuda, sync_offloads, reload_ahead;
  int device_index;                   // the CUDA device's (0 on the host backend)
  c10::DeviceType activations;        // the device type whose storages are activations
  std::array<PyObject*, 64>* dtypes;  // torch.dtype objects by ScalarType, filled as met
  PyObject* device_obj;               // the torch.device last met (a new one per tensor.device)
  int device_key;                     // its (type << 8 | index + 1); 0: none yet
};
// The Hooks of a record's tracker (borrowed; nullptr when it has none).
HooksObject* HooksOf(RecordObject* r);

// Packed(rec, t) from C++: a new reference (nullptr with the error set).
PyObject* NewPacked(PyObject* rec, PyObject* t);
bool AddPackedType(PyObject* module, PyTypeObject** type);
// Packed.unpack(): the saved tensor (a new reference).
PyObject* UnpackPacked(PyObject* packed);

}  // namespace bgl::torch_ext::detail

#endif  // BGL_TORCH_DETAIL_SAVED_TYPES_H_
