// Hooks: the pack and unpack callables over one tracker (capture/tracker.py). The pack makes or
// finds the record of a plain tensor's storage, keeps it or offloads it at once where its
// producer's strategy says so, and counts small storages in their light set; light capture of
// new storages, tensor subclasses, the capture micro-batch, recompute and offloads left to the
// issue order are the tracker's _pack_py.
#include <ATen/SequenceNumber.h>
#include <Python.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/function.h>  // Node (torch 2.6 has no node.h)
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <array>
#include <cstdint>

#include "calls.h"
#include "detail/saved_types.h"
#include "saved.h"

namespace bgl::torch_ext {
namespace {

using detail::constants;
using detail::Get;
using detail::GetInt;
using detail::HooksObject;
using detail::names;
using detail::RecordObject;
using detail::SetInt;

int HooksTraverse(PyObject* self, visitproc visit, void* arg) {
  auto* h = reinterpret_cast<HooksObject*>(self);
  Py_VISIT(Py_TYPE(self));
  Py_VISIT(h->tracker);
  Py_VISIT(h->record_type);
  Py_VISIT(h->pool);
  Py_VISIT(h->enforcer);
  Py_VISIT(h->fast);
  Py_VISIT(h->dtype_codes);
  Py_VISIT(h->device_obj);
  return 0;
}

int HooksClear(PyObject* self) {
  auto* h = reinterpret_cast<HooksObject*>(self);
  Py_CLEAR(h->tracker);
  Py_CLEAR(h->record_type);
  Py_CLEAR(h->pool);
  Py_CLEAR(h->enforcer);
  Py_CLEAR(h->fast);
  Py_CLEAR(h->dtype_codes);
  Py_CLEAR(h->device_obj);
  h->device_key = 0;
  return 0;
}

void HooksDealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  HooksClear(self);
  auto* h = reinterpret_cast<HooksObject*>(self);
  if (h->dtypes != nullptr) {
    for (PyObject* d : *h->dtypes) Py_XDECREF(d);
    delete h->dtypes;
  }
  PyTypeObject* type = Py_TYPE(self);
  type->tp_free(self);
  Py_DECREF(type);
}

// Sets a constant the first time; later Hooks must name the same object.
bool SetConstant(PyObject* dict, const char* key, PyObject** slot) {
  PyObject* v = PyDict_GetItemString(dict, key);  // borrowed
  if (v == nullptr) {
    PyErr_Format(PyExc_KeyError, "Hooks: constants has no '%s'", key);
    return false;
  }
  if (*slot == nullptr) {
    Py_INCREF(v);
    *slot = v;
  } else if (*slot != v) {
    PyErr_Format(PyExc_ValueError, "Hooks: another '%s' than the first Hooks'", key);
    return false;
  }
  return true;
}

bool Flag(PyObject* obj, const char* name, bool* out) {
  PyObject* v = PyObject_GetAttrString(obj, name);
  if (v == nullptr) return false;
  const int on = PyObject_IsTrue(v);
  Py_DECREF(v);
  *out = on > 0;
  return on >= 0;
}

bool IntAttr(PyObject* obj, const char* name, long long* out) {
  PyObject* v = PyObject_GetAttrString(obj, name);
  if (v == nullptr) return false;
  *out = PyLong_AsLongLong(v);
  Py_DECREF(v);
  return !(*out == -1 && PyErr_Occurred());
}

// Hooks(tracker, Record, constants, pool): constants maps keep, offload, fp8 (strategies) and
// outside (the operator outside every layer) to their objects.
int HooksInit(PyObject* self, PyObject* args, PyObject*) {
  auto* h = reinterpret_cast<HooksObject*>(self);
  PyObject *tracker, *record_type, *consts, *pool;
  if (!PyArg_ParseTuple(args, "OOO!O:Hooks", &tracker, &record_type, &PyDict_Type, &consts,
                        &pool)) {
    return -1;
  }
  if (!PyType_Check(record_type) ||
      !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(record_type), detail::record_base)) {
    PyErr_SetString(PyExc_TypeError, "Hooks: the record type must subclass RecordBase");
    return -1;
  }
  if (pool != Py_None && !IsPool(pool)) {
    PyErr_SetString(PyExc_TypeError, "Hooks: pool must be a bagualu._C.Pool or None");
    return -1;
  }
  if (!SetConstant(consts, "fp8", &constants.fp8) ||
      !SetConstant(consts, "keep", &constants.keep) ||
      !SetConstant(consts, "offload", &constants.offload) ||
      !SetConstant(consts, "outside", &constants.outside)) {
    return -1;
  }
  PyObject* device_type = PyObject_GetAttrString(tracker, "device_type");
  if (device_type == nullptr) return -1;
  const char* dt = PyUnicode_AsUTF8(device_type);
  if (dt == nullptr) {
    Py_DECREF(device_type);
    return -1;
  }
  try {
    h->activations = c10::Device(dt).type();
  } catch (const std::exception& e) {
    PyErr_Format(PyExc_ValueError, "Hooks: device type '%s': %s", dt, e.what());
    Py_DECREF(device_type);
    return -1;
  }
  Py_DECREF(device_type);
  PyObject* enforcer = Get(tracker, names.enforcer);
  if (enforcer == nullptr) return -1;
  HooksClear(self);
  h->enforcer = enforcer;  // the reference Get gave
  Py_INCREF(tracker);
  h->tracker = tracker;
  Py_INCREF(record_type);
  h->record_type = record_type;
  if (pool != Py_None) {
    Py_INCREF(pool);
    h->pool = pool;
  }
  h->enforcer_cuda = false;
  h->device_index = 0;
  h->dtype_other = 0;
  if (enforcer != Py_None) {
    PyObject* fast = PyObject_GetAttrString(enforcer, "fast");
    if (fast == nullptr) return -1;
    if (!IsEnforcer(fast)) {
      Py_DECREF(fast);
      PyErr_SetString(PyExc_TypeError, "Hooks: the enforcer's fast is no bagualu._C.Enforcer");
      return -1;
    }
    h->fast = fast;
    h->dtype_codes = PyObject_GetAttrString(enforcer, "_dtypes");
    long long index = 0;
    if (h->dtype_codes == nullptr || !PyDict_Check(h->dtype_codes) ||
        !Flag(enforcer, "cuda", &h->enforcer_cuda) ||
        !IntAttr(enforcer, "_dtype_bytes", &h->dtype_other) ||
        !IntAttr(enforcer, "_device_index", &index)) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "Hooks: the enforcer's dtypes");
      return -1;
    }
    h->device_index = static_cast<int>(index);
  }
  if (!Flag(tracker, "sync_offloads", &h->sync_offloads) ||
      !Flag(tracker, "reload_ahead", &h->reload_ahead)) {
    return -1;
  }
  if (h->dtypes == nullptr) h->dtypes = new std::array<PyObject*, 64>{};
  return 0;
}

