// RecordBase: the fields of one saved storage's record (record.py's Record adds the moves), and
// the names the saved-tensor types share.
#include <Python.h>
#include <structmember.h>

#include <cstddef>
#include <cstdint>

#include "calls.h"
#include "detail/saved_types.h"

namespace bgl::torch_ext::detail {

Names names;
Constants constants;
PyTypeObject* record_base = nullptr;

namespace {
PyObject* placement_names[4] = {nullptr, nullptr, nullptr, nullptr};
}  // namespace

bool InternNames() {
  struct Entry {
    PyObject** slot;
    const char* text;
  };
  const Entry entries[] = {{&names.light, "light"},
                           {&names.packs_seen, "packs_seen"},
                           {&names.micro_batch, "micro_batch"},
                           {&names.param_keys, "param_keys"},
                           {&names.light_sets, "light_sets"},
                           {&names.scope, "scope"},
                           {&names.live, "live"},
                           {&names.unkeyed, "unkeyed"},
                           {&names.capture, "capture"},
                           {&names.producers, "producers"},
                           {&names.strategy_of, "strategy_of"},
                           {&names.min_move_bytes, "min_move_bytes"},
                           {&names.by_mb, "by_mb"},
                           {&names.counters, "counters"},
                           {&names.seq, "_seq"},
                           {&names.pack_py, "_pack_py"},
                           {&names.add_consumer, "add_consumer"},
                           {&names.device_alloc, "device_alloc"},
                           {&names.device_free, "device_free"},
                           {&names.sizes, "sizes"},
                           {&names.release, "release"},
                           {&names.materialize, "materialize"},
                           {&names.issuer, "issuer"},
                           {&names.records, "records"},
                           {&names.current_stream, "current_stream"},
                           {&names.device, "device"},
                           {&names.dtype, "dtype"},
                           {&names.hooks, "hooks"},
                           {&names.scheduled, "scheduled"},
                           {&names.op_ids, "op_ids"},

                           {&names.offloads, "offloads"},
                           {&names.bytes_d2h, "bytes_d2h"},
                           {&names.reloads, "reloads"},
                           {&names.bytes_h2d, "bytes_h2d"},
                           {&names.acquired, "acquired"},
                           {&names.retire, "retire"},
                           {&names.enforcer, "enforcer"},
                           {&names.regenerators, "regenerators"},
                           {&names.destroy_if_done, "_destroy_if_done"},
                           {&names.layer, "layer"},
                           {&names.fp8_casts, "fp8_casts"},
                           {&names.fp8_uncasts, "fp8_uncasts"},
                           {&names.used, "used"},
                           {&names.reserved, "reserved"},
                           {&names.grow, "grow"},
                           {&names.store, "store"},
                           {&names.light_set, "light_set"},
                           {&names.light_grain, "light_grain"},
                           {&names.operators, "operators"},
                           {&names.external, "external"},
                           {&names.small_kept, "small_kept"},
                           {&names.policy, "policy"},
                           {&names.forced, "forced"},
                           {&names.per_unit, "per_unit"},
                           {&names.qualname_slot, "_qualname"}};
  for (const Entry& e : entries) {
    *e.slot = PyUnicode_InternFromString(e.text);
    if (*e.slot == nullptr) return false;
  }
  const char* placements[4] = {"device", "host", "fp8", "dropped"};  // vocabulary.py's
  for (int i = 0; i < 4; ++i) {
    placement_names[i] = PyUnicode_InternFromString(placements[i]);
    if (placement_names[i] == nullptr) return false;
  }
  return true;
}

PyObject* PlacementName(Placement p) { return placement_names[static_cast<int>(p)]; }

bool GetInt(PyObject* obj, PyObject* name, long long* out) {
  PyObject* v = Get(obj, name);
  if (v == nullptr) return false;
  *out = PyLong_AsLongLong(v);
  Py_DECREF(v);
  return !(*out == -1 && PyErr_Occurred());
}

bool SetInt(PyObject* obj, PyObject* name, long long value) {
  PyObject* v = PyLong_FromLongLong(value);
  if (v == nullptr) return false;
  const int rc = PyObject_SetAttr(obj, name, v);
  Py_DECREF(v);
  return rc == 0;
}

bool AddTo(PyObject* dict, PyObject* key, long long by) {
  PyObject* v = PyDict_GetItemWithError(dict, key);  // borrowed
  if (v == nullptr && PyErr_Occurred()) return false;
  const long long before = v == nullptr ? 0 : PyLong_AsLongLong(v);
  if (before == -1 && PyErr_Occurred()) return false;
  PyObject* n = PyLong_FromLongLong(before + by);
  if (n == nullptr) return false;
  const int rc = PyDict_SetItem(dict, key, n);
  Py_DECREF(n);
  return rc == 0;
}

bool PlacementOf(RecordObject* r, Placement* out) {
  if (r->storage != nullptr && r->storage != Py_None) {
    *out = Placement::kDevice;
    return true;
  }
  if (r->enf == 0) {
    *out = r->regen != nullptr && r->regen != Py_None ? Placement::kDropped : Placement::kDevice;
    return true;
  }
  HooksObject* h = HooksOf(r);
  PyObject* fast = h != nullptr ? h->fast : nullptr;
  int p = 0;
  const int rc = fast != nullptr ? QueryPlacement(fast, static_cast<uint64_t>(r->enf), &p) : -1;
  if (rc != 0 || p < 0 || p > 3) {
    PyErr_Format(PyExc_RuntimeError,
                 "record of %lld bytes: its enforcer handle %lld is unknown there (status %d): "
                 "the enforcer was destroyed or the record was retired",
                 r->nbytes, r->enf, rc);
    return false;
  }
  *out = static_cast<Placement>(p);
  return true;
}

bool OffloadOf(RecordObject* r, bool* planned, bool* issued) {
  *planned = *issued = false;
  if (r->storage == nullptr || r->storage == Py_None || r->enf == 0 || r->live_block) return true;
  HooksObject* h = HooksOf(r);
  PyObject* fast = h != nullptr ? h->fast : nullptr;
  if (fast == nullptr || LifeOf(fast)->destroyed) return true;  // nothing moves it any more
  bool waiting = false;
  const int rc = QueryOffload(fast, static_cast<uint64_t>(r->enf), &waiting, issued);
  if (rc != 0) {
    PyErr_Format(PyExc_RuntimeError,
                 "record of %lld bytes: its enforcer handle %lld is unknown there (status %d): "
                 "the record was retired while it held its data",
                 r->nbytes, r->enf, rc);
    return false;
  }
  *planned = waiting || *issued;
  return true;
}

HooksObject* HooksOf(RecordObject* r) {
  if (r->tracker == nullptr) return nullptr;
  PyObject* h = Get(r->tracker, names.hooks);
  if (h == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  Py_DECREF(h);  // the tracker holds it
  return reinterpret_cast<HooksObject*>(h);
}

namespace {

#define BGL_INT(name) \
  { #name, T_LONGLONG, offsetof(RecordObject, name), 0, nullptr }
#define BGL_FLAG(name) \
  { #name, T_BOOL, offsetof(RecordObject, name), 0, nullptr }
#define BGL_OBJ(name) \
  { #name, T_OBJECT, offsetof(RecordObject, name), 0, nullptr }
PyMemberDef record_members[] = {
    BGL_INT(ptr),
    BGL_INT(nbytes),
    BGL_INT(micro_batch),
    BGL_INT(seq),
    BGL_INT(refs),
    BGL_INT(pool_block),
    BGL_INT(pool_bytes),
    BGL_INT(enf),
    BGL_FLAG(in_backward),
    BGL_FLAG(enf_block),
    BGL_FLAG(live_block),
    BGL_FLAG(released),
    BGL_FLAG(regenerating),
    BGL_FLAG(lazy),
    BGL_OBJ(tracker),
    BGL_OBJ(dtype),
    BGL_OBJ(device),
    BGL_OBJ(producer),
    BGL_OBJ(consumers),
    BGL_OBJ(storage),
    BGL_OBJ(ref),
    BGL_OBJ(packs),
    BGL_OBJ(regen),
    BGL_OBJ(stream),
    {"__weaklistoffset__", T_PYSSIZET, offsetof(RecordObject, weakreflist), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr}};
#undef BGL_INT
#undef BGL_FLAG
#undef BGL_OBJ

PyObject* GetPlacement(PyObject* self, void*) {
  Placement p = Placement::kDevice;
  if (!PlacementOf(reinterpret_cast<RecordObject*>(self), &p)) return nullptr;
  PyObject* name = PlacementName(p);
  Py_INCREF(name);
  return name;
}

PyObject* GetPlanned(PyObject* self, void*) {
  bool planned = false, issued = false;
  if (!OffloadOf(reinterpret_cast<RecordObject*>(self), &planned, &issued)) return nullptr;
  return PyBool_FromLong(planned);
}

PyObject* GetIssued(PyObject* self, void*) {
  bool planned = false, issued = false;
  if (!OffloadOf(reinterpret_cast<RecordObject*>(self), &planned, &issued)) return nullptr;
  return PyBool_FromLong(issued);
}

PyGetSetDef record_getset[] = {
    {"placement", GetPlacement, nullptr,
     const_cast<char*>("Where the data is (device, host, fp8, dropped), from its one owner: the "
                       "record's storage, else the enforcer's placement of its handle."),
     nullptr},
    {"planned", GetPlanned, nullptr,
     const_cast<char*>("Whether its offload is left to the plan's issue order, or issued while "
                       "the record still holds the device data (the enforcer's state)."),
     nullptr},
    {"issued", GetIssued, nullptr,
     const_cast<char*>("Whether an offload moved its data to the host while the record still "
                       "holds the device data the copy reads (the enforcer's state)."),
     nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

int RecordTraverse(PyObject* self, visitproc visit, void* arg) {
  auto* r = reinterpret_cast<RecordObject*>(self);
  Py_VISIT(Py_TYPE(self));
  Py_VISIT(r->tracker);
  Py_VISIT(r->dtype);
  Py_VISIT(r->device);
  Py_VISIT(r->producer);
  Py_VISIT(r->consumers);
  Py_VISIT(r->storage);
  Py_VISIT(r->ref);
  Py_VISIT(r->packs);
  Py_VISIT(r->regen);
  Py_VISIT(r->stream);
  return 0;
}

int RecordClear(PyObject* self) {
  auto* r = reinterpret_cast<RecordObject*>(self);
  Py_CLEAR(r->tracker);
  Py_CLEAR(r->dtype);
  Py_CLEAR(r->device);
  Py_CLEAR(r->producer);
  Py_CLEAR(r->consumers);
  Py_CLEAR(r->storage);
  Py_CLEAR(r->ref);
  Py_CLEAR(r->packs);
  Py_CLEAR(r->regen);
  Py_CLEAR(r->stream);
  return 0;
}

void RecordDealloc(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  PyObject_GC_UnTrack(self);
  auto* r = reinterpret_cast<RecordObject*>(self);
  if (r->weakreflist != nullptr) PyObject_ClearWeakRefs(self);
  RecordClear(self);
  type->tp_free(self);
  Py_DECREF(type);
}

}  // namespace

bool AddRecordType(PyObject* module) {
  PyType_Slot slots[] = {
      {Py_tp_doc, const_cast<char*>("The fields of one saved storage's record (record.py).")},
      {Py_tp_members, record_members},
      {Py_tp_getset, record_getset},
      {Py_tp_traverse, reinterpret_cast<void*>(RecordTraverse)},
      {Py_tp_clear, reinterpret_cast<void*>(RecordClear)},
      {Py_tp_dealloc, reinterpret_cast<void*>(RecordDealloc)},
      {0, nullptr}};
  PyType_Spec spec = {"bagualu._C.RecordBase", sizeof(RecordObject), 0,
                      Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC, slots};
  PyObject* type = PyType_FromSpec(&spec);
  if (type == nullptr) return false;
  Py_INCREF(type);  // record_base's
  if (PyModule_AddObject(module, "RecordBase", type) < 0) {
    Py_DECREF(type);
    Py_DECREF(type);
    return false;
  }
  record_base = reinterpret_cast<PyTypeObject*>(type);
  // The placement names, by bgl_placement (vocabulary.py's DEVICE, HOST, FP8_PLACE, DROPPED).
  PyObject* names_tuple = PyTuple_Pack(4, placement_names[0], placement_names[1],
                                       placement_names[2], placement_names[3]);
  if (names_tuple == nullptr) return false;
  if (PyModule_AddObject(module, "PLACEMENTS", names_tuple) < 0) {
    Py_DECREF(names_tuple);
    return false;
  }
  return true;
}

}  // namespace bgl::torch_ext::detail