// --- lookups -----------------------------------------------------------------------------------
// Whether `ref` (a weakref, or None) refers to a storage of `impl`.
bool RefersTo(PyObject* ref, c10::StorageImpl* impl) {
  if (ref == nullptr || !PyWeakref_Check(ref)) return false;
  PyObject* target = PyWeakref_GetObject(ref);  // borrowed
  return target != Py_None && THPStorage_Check(target) &&
         THPStorage_Unpack(target).unsafeGetStorageImpl() == impl;
}

// record.py Record.same_storage, on the storage's implementation.
bool SameStorage(RecordObject* r, c10::StorageImpl* impl) {
  if (r->storage != nullptr && r->storage != Py_None && (r->ref == nullptr || r->ref == Py_None)) {
    return THPStorage_Check(r->storage) &&
           THPStorage_Unpack(r->storage).unsafeGetStorageImpl() == impl;
  }
  return RefersTo(r->ref, impl);
}

PyObject* PackInPython(HooksObject* h, PyObject* t) {
  return PyObject_CallMethodOneArg(h->tracker, names.pack_py, t);
}

PyObject* DtypeOf(HooksObject* h, PyObject* t, at::ScalarType st) {
  const auto i = static_cast<size_t>(st);
  if (i < h->dtypes->size() && (*h->dtypes)[i] != nullptr) {
    Py_INCREF((*h->dtypes)[i]);
    return (*h->dtypes)[i];
  }
  PyObject* d = Get(t, names.dtype);
  if (d != nullptr && i < h->dtypes->size()) {
    Py_INCREF(d);
    (*h->dtypes)[i] = d;
  }
  return d;
}

// tensor.device, the same object for every tensor of the device last met.
PyObject* DeviceOf(HooksObject* h, PyObject* t, const at::Tensor& x) {
  const c10::Device d = x.device();
  const int key = (static_cast<int>(d.type()) << 8) | (static_cast<int>(d.index()) + 1);
  if (h->device_obj != nullptr && h->device_key == key) {
    Py_INCREF(h->device_obj);
    return h->device_obj;
  }
  PyObject* obj = Get(t, names.device);
  if (obj != nullptr) {
    Py_INCREF(obj);
    Py_XSETREF(h->device_obj, obj);
    h->device_key = key;
  }
  return obj;
}

// Mover.op_id (enforce/mover.py): the enforcer's number of an operator (stable for the tracker's
// life).
bool OpId(HooksObject* h, PyObject* op, int* out) {
  PyObject* ids = Get(h->tracker, names.op_ids);
  if (ids == nullptr) return false;
  PyObject* v = PyDict_GetItemWithError(ids, op);  // borrowed
  bool ok = true;
  if (v != nullptr) {
    *out = static_cast<int>(PyLong_AsLong(v));
  } else if (PyErr_Occurred()) {
    ok = false;
  } else {
    const Py_ssize_t n = PyDict_GET_SIZE(ids);
    PyObject* id = PyLong_FromSsize_t(n);
    ok = id != nullptr && PyDict_SetItem(ids, op, id) == 0;
    Py_XDECREF(id);
    *out = static_cast<int>(n);
  }
  Py_DECREF(ids);
  return ok && !PyErr_Occurred();
}

// The block of `nbytes` accounting a kept record on the device: the pool's (the simulated
// device) when it has room, else the tracker's device_alloc (which evicts, counts on CUDA, or
// raises OutOfMemoryError).
bool Account(HooksObject* h, long long nbytes, long long* block) {
  if (h->pool != nullptr) {
    *block = PoolAllocRaw(h->pool, nbytes);
    if (*block != 0) return true;
  }
  PyObject* n = PyLong_FromLongLong(nbytes);
  if (n == nullptr) return false;
  PyObject* out = PyObject_CallMethodOneArg(h->tracker, names.device_alloc, n);
  Py_DECREF(n);
  if (out == nullptr) return false;
  *block = PyLong_AsLongLong(out);
  Py_DECREF(out);
  return !(*block == -1 && PyErr_Occurred());
}

// What a new record needs to know about its tensor.
struct Saved {
  PyObject* t;
  const at::Tensor* x;
  const c10::Storage* st;
  long long key, nbytes, mb;
};

// Tracker.new_record(st, dtype, producer, consumer, register=False, account=`account`): a new
// reference to the record, in the tracker's live records. A record of the activations' device
// under an enforcer is lazy (registered once something moves it).
PyObject* NewRecord(HooksObject* h, const Saved& s, PyObject* producer, PyObject* consumer,
                    bool account) {
  PyObject* tr = h->tracker;
  long long seq = 0;
  if (!GetInt(tr, names.seq, &seq) || !SetInt(tr, names.seq, seq + 1)) return nullptr;
  auto* type = reinterpret_cast<PyTypeObject*>(h->record_type);
  auto* r = reinterpret_cast<RecordObject*>(type->tp_alloc(type, 0));
  if (r == nullptr) return nullptr;
  PyObject* rec = reinterpret_cast<PyObject*>(r);
  r->ptr = s.key;
  r->nbytes = s.nbytes;
  r->micro_batch = s.mb;
  r->seq = seq + 1;
  Py_INCREF(tr);
  r->tracker = tr;
  r->dtype = DtypeOf(h, s.t, s.x->scalar_type());
  r->device = DeviceOf(h, s.t, *s.x);
  Py_INCREF(producer);
  r->producer = producer;
  r->consumers = PyList_New(0);
  r->storage = THPStorage_Wrap(*s.st);
  if (r->dtype == nullptr || r->device == nullptr || r->consumers == nullptr ||
      r->storage == nullptr || PyList_Append(r->consumers, consumer) < 0) {
    Py_DECREF(rec);
    return nullptr;
  }
  if (h->enforcer != Py_None && s.st->device_type() == h->activations) {
    r->lazy = 1;
    if (h->enforcer_cuda) {  // its first move is ordered after the producer's work
      r->stream = PyObject_CallMethodNoArgs(h->enforcer, names.current_stream);
      if (r->stream == nullptr) {
        Py_DECREF(rec);
        return nullptr;
      }
    }
  }
  if (account) {
    long long block = 0;
    if (!Account(h, s.nbytes, &block)) {
      Py_DECREF(rec);
      return nullptr;
    }
    r->pool_block = block;
    r->pool_bytes = s.nbytes;
  }
  // live[key] = rec; by_mb.setdefault(mb, set()).add(rec); counters["records"] += 1
  PyObject* live = Get(tr, names.live);
  PyObject* by_mb = live == nullptr ? nullptr : Get(tr, names.by_mb);
  PyObject* counters = by_mb == nullptr ? nullptr : Get(tr, names.counters);
  PyObject* k = PyLong_FromLongLong(s.key);
  PyObject* unit = PyLong_FromLongLong(s.mb);
  bool ok =
      counters != nullptr && k != nullptr && unit != nullptr && PyDict_SetItem(live, k, rec) == 0;
  if (ok) {
    PyObject* recs = PyDict_GetItemWithError(by_mb, unit);  // borrowed
    if (recs == nullptr && !PyErr_Occurred()) {
      PyObject* fresh = PySet_New(nullptr);
      ok = fresh != nullptr && PyDict_SetItem(by_mb, unit, fresh) == 0;
      recs = fresh;
      Py_XDECREF(fresh);  // the dict holds it
    }
    ok = ok && recs != nullptr && PySet_Add(recs, rec) == 0 &&
         detail::AddTo(counters, names.records, 1);
  }
  Py_XDECREF(live);
  Py_XDECREF(by_mb);
  Py_XDECREF(counters);
  Py_XDECREF(k);
  Py_XDECREF(unit);
  if (!ok) {
    Py_DECREF(rec);
    return nullptr;
  }
  return rec;
}

// Mover._move_at_once on synchronous copies: the enforcer registers the new record and copies
// it to its pinned pool (`fp8` false) or casts it to FP8 (true) in one call, and the device copy
// goes (Record.left_for_host, Record.stored_fp8). A failure is the tracker's (_move_outcome: the
// error said, the record accounted on the device).
bool MoveAtOnce(HooksObject* h, RecordObject* r, bool fp8) {
  PyObject* rec = reinterpret_cast<PyObject*>(r);
  SavedDesc d;
  int consumer = -1;
  if (!OpId(h, r->producer, &d.producer_op) ||
      !OpId(h, PyList_GET_ITEM(r->consumers, 0), &consumer)) {
    return false;
  }
  PyObject* code = PyDict_GetItemWithError(h->dtype_codes, r->dtype);  // borrowed
  if (code == nullptr && PyErr_Occurred()) return false;
  d.dtype = static_cast<int>(code != nullptr ? PyLong_AsLong(code) : h->dtype_other);
  d.ptr = reinterpret_cast<void*>(static_cast<uintptr_t>(r->ptr));
  d.bytes = static_cast<size_t>(r->nbytes);
  d.micro_batch = static_cast<int>(r->micro_batch);
  // enforce/mover.py need_order: within a micro-batch the backward needs the last saved storage
  // first.
  d.need_order = (r->micro_batch << 32) + (1LL << 31) - 1 - (r->seq % (1LL << 31));
  d.consumer = consumer;
  r->lazy = 0;
  uint64_t handle = 0;
  size_t fp8_bytes = 0;
  const int rc =
      fp8 ? StoreFp8Saved(h->fast, d, &handle, &fp8_bytes) : OffloadSaved(h->fast, d, &handle);
  if (rc != 0) {
    PyObject* out = PyObject_CallMethod(h->tracker, "_move_outcome", "OOiK", rec,
                                        fp8 ? constants.fp8 : constants.offload, rc,
                                        static_cast<unsigned long long>(handle));
    Py_XDECREF(out);
    return out != nullptr;
  }
  r->enf = static_cast<long long>(handle);
  LifeOf(h->fast)->tracked += 1;
  // The original storage is only remembered (a later pack of it finds this record).
  PyObject* ref = PyWeakref_NewRef(r->storage, nullptr);
  if (ref == nullptr) return false;
  Py_XSETREF(r->ref, ref);
  Py_CLEAR(r->storage);  // now on the host or in FP8: the enforcer's placement says which
  if (fp8) {  // Record._enforcer_bytes: the pool counts the FP8 copy (the simulated device)
    if (h->pool != nullptr) {
      r->pool_bytes = static_cast<long long>(fp8_bytes);
      r->enf_block = 1;
    } else {
      PyObject* out = PyObject_CallMethod(rec, "_account", "n", static_cast<Py_ssize_t>(fp8_bytes));
      if (out == nullptr) return false;
      Py_DECREF(out);
    }
  }
  PyObject* counters = Get(h->tracker, names.counters);
  const bool ok =
      counters != nullptr && (fp8 ? detail::AddTo(counters, names.fp8_casts, 1)
                                  : detail::AddTo(counters, names.offloads, 1) &&
                                        detail::AddTo(counters, names.bytes_d2h, r->nbytes));
  Py_XDECREF(counters);
  return ok;
}

// tracker.strategy_of(op, unit), a new reference. Where that is Strategies.of
// (planning/strategies.py) under bagualu's plans with nothing forced, its plan branch is read
// here from the plans it holds (per_unit: unit -> qualname -> strategy), with no Python frame:
// an operator outside the layers keeps, one a plan does not name keeps. Any other policy, forced
// strategies or another strategy_of (a test's) is called.
PyObject* StrategyOf(PyObject* tr, PyObject* op, PyObject* unit) {
  PyObject* of = Get(tr, names.strategy_of);
  if (of == nullptr) return nullptr;
  PyObject* owner = PyMethod_Check(of) ? PyMethod_GET_SELF(of) : nullptr;  // borrowed
  PyObject* policy = owner == nullptr ? nullptr : PyObject_GetAttr(owner, names.policy);
  PyObject* forced = policy == nullptr ? nullptr : PyObject_GetAttr(owner, names.forced);
  PyObject* per_unit = forced == nullptr ? nullptr : PyObject_GetAttr(owner, names.per_unit);
  PyObject* out = nullptr;
  bool fast = per_unit != nullptr && PyDict_Check(per_unit) && forced == Py_None &&
              PyUnicode_Check(policy) && PyUnicode_CompareWithASCIIString(policy, "bagualu") == 0;
  PyErr_Clear();  // a strategy_of with no plans of its own (AttributeError): called below
  if (fast) {
    long long layer = 0;
    PyObject* table = nullptr;
    if (!GetInt(op, names.layer, &layer)) {
      fast = false;
    } else if (layer < 0) {
      out = constants.keep;
    } else if ((table = PyDict_GetItemWithError(per_unit, unit)) == nullptr) {  // borrowed
      out = PyErr_Occurred() ? nullptr : constants.keep;
    } else if (PyDict_Check(table)) {
      PyObject* qualname = Get(op, names.qualname_slot);
      out = qualname == nullptr ? nullptr : PyDict_GetItemWithError(table, qualname);
      Py_XDECREF(qualname);
      if (out == nullptr && !PyErr_Occurred()) out = constants.keep;
    } else {
      fast = false;
    }
    Py_XINCREF(out);
  }
  Py_XDECREF(per_unit);
  Py_XDECREF(forced);
  Py_XDECREF(policy);
  if (!fast) {
    PyErr_Clear();
    out = PyObject_CallFunctionObjArgs(of, op, unit, nullptr);
  }
  Py_DECREF(of);
  return out;
}

// The producer (a new reference) of the storage: a noted producer, else the innermost operator
// running now (ForwardScope.producer_call, capture/scope.py).
PyObject* ProducerOf(HooksObject* h, PyObject* key, c10::StorageImpl* impl, PyObject* op) {
  PyObject* producers = Get(h->tracker, names.producers);
  if (producers == nullptr) return nullptr;
  PyObject* hit = PyDict_GetItemWithError(producers, key);  // borrowed
  PyObject* out = nullptr;
  if (hit != nullptr && PyTuple_Check(hit) && PyTuple_GET_SIZE(hit) >= 2 &&
      RefersTo(PyTuple_GET_ITEM(hit, 0), impl)) {
    out = PyTuple_GET_ITEM(hit, 1);
  } else if (!PyErr_Occurred()) {
    out = op;
  }
  Py_XINCREF(out);
  Py_DECREF(producers);
  return out;
}

// Whether the tracker's light set of `unit` counted the storage (capture/light.py holds): 1, 0,
// or -1 with the error set.
int LightHolds(PyObject* tr, PyObject* unit, PyObject* key, c10::StorageImpl* impl) {
  PyObject* sets = Get(tr, names.light_sets);
  if (sets == nullptr) return -1;
  PyObject* ls = PyDict_GetItemWithError(sets, unit);  // borrowed
  int out = PyErr_Occurred() ? -1 : 0;
  if (ls != nullptr) {
    PyObject* sizes = Get(ls, names.sizes);
    if (sizes == nullptr) {
      out = -1;
    } else {
      PyObject* seen = PyDict_GetItemWithError(sizes, key);  // borrowed
      if (seen != nullptr && PyTuple_Check(seen) && PyTuple_GET_SIZE(seen) >= 1) {
        out = RefersTo(PyTuple_GET_ITEM(seen, 0), impl) ? 1 : 0;
      } else if (PyErr_Occurred()) {
        out = -1;
      }
      Py_DECREF(sizes);
    }
  }
  Py_DECREF(sets);
  return out;
}

// LightSet.count (capture/light.py): counts `storage` (`nbytes` at pointer `key`) in the light
// set `ls`, saved inside the layers or not; a dead storage counted at the same pointer is
// forgotten first. Growing past the blocks reserved is LightSet.grow's (an allocator call, which
// may raise OutOfMemoryError: nothing more is counted then). False with the error set.
bool CountLight(PyObject* ls, PyObject* storage, PyObject* key, long long nbytes, bool inside) {
  PyObject* sizes = Get(ls, names.sizes);
  if (sizes == nullptr) return false;
  long long used = 0, reserved = 0;
  bool ok =
      PyDict_Check(sizes) && GetInt(ls, names.used, &used) && GetInt(ls, names.reserved, &reserved);
  if (!ok && !PyErr_Occurred()) {
    PyErr_SetString(PyExc_TypeError, "light_count: the light set's sizes is no dict");
  }
  PyObject* seen = ok ? PyDict_GetItemWithError(sizes, key) : nullptr;  // borrowed
  ok = ok && (seen != nullptr || !PyErr_Occurred());
  if (ok && seen != nullptr && PyTuple_Check(seen) && PyTuple_GET_SIZE(seen) == 2) {
    const long long was = PyLong_AsLongLong(PyTuple_GET_ITEM(seen, 1));  // LightSet.forget
    ok = !(was == -1 && PyErr_Occurred());
    used -= was < 0 ? -was : was;
    ok = ok && SetInt(ls, names.used, used);
  }
  if (ok && used + nbytes > reserved) {
    PyObject* n = PyLong_FromLongLong(nbytes);
    PyObject* out = n == nullptr ? nullptr : PyObject_CallMethodObjArgs(ls, names.grow, n, nullptr);
    ok = out != nullptr;
    Py_XDECREF(out);
    Py_XDECREF(n);
  } else if (ok) {
    ok = SetInt(ls, names.used, used + nbytes);
  }
  if (ok) {
    PyObject* ref = PyWeakref_NewRef(storage, nullptr);
    PyObject* entry =
        ref == nullptr ? nullptr : Py_BuildValue("(OL)", ref, inside ? nbytes : -nbytes);
    ok = entry != nullptr && PyDict_SetItem(sizes, key, entry) == 0;
    Py_XDECREF(entry);
    Py_XDECREF(ref);
  }
  Py_DECREF(sizes);
  return ok;
}

// ForwardScope.inside_layers (capture/scope.py): whether a storage saved now counts inside the
// layers (the innermost operator is in a layer and the storage did not enter it from outside).
// 1, 0, or -1 with the error set.
int InsideLayers(PyObject* tr, PyObject* scope, PyObject* key, c10::StorageImpl* impl) {
  if (!PyList_Check(scope) || PyList_GET_SIZE(scope) == 0) return 0;
  long long layer = 0;
  if (!GetInt(PyList_GET_ITEM(scope, PyList_GET_SIZE(scope) - 1), names.layer, &layer)) return -1;
  if (layer < 0) return 0;
  PyObject* ops = Get(tr, names.operators);
  PyObject* external = ops == nullptr ? nullptr : Get(ops, names.external);
  Py_XDECREF(ops);
  if (external == nullptr) return -1;
  int out = 1;
  if (PyDict_Check(external)) {
    PyObject* ref = PyDict_GetItemWithError(external, key);  // borrowed
    if (ref != nullptr) {
      out = RefersTo(ref, impl) ? 0 : 1;
    } else if (PyErr_Occurred()) {
      out = -1;
    }
  }
  Py_DECREF(external);
  return out;
}

// Tracker._produced_record's small storage (capture/tracker.py): outside the capture, a storage
// of at most min_move_bytes whose producer does not recompute it is only counted, in the
// micro-batch's light set (blocks of four times min_move_bytes, or the light grain if smaller),
// and stays as it is. False with the error set.
bool CountSmall(HooksObject* h, const Saved& s, PyObject* key, PyObject* unit, PyObject* scope,
                long long min_move) {
  PyObject* tr = h->tracker;
  PyObject* sets = Get(tr, names.light_sets);
  if (sets == nullptr) return false;
  PyObject* ls = PyDict_GetItemWithError(sets, unit);  // borrowed
  Py_XINCREF(ls);
  Py_DECREF(sets);
  if (ls == nullptr) {
    if (PyErr_Occurred()) return false;
    long long grain = 0;
    PyObject* store = GetInt(tr, names.light_grain, &grain) ? Get(tr, names.store) : nullptr;
    if (store == nullptr) return false;
    PyObject* size = PyLong_FromLongLong(std::min(grain, 4 * min_move));
    ls = size == nullptr ? nullptr
                         : PyObject_CallMethodObjArgs(store, names.light_set, unit, size, nullptr);
    Py_XDECREF(size);
    Py_DECREF(store);
    if (ls == nullptr) return false;
  }
  const int inside = InsideLayers(tr, scope, key, s.st->unsafeGetStorageImpl());
  PyObject* storage = inside < 0 ? nullptr : THPStorage_Wrap(*s.st);
  bool ok = storage != nullptr && CountLight(ls, storage, key, s.nbytes, inside == 1);
  Py_XDECREF(storage);
  Py_DECREF(ls);
  if (!ok) return false;
  PyObject* counters = Get(tr, names.counters);
  ok = counters != nullptr && detail::AddTo(counters, names.small_kept, 1);
  Py_XDECREF(counters);
  return ok;
}

// Whether the tensor is a view of a tensor subclass (a parameter, FSDP2's unsharded ones):
// discovery/sharding.py decides those.
bool ViewOfSubclass(const at::Tensor& x) {
  if (!x.is_view()) return false;
  const at::TensorBase& base = x._base();
  if (!base.defined()) return false;
  PyObject* b = THPVariable_Wrap(base);
  if (b == nullptr) {
    PyErr_Clear();
    return true;
  }
  const bool sub = Py_TYPE(b) != reinterpret_cast<PyTypeObject*>(THPVariableClass);
  Py_DECREF(b);
  return sub;
}

// The branch a new record takes here: keep, offload at once, or Python for the rest.
enum class NewPath { kKeep, kOffload, kFp8, kPython };

NewPath PathOf(HooksObject* h, PyObject* strategy, long long mb, at::ScalarType dtype,
               bool* error) {
  *error = false;
  const int keep = PyObject_RichCompareBool(strategy, constants.keep, Py_EQ);
  if (keep < 0) {
    *error = true;
    return NewPath::kPython;
  }
  if (keep) return NewPath::kKeep;
  if (!h->sync_offloads || h->fast == nullptr) return NewPath::kPython;
  const int offload = PyObject_RichCompareBool(strategy, constants.offload, Py_EQ);
  if (offload < 0) {
    *error = true;
    return NewPath::kPython;
  }
  if (offload == 0) {  // FP8 at once where the enforcer can cast the dtype (fp8_supported)
    const int fp8 = PyObject_RichCompareBool(strategy, constants.fp8, Py_EQ);
    *error = fp8 < 0;
    const bool castable = dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16;
    return fp8 > 0 && castable ? NewPath::kFp8 : NewPath::kPython;
  }
  PyObject* scheduled = Get(h->tracker, names.scheduled);
  PyObject* unit = scheduled == nullptr ? nullptr : PyLong_FromLongLong(mb);
  const int left = unit == nullptr ? -1 : PySet_Contains(scheduled, unit);
  Py_XDECREF(scheduled);
  Py_XDECREF(unit);
  *error = left < 0;
  return left == 0 ? NewPath::kOffload : NewPath::kPython;
}

// Light capture (an all-keep micro-batch: storages only counted): a storage counted before in
// this forward stays as it is here (marked as saved outside the layers when the operator saving
// it now is outside them); a new or reused pointer is the tracker's (_pack_py: counted).
PyObject* PackLight(HooksObject* h, PyObject* t, const at::Tensor& x, PyObject* light) {
  if (!PyDict_Check(light)) return PackInPython(h, t);
  const c10::Storage& st = x.storage();
  PyObject* key =
      PyLong_FromLongLong(static_cast<long long>(reinterpret_cast<uintptr_t>(st.data())));
  if (key == nullptr) return nullptr;
  PyObject* seen = PyDict_GetItemWithError(light, key);  // borrowed
  if (seen == nullptr || !PyTuple_Check(seen) || PyTuple_GET_SIZE(seen) != 2 ||
      !RefersTo(PyTuple_GET_ITEM(seen, 0), st.unsafeGetStorageImpl())) {
    Py_DECREF(key);
    return PyErr_Occurred() ? nullptr : PackInPython(h, t);
  }
  const long long n = PyLong_AsLongLong(PyTuple_GET_ITEM(seen, 1));
  bool ok = !(n == -1 && PyErr_Occurred());
  if (ok && n > 0) {  // counted inside the layers so far
    PyObject* scope = Get(h->tracker, names.scope);
    ok = scope != nullptr;
    bool outside = true;
    if (ok && PyList_Check(scope) && PyList_GET_SIZE(scope) > 0) {
      long long layer = 0;
      ok = GetInt(PyList_GET_ITEM(scope, PyList_GET_SIZE(scope) - 1), names.layer, &layer);
      outside = layer < 0;
    }
    Py_XDECREF(scope);
    if (ok && outside) {
      PyObject* marked = Py_BuildValue("(OL)", PyTuple_GET_ITEM(seen, 0), -n);
      ok = marked != nullptr && PyDict_SetItem(light, key, marked) == 0;
      Py_XDECREF(marked);
    }
  }
  Py_DECREF(key);
  if (!ok) return nullptr;
  Py_INCREF(t);
  return t;
}

// What the pack below is given for ``t``, a new reference: ``t`` itself, or, where ``t`` is an
// output of the node saving it now (its grad_fn is the node this thread made last: autograd saves
// an operator's outputs after making its node), its data without that history. Kept with its
// history, the saved output would hold its own node (node -> saved variable -> what the pack
// gave -> tensor -> node), a cycle through autograd's C++ objects the collector cannot see: a
// graph whose backward never runs to the end (training stopped by an error, a forward never
// backwarded) would then keep every record, the enforcer and its blocks forever (issue 45).
// PyTorch without hooks saves such outputs as their tensor_data for the same reason.
PyObject* WithoutOwnNode(PyObject* t) {
  if (THPVariable_Check(t)) {
    const at::Tensor& x = THPVariable_Unpack(t);
    const auto* meta = torch::autograd::impl::get_autograd_meta(x);  // no view regeneration
    const torch::autograd::Node* fn = meta == nullptr ? nullptr : meta->grad_fn_.get();
    if (fn != nullptr && fn->sequence_nr() + 1 == at::sequence_number::peek()) {
      try {
        return THPVariable_Wrap(x.tensor_data());  // shares the storage and version counter
      } catch (const std::exception& e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
      }
    }
  }
  Py_INCREF(t);
  return t;
}

PyObject* PackTensor(PyObject* self, PyObject* t);

PyObject* Pack(PyObject* self, PyObject* t) {
  PyObject* saved = WithoutOwnNode(t);
  if (saved == nullptr) return nullptr;
  PyObject* out = PackTensor(self, saved);
  Py_DECREF(saved);
  return out;
}

PyObject* PackTensor(PyObject* self, PyObject* t) {
  auto* h = reinterpret_cast<HooksObject*>(self);
  PyObject* tr = h->tracker;
  // Tensor subclasses (parameters, DTensor, wrappers) and light capture: Python.
  if (Py_TYPE(t) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) return PackInPython(h, t);
  const at::Tensor& x = THPVariable_Unpack(t);
  if (x.is_sparse() || !x.has_storage() || ViewOfSubclass(x)) return PackInPython(h, t);
  PyObject* light = Get(tr, names.light);
  if (light == nullptr) return nullptr;
  if (light != Py_None) {
    PyObject* out = PackLight(h, t, x, light);
    Py_DECREF(light);
    return out;
  }
  Py_DECREF(light);
  long long mb = 0, seen = 0;
  if (!GetInt(tr, names.micro_batch, &mb) || !GetInt(tr, names.packs_seen, &seen)) return nullptr;
  if (mb < 0 || x.numel() == 0) {  // kept as it is, counted as a pack
    if (!SetInt(tr, names.packs_seen, seen + 1)) return nullptr;
    Py_INCREF(t);
    return t;
  }
  const c10::Storage& st = x.storage();
  c10::StorageImpl* impl = st.unsafeGetStorageImpl();
  const Saved s{t,
                &x,
                &st,
                static_cast<long long>(reinterpret_cast<uintptr_t>(st.data())),
                static_cast<long long>(st.nbytes()),
                mb};
  PyObject* key = PyLong_FromLongLong(s.key);
  PyObject* unit = PyLong_FromLongLong(mb);
  PyObject* param_keys = key == nullptr || unit == nullptr ? nullptr : Get(tr, names.param_keys);
  PyObject* out = nullptr;
  PyObject* op = nullptr;
  PyObject* rec = nullptr;
  PyObject* scope = nullptr;
  PyObject* live = nullptr;
  int hit = 0;
  if (param_keys == nullptr) goto done;
  hit = PySet_Contains(param_keys, key);
  if (hit == 0) hit = LightHolds(tr, unit, key, impl);
  if (hit < 0) goto done;
  if (hit > 0) {  // a parameter's storage, or counted in the light set: it stays as it is
    if (SetInt(tr, names.packs_seen, seen + 1)) {
      Py_INCREF(t);
      out = t;
    }
    goto done;
  }
  scope = Get(tr, names.scope);
  if (scope == nullptr) goto done;
  op = PyList_Check(scope) && PyList_GET_SIZE(scope) > 0
           ? PyList_GET_ITEM(scope, PyList_GET_SIZE(scope) - 1)
           : constants.outside;
  Py_INCREF(op);
  live = Get(tr, names.live);
  if (live == nullptr) goto done;
  rec = PyDict_GetItemWithError(live, key);  // borrowed
  if (rec == nullptr && PyErr_Occurred()) goto done;
  if (rec != nullptr && PyObject_TypeCheck(rec, detail::record_base) &&
      SameStorage(reinterpret_cast<RecordObject*>(rec), impl) &&
      reinterpret_cast<RecordObject*>(rec)->micro_batch == mb) {
    // Another tensor of a storage packed before in this forward.
    PyObject* unkeyed = Get(tr, names.unkeyed);
    if (unkeyed == nullptr) goto done;
    const bool pending = PyDict_Check(unkeyed) && PyDict_GET_SIZE(unkeyed) > 0;
    Py_DECREF(unkeyed);
    if (pending) {  // a recompute call may drop it now (Mover.drop_found)
      rec = nullptr;
      out = PackInPython(h, t);
      goto done;
    }
    Py_INCREF(rec);
  } else {
    // A new record: here when its producer keeps it or offloads it at once, outside the
    // capture, and it is larger than the storages that are only counted.
    rec = nullptr;
    PyObject* capture = Get(tr, names.capture);
    if (capture == nullptr) goto done;
    const int capturing = PyObject_IsTrue(capture);
    Py_DECREF(capture);
    long long min_move = 0;
    if (capturing < 0 || !GetInt(tr, names.min_move_bytes, &min_move)) goto done;
    if (capturing) {
      out = PackInPython(h, t);
      goto done;
    }
    PyObject* producer = ProducerOf(h, key, impl, op);
    if (producer == nullptr) goto done;
    PyObject* strategy = StrategyOf(tr, producer, unit);
    if (strategy == nullptr) {
      Py_DECREF(producer);
      goto done;
    }
    if (s.nbytes <= min_move) {  // a small storage: counted, unless its producer recomputes it
      const int moves = PyObject_RichCompareBool(strategy, constants.keep, Py_EQ) == 1 ||
                        PyObject_RichCompareBool(strategy, constants.offload, Py_EQ) == 1 ||
                        PyObject_RichCompareBool(strategy, constants.fp8, Py_EQ) == 1;
      Py_DECREF(strategy);
      Py_DECREF(producer);
      if (PyErr_Occurred()) goto done;
      if (!moves) {  // recompute: its call drops and regenerates it through a record
        out = PackInPython(h, t);
        goto done;
      }
      if (SetInt(tr, names.packs_seen, seen + 1) && CountSmall(h, s, key, unit, scope, min_move)) {
        Py_INCREF(t);
        out = t;
      }
      goto done;
    }
    bool error = false;
    const NewPath path = PathOf(h, strategy, mb, x.scalar_type(), &error);
    Py_DECREF(strategy);
    if (error || path == NewPath::kPython) {
      Py_DECREF(producer);
      if (!error) out = PackInPython(h, t);
      goto done;
    }
    rec = NewRecord(h, s, producer, op, path == NewPath::kKeep);
    Py_DECREF(producer);
    if (rec == nullptr) goto done;
    if (path != NewPath::kKeep &&
        !MoveAtOnce(h, reinterpret_cast<RecordObject*>(rec), path == NewPath::kFp8)) {
      goto done;
    }
  }
  // From here the pack is this one's: counted, its consumer noted, the tensor packed.
  if (!SetInt(tr, names.packs_seen, seen + 1)) goto done;
  {
    auto* r = reinterpret_cast<RecordObject*>(rec);
    const int known = r->consumers != nullptr && PyList_Check(r->consumers)
                          ? PySequence_Contains(r->consumers, op)
                          : 0;
    if (known < 0) goto done;
    if (known == 0) {
      PyObject* res = PyObject_CallMethodObjArgs(tr, names.add_consumer, rec, op, nullptr);
      if (res == nullptr) goto done;
      Py_DECREF(res);
    }
  }
  out = detail::NewPacked(rec, t);
done:
  Py_XDECREF(rec);
  Py_XDECREF(live);
  Py_XDECREF(op);
  Py_XDECREF(scope);
  Py_XDECREF(param_keys);
  Py_XDECREF(key);
  Py_XDECREF(unit);
  return out;
}

// Tracker.note_output: `op` (with its recompute call) produced every tensor in `out` (tensors,
// tuples, lists and dict values, nested); a known producer stays unless `overwrite`.
bool NoteOutput(HooksObject* h, PyObject* producers, PyObject* out, PyObject* entry, bool overwrite,
                int depth) {
  if (depth > 64) return true;  // as deep as any module's outputs go
  if (THPVariable_Check(out)) {
    const at::Tensor& x = THPVariable_Unpack(out);
    if (x.numel() <= 0) return true;
    PyObject* st = nullptr;
    if (Py_TYPE(out) == reinterpret_cast<PyTypeObject*>(THPVariableClass) && x.has_storage()) {
      st = THPStorage_Wrap(x.storage());
    } else {  // a subclass: its own untyped_storage (as the Python did)
      st = PyObject_CallMethod(out, "untyped_storage", nullptr);
    }
    if (st == nullptr) return false;
    if (!THPStorage_Check(st)) {
      Py_DECREF(st);
      return true;
    }
    const c10::Storage& storage = THPStorage_Unpack(st);
    PyObject* key =
        PyLong_FromLongLong(static_cast<long long>(reinterpret_cast<uintptr_t>(storage.data())));
    bool ok = key != nullptr;
    if (ok && !overwrite) {
      PyObject* hit = PyDict_GetItemWithError(producers, key);  // borrowed
      if (hit != nullptr && PyTuple_Check(hit) && PyTuple_GET_SIZE(hit) >= 1 &&
          RefersTo(PyTuple_GET_ITEM(hit, 0), storage.unsafeGetStorageImpl())) {
        Py_DECREF(key);
        Py_DECREF(st);
        return true;
      }
      ok = !PyErr_Occurred();
    }
    PyObject* ref = ok ? PyWeakref_NewRef(st, nullptr) : nullptr;
    PyObject* value = ref == nullptr ? nullptr
                                     : PyTuple_Pack(3, ref, PyTuple_GET_ITEM(entry, 0),
                                                    PyTuple_GET_ITEM(entry, 1));
    ok = value != nullptr && PyDict_SetItem(producers, key, value) == 0;
    Py_XDECREF(value);
    Py_XDECREF(ref);
    Py_XDECREF(key);
    Py_DECREF(st);
    return ok;
  }
  if (PyTuple_Check(out) || PyList_Check(out)) {
    PyObject* seq = PySequence_Fast(out, "outputs");
    if (seq == nullptr) return false;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    bool ok = true;
    for (Py_ssize_t i = 0; ok && i < n; ++i) {
      ok = NoteOutput(h, producers, PySequence_Fast_GET_ITEM(seq, i), entry, overwrite, depth + 1);
    }
    Py_DECREF(seq);
    return ok;
  }
  if (PyDict_Check(out)) {
    PyObject* values = PyDict_Values(out);
    if (values == nullptr) return false;
    bool ok = NoteOutput(h, producers, values, entry, overwrite, depth + 1);
    Py_DECREF(values);
    return ok;
  }
  return true;
}

// note_output(out, op, overwrite, call)
PyObject* HooksNoteOutput(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  auto* h = reinterpret_cast<HooksObject*>(self);
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "note_output(out, op, overwrite, call): 4 arguments");
    return nullptr;
  }
  const int overwrite = PyObject_IsTrue(args[2]);
  if (overwrite < 0) return nullptr;
  PyObject* producers = Get(h->tracker, names.producers);
  if (producers == nullptr) return nullptr;
  PyObject* entry = PyTuple_Pack(2, args[1], args[3]);
  const bool ok = entry != nullptr && PyDict_Check(producers) &&
                  NoteOutput(h, producers, args[0], entry, overwrite != 0, 0);
  Py_XDECREF(entry);
  Py_DECREF(producers);
  if (!ok) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "note_output: producers is no dict");
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyTypeObject* packed = nullptr;

PyObject* HooksUnpack(PyObject*, PyObject* p) {
  if (Py_TYPE(p) == packed) return detail::UnpackPacked(p);
  Py_INCREF(p);
  return p;
}

PyMethodDef hooks_methods[] = {
    {"pack", Pack, METH_O, "The pack hook: a tensor saved for backward -> what autograd keeps."},
    {"unpack", HooksUnpack, METH_O, "The unpack hook: what pack gave -> the saved tensor."},
    {"note_output", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(HooksNoteOutput)),
     METH_FASTCALL,
     "note_output(out, op, overwrite, call): op (and its recompute call) produced out's "
     "tensors."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

PyObject* LightCount(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5 || !PyLong_Check(args[2]) || !PyLong_Check(args[3])) {
    PyErr_SetString(PyExc_TypeError,
                    "light_count(light_set, storage, key: int, nbytes: int, inside: bool)");
    return nullptr;
  }
  const long long nbytes = PyLong_AsLongLong(args[3]);
  const int inside = PyObject_IsTrue(args[4]);
  if ((nbytes == -1 && PyErr_Occurred()) || inside < 0) return nullptr;
  if (!CountLight(args[0], args[1], args[2], nbytes, inside == 1)) return nullptr;
  Py_RETURN_NONE;
}

bool AddSavedTypes(PyObject* module) {
  if (!detail::InternNames() || !detail::AddRecordType(module) ||
      !detail::AddPackedType(module, &packed)) {
    return false;
  }
  PyType_Slot slots[] = {
      {Py_tp_doc, const_cast<char*>("Hooks(tracker, Record, constants, pool): the saved-tensor "
                                    "hooks over one tracker.")},
      {Py_tp_new, reinterpret_cast<void*>(PyType_GenericNew)},
      {Py_tp_init, reinterpret_cast<void*>(HooksInit)},
      {Py_tp_methods, hooks_methods},
      {Py_tp_traverse, reinterpret_cast<void*>(HooksTraverse)},
      {Py_tp_clear, reinterpret_cast<void*>(HooksClear)},
      {Py_tp_dealloc, reinterpret_cast<void*>(HooksDealloc)},
      {0, nullptr}};
  PyType_Spec spec = {"bagualu._C.Hooks", sizeof(HooksObject), 0,
                      Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, slots};
  PyObject* type = PyType_FromSpec(&spec);
  if (type == nullptr) return false;
  if (PyModule_AddObject(module, "Hooks", type) < 0) {
    Py_DECREF(type);
    return false;
  }
  return true;
}

}  // namespace bgl::torch_ext
