// Packed: what autograd keeps per saved tensor. Its unpack gives the tensor back (reloading an
// offloaded record here, the rest through record.py's materialize); its death releases the record
// when it was the last holder (here for records no copy still reads, else record.py's release).
#include <ATen/ops/empty.h>
#include <Python.h>
#include <structmember.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstddef>
#include <cstdint>

#include "blocks.h"
#include "calls.h"
#include "cursor.h"
#include "detail/saved_types.h"

namespace bgl::torch_ext::detail {
namespace {

struct PackedObject {
  PyObject_HEAD PyObject* rec;  // a RecordBase
  PyObject* t;                  // the tensor while the record's data is on the device
  ViewMeta* meta;               // else how to rebuild the view
  PyObject* weakreflist;
};

PyTypeObject* packed_type = nullptr;

ViewMeta* MakeMeta(const at::Tensor& t) {
  auto* m = new ViewMeta;
  m->offset = t.storage_offset();
  m->sizes = t.sizes().vec();
  m->strides = t.strides().vec();
  m->options = at::TensorOptions().dtype(t.scalar_type()).device(t.device());
  m->conj = t.is_conj();
  m->neg = t.is_neg();
  return m;
}

bool OnDevice(RecordObject* r) { return r->storage != nullptr && r->storage != Py_None; }

// --- a block's end -----------------------------------------------------------------------------
// The callable a reloaded or uncast block's storage runs when torch frees it (blocks.cc RunDone),
// without a Python frame: the one definition of a block's end, for this file's reloads and for
// enforce/enforcer.py's acquire (the Python path's, through block_done()).
struct BlockDoneObject {
  PyObject_HEAD PyObject* rec;  // the RecordBase whose block it is, or nullptr (none)
  PyObject* enforcer;           // its Enforcer (Python): live_blocks, destroyed, closing
  PyObject* fast;               // that enforcer's _C.Enforcer
  unsigned long long handle;    // the enforcer's handle of the tensor
  bool cuda;
};
PyTypeObject* block_done_type = nullptr;

bool Retire(PyObject* enf, PyObject* fast, RecordObject* r);

// PyTorch let go of the enforcer's block; 1 when that retired the record, 0 when the record
// still holds the tensor (or the block has no record: its caller retires the handle), -1 with the
// error set.
int BlockDied(BlockDoneObject* d, RecordObject* r) {
  if (r == nullptr) return 0;
  r->live_block = 0;
  if (!r->released || r->enf == 0) return 0;
  return Retire(d->enforcer, d->fast, r) ? 1 : -1;
}

PyObject* BlockDoneCall(PyObject* self, PyObject*, PyObject*) {
  auto* d = reinterpret_cast<BlockDoneObject*>(self);
  auto* r = reinterpret_cast<RecordObject*>(d->rec);
  PyObject* enf = d->enforcer;
  EnforcerLife* life = LifeOf(d->fast);
  life->live_blocks -= 1;
  if (life->destroyed) {
    if (BlockDied(d, r) < 0) return nullptr;
  } else if (d->cuda) {  // the pool learns PyTorch's stream before the block goes
    PyObject* s = PyObject_CallMethodNoArgs(enf, names.current_stream);
    if (s == nullptr) return nullptr;
    void* stream = s == Py_None ? nullptr : PyLong_AsVoidPtr(s);
    Py_DECREF(s);
    if (PyErr_Occurred()) return nullptr;
    ReleaseBlock(d->fast, d->handle, stream);
    if (BlockDied(d, r) < 0) return nullptr;
  } else {
    const int retired = BlockDied(d, r);
    if (retired < 0) return nullptr;
    if (retired == 0) ReleaseBlock(d->fast, d->handle, nullptr);  // the record still holds it
  }
  if (life->closing) return PyObject_CallMethodNoArgs(enf, names.destroy_if_done);
  Py_RETURN_NONE;
}

int BlockDoneTraverse(PyObject* self, visitproc visit, void* arg) {
  auto* d = reinterpret_cast<BlockDoneObject*>(self);
  Py_VISIT(Py_TYPE(self));
  Py_VISIT(d->rec);
  Py_VISIT(d->enforcer);
  Py_VISIT(d->fast);
  return 0;
}

int BlockDoneClear(PyObject* self) {
  auto* d = reinterpret_cast<BlockDoneObject*>(self);
  Py_CLEAR(d->rec);
  Py_CLEAR(d->enforcer);
  Py_CLEAR(d->fast);
  return 0;
}

void BlockDoneDealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  BlockDoneClear(self);
  PyTypeObject* type = Py_TYPE(self);
  type->tp_free(self);
  Py_DECREF(type);
}

// A new BlockDone over `rec` (a RecordBase, or nullptr), the Python Enforcer `enf` and its
// _C.Enforcer `fast`; nullptr with the error set.
PyObject* NewBlockDone(PyObject* rec, PyObject* enf, PyObject* fast, uint64_t handle, bool cuda) {
  auto* d = reinterpret_cast<BlockDoneObject*>(block_done_type->tp_alloc(block_done_type, 0));
  if (d == nullptr) return nullptr;
  Py_XINCREF(rec);
  d->rec = rec;
  Py_INCREF(enf);
  d->enforcer = enf;
  Py_INCREF(fast);
  d->fast = fast;
  d->handle = static_cast<unsigned long long>(handle);
  d->cuda = cuda;
  return reinterpret_cast<PyObject*>(d);
}

// --- accounting --------------------------------------------------------------------------------
// Record._unaccount: the record's device block goes back (the enforcer frees its own blocks).
bool Unaccount(HooksObject* h, RecordObject* r) {
  if (r->enf_block) {
    r->pool_bytes = 0;
    r->enf_block = 0;
    return true;
  }
  if (r->pool_block == 0) return true;
  if (h != nullptr && h->pool != nullptr) {
    PoolFreeRaw(h->pool, r->pool_block, r->pool_bytes);
  } else {
    PyObject* out =
        PyObject_CallMethod(r->tracker, "device_free", "LL", r->pool_block, r->pool_bytes);
    if (out == nullptr) return false;
    Py_DECREF(out);
  }
  r->pool_block = 0;
  r->pool_bytes = 0;
  return true;
}

// Enforcer.retire(handle) of enforce/enforcer.py, for a record no block of is alive: `enf` is the
// record's Enforcer, `fast` its _C.Enforcer.
bool Retire(PyObject* enf, PyObject* fast, RecordObject* r) {
  if (r->enf == 0) return true;
  const auto handle = static_cast<uint64_t>(r->enf);
  r->enf = 0;
  PyObject* regen = Get(enf, names.regenerators);
  if (regen == nullptr) return false;
  if (PyDict_GET_SIZE(regen) > 0) {
    PyObject* k = PyLong_FromUnsignedLongLong(handle);
    if (k == nullptr || (PyDict_DelItem(regen, k) < 0 && !PyErr_ExceptionMatches(PyExc_KeyError))) {
      Py_XDECREF(k);
      Py_DECREF(regen);
      return false;
    }
    PyErr_Clear();
    Py_DECREF(k);
  }
  Py_DECREF(regen);
  EnforcerLife* life = LifeOf(fast);
  if (life->destroyed) return true;
  Unregister(fast, handle);
  life->tracked -= 1;
  if (life->closing) {
    PyObject* out = PyObject_CallMethodNoArgs(enf, names.destroy_if_done);
    if (out == nullptr) return false;
    Py_DECREF(out);
  }
  return true;
}

// RecordStore.retire (capture/store.py): the record leaves the live records of its storage and
// its unit.
bool Forget(RecordObject* r) {
  PyObject* rec = reinterpret_cast<PyObject*>(r);
  PyObject* live = Get(r->tracker, names.live);
  PyObject* by_mb = live == nullptr ? nullptr : Get(r->tracker, names.by_mb);
  PyObject* key = by_mb == nullptr ? nullptr : PyLong_FromLongLong(r->ptr);
  PyObject* unit = key == nullptr ? nullptr : PyLong_FromLongLong(r->micro_batch);
  bool ok = unit != nullptr;
  if (ok) {
    PyObject* found = PyDict_GetItemWithError(live, key);  // borrowed
    if (found == rec) ok = PyDict_DelItem(live, key) == 0;
    ok = ok && !PyErr_Occurred();
  }
  if (ok) {
    PyObject* recs = PyDict_GetItemWithError(by_mb, unit);  // borrowed
    if (recs != nullptr && PySet_Check(recs)) ok = PySet_Discard(recs, rec) >= 0;
    ok = ok && !PyErr_Occurred();
  }
  Py_XDECREF(live);
  Py_XDECREF(by_mb);
  Py_XDECREF(key);
  Py_XDECREF(unit);
  return ok;
}

// Record.release for a record no copy still reads and no issue order holds; false with no error
// set when record.py must release it.
bool ReleaseHere(RecordObject* r, bool* done) {
  *done = false;
  if (r->tracker == nullptr) return true;
  bool planned = false, issued = false;  // issued is planned too
  if (!OffloadOf(r, &planned, &issued)) return false;
  if (planned) return true;
  HooksObject* h = HooksOf(r);
  if (h == nullptr || (r->enf != 0 && !r->live_block && h->fast == nullptr)) return true;
  *done = true;
  if (!Unaccount(h, r)) return false;
  // Released before the storage goes: a reloaded block that dies with it retires the record in
  // its end (BlockDoneCall), with no release of the block to the enforcer first.
  r->released = 1;
  Py_CLEAR(r->storage);
  Py_CLEAR(r->regen);
  Py_CLEAR(r->packs);
  if (!r->live_block && !Retire(h->enforcer, h->fast, r)) return false;
  return Forget(r);
}

// --- reload ------------------------------------------------------------------------------------
// Record.materialize of an offloaded or FP8 record: the enforcer reloads or uncasts it into a
// block of its own, which becomes the record's storage. A new reference, or nullptr with *done
// false and no error when record.py must do it (another placement, no binding, a failed acquire to
// retry there).
PyObject* ReloadHere(RecordObject* r, bool* done) {
  *done = false;
  Placement where = Placement::kDevice;
  if (r->enf == 0 || r->tracker == nullptr || !PlacementOf(r, &where)) {
    PyErr_Clear();  // record.py's materialize names what is wrong
    return nullptr;
  }
  const bool fp8 = where == Placement::kFp8;
  if (where != Placement::kHost && !fp8) return nullptr;
  HooksObject* h = HooksOf(r);
  if (h == nullptr || h->fast == nullptr) return nullptr;
  PyObject* enf = h->enforcer;
  EnforcerLife* life = LifeOf(h->fast);
  if (life->destroyed) return nullptr;  // record.py raises the error naming it
  void* stream = nullptr;
  if (h->enforcer_cuda) {
    PyObject* s = PyObject_CallMethodNoArgs(enf, names.current_stream);
    if (s == nullptr) return nullptr;
    stream = s == Py_None ? nullptr : PyLong_AsVoidPtr(s);
    Py_DECREF(s);
  }
  void* ptr = nullptr;
  if (Acquire(h->fast, static_cast<uint64_t>(r->enf), stream, &ptr) != 0) return nullptr;
  *done = true;
  life->live_blocks += 1;
  PyObject* d = NewBlockDone(reinterpret_cast<PyObject*>(r), enf, h->fast,
                             static_cast<uint64_t>(r->enf), h->enforcer_cuda);
  if (d == nullptr) return nullptr;
  PyObject* storage = MakeBlockStorage(ptr, r->nbytes, h->enforcer_cuda, h->device_index, d);
  Py_DECREF(d);
  if (storage == nullptr) return nullptr;
  Py_INCREF(storage);
  Py_XSETREF(r->storage, storage);
  r->live_block = 1;
  // Record._enforcer_bytes: the pool counts the enforcer's block (the simulated device), else
  // the record accounts it.
  if (h->pool != nullptr) {
    if (!Unaccount(h, r)) {
      Py_DECREF(storage);
      return nullptr;
    }
    r->pool_bytes = r->nbytes;
    r->enf_block = 1;
  } else {
    PyObject* out = PyObject_CallMethod(reinterpret_cast<PyObject*>(r), "_account", "L", r->nbytes);
    if (out == nullptr) {
      Py_DECREF(storage);
      return nullptr;
    }
    Py_DECREF(out);
  }
  if (h->reload_ahead && !fp8) {
    PyObject* out = PyObject_CallMethod(r->tracker, "acquired", "L", r->micro_batch);
    if (out == nullptr) {
      Py_DECREF(storage);
      return nullptr;
    }
    Py_DECREF(out);
  }
  PyObject* counters = Get(r->tracker, names.counters);
  const bool counted =
      counters != nullptr &&
      (fp8 ? AddTo(counters, names.fp8_uncasts, 1)
           : AddTo(counters, names.reloads, 1) && AddTo(counters, names.bytes_h2d, r->nbytes));
  Py_XDECREF(counters);
  if (!counted) {
    Py_DECREF(storage);
    return nullptr;
  }
  return storage;  // the record holds its storage again: on the device
}

// --- Packed ------------------------------------------------------------------------------------
PyObject* PackedNew(PyTypeObject*, PyObject* args, PyObject* kwargs) {
  PyObject *rec = nullptr, *t = nullptr;
  static const char* kw[] = {"rec", "t", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO:Packed", const_cast<char**>(kw), &rec, &t)) {
    return nullptr;
  }
  if (!PyObject_TypeCheck(rec, record_base)) {
    PyErr_SetString(PyExc_TypeError, "Packed(rec, t): rec must be a record");
    return nullptr;
  }
  if (!THPVariable_Check(t)) {
    PyErr_SetString(PyExc_TypeError, "Packed(rec, t): t must be a tensor");
    return nullptr;
  }
  return NewPacked(rec, t);
}

int PackedTraverse(PyObject* self, visitproc visit, void* arg) {
  auto* p = reinterpret_cast<PackedObject*>(self);
  Py_VISIT(Py_TYPE(self));
  Py_VISIT(p->rec);
  Py_VISIT(p->t);
  return 0;
}

int PackedClear(PyObject* self) {
  auto* p = reinterpret_cast<PackedObject*>(self);
  Py_CLEAR(p->t);
  Py_CLEAR(p->rec);
  return 0;
}

void PackedDealloc(PyObject* self) {
  auto* p = reinterpret_cast<PackedObject*>(self);
  PyObject_GC_UnTrack(self);
  if (p->weakreflist != nullptr) PyObject_ClearWeakRefs(self);
  if (p->rec != nullptr) {
    auto* r = reinterpret_cast<RecordObject*>(p->rec);
    r->refs -= 1;
    if (r->refs == 0) {  // the last holder: the record is released
      PyObject *type, *value, *tb;
      PyErr_Fetch(&type, &value, &tb);
      bool done = false;
      if (!ReleaseHere(r, &done) || !done) {
        PyObject* out =
            PyErr_Occurred() ? nullptr : PyObject_CallMethodNoArgs(p->rec, names.release);
        if (out == nullptr) {
          PyErr_WriteUnraisable(p->rec);
        } else {
          Py_DECREF(out);
        }
      }
      PyErr_Restore(type, value, tb);
    }
  }
  PackedClear(self);
  delete p->meta;
  p->meta = nullptr;
  PyTypeObject* type = Py_TYPE(self);
  type->tp_free(self);
  Py_DECREF(type);
}

// The record's data leaves the device: keep only how to rebuild the view.
PyObject* PackedDetach(PyObject* self, PyObject*) {
  auto* p = reinterpret_cast<PackedObject*>(self);
  if (p->t != nullptr) {
    if (p->meta == nullptr) p->meta = MakeMeta(THPVariable_Unpack(p->t));
    Py_CLEAR(p->t);
  }
  Py_RETURN_NONE;
}

// The plan's issue order learns that the backward reached the record's producer (the tracker's
// issuer: enforce/order.py's PointIssuer, an IssueCursor, or None).
bool NoteBackward(RecordObject* r) {
  if (r->tracker == nullptr) return true;
  PyObject* issuer = Get(r->tracker, names.issuer);
  if (issuer == nullptr) return false;
  bool ok = true;
  if (IsIssueCursor(issuer)) {
    ok = CursorBackward(issuer, r->micro_batch, r->producer);
  } else if (issuer != Py_None) {
    PyErr_Format(PyExc_TypeError, "bagualu: the tracker's issuer is a %s, not a PointIssuer",
                 Py_TYPE(issuer)->tp_name);
    ok = false;
  }
  Py_DECREF(issuer);
  return ok;
}

PyObject* Unpack(PackedObject* p) {
  auto* r = reinterpret_cast<RecordObject*>(p->rec);
  r->in_backward = 1;
  if (!NoteBackward(r)) return nullptr;
  if (p->t != nullptr) {
    Py_INCREF(p->t);
    return p->t;
  }
  bool done = false;
  PyObject* storage = ReloadHere(r, &done);
  if (storage == nullptr) {
    if (done || PyErr_Occurred()) return nullptr;
    storage = PyObject_CallMethodNoArgs(p->rec, names.materialize);
    if (storage == nullptr) return nullptr;
  }
  if (!THPStorage_Check(storage) || p->meta == nullptr) {
    Py_DECREF(storage);
    PyErr_SetString(PyExc_RuntimeError, "bagualu: a moved record gave no storage back");
    return nullptr;
  }
  PyObject* out = nullptr;
  try {
    const ViewMeta& m = *p->meta;
    at::Tensor t = at::empty({0}, m.options);
    t.set_(THPStorage_Unpack(storage), m.offset, m.sizes, m.strides);
    if (m.conj) t = t._conj();
    if (m.neg) t = t._neg_view();
    out = THPVariable_Wrap(std::move(t));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  Py_DECREF(storage);
  return out;
}

PyObject* PackedUnpack(PyObject* self, PyObject*) {
  return Unpack(reinterpret_cast<PackedObject*>(self));
}

PyMethodDef packed_methods[] = {
    {"unpack", PackedUnpack, METH_NOARGS, "The saved tensor, its data back on the device."},
    {"detach_tensor", PackedDetach, METH_NOARGS,
     "The record's data leaves the device: keep only how to rebuild the view."},
    {nullptr, nullptr, 0, nullptr}};

PyMemberDef packed_members[] = {
    {"rec", T_OBJECT, offsetof(PackedObject, rec), READONLY, "the record"},
    {"t", T_OBJECT, offsetof(PackedObject, t), READONLY, "the tensor while on the device"},
    {"__weaklistoffset__", T_PYSSIZET, offsetof(PackedObject, weakreflist), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr}};

}  // namespace

PyObject* NewPacked(PyObject* rec, PyObject* t) {
  auto* p = reinterpret_cast<PackedObject*>(packed_type->tp_alloc(packed_type, 0));
  if (p == nullptr) return nullptr;
  auto* r = reinterpret_cast<RecordObject*>(rec);
  Py_INCREF(rec);
  p->rec = rec;
  r->refs += 1;
  if (OnDevice(r)) {
    PyObject* w = PyWeakref_NewRef(reinterpret_cast<PyObject*>(p), nullptr);
    if (w == nullptr) {
      Py_DECREF(p);
      return nullptr;
    }
    if (r->packs == nullptr || r->packs == Py_None) {
      PyObject* list = PyList_New(1);
      if (list == nullptr) {
        Py_DECREF(w);
        Py_DECREF(p);
        return nullptr;
      }
      PyList_SET_ITEM(list, 0, w);  // steals w
      Py_XSETREF(r->packs, list);
    } else {
      const int rc = PyList_Append(r->packs, w);
      Py_DECREF(w);
      if (rc < 0) {
        Py_DECREF(p);
        return nullptr;
      }
    }
    Py_INCREF(t);
    p->t = t;
  } else {
    p->meta = MakeMeta(THPVariable_Unpack(t));
  }
  return reinterpret_cast<PyObject*>(p);
}

PyObject* UnpackPacked(PyObject* packed) { return Unpack(reinterpret_cast<PackedObject*>(packed)); }

}  // namespace bgl::torch_ext::detail

namespace bgl::torch_ext {

PyObject* BlockDoneFor(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  using detail::NewBlockDone;
  using detail::record_base;
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "block_done(enforcer, handle, rec): 3 arguments");
    return nullptr;
  }
  PyObject* enf = args[0];
  PyObject* rec = args[2] == Py_None ? nullptr : args[2];
  if (rec != nullptr && !PyObject_TypeCheck(rec, record_base)) {
    PyErr_Format(PyExc_TypeError, "block_done: rec must be a record or None, not %.100s",
                 Py_TYPE(rec)->tp_name);
    return nullptr;
  }
  const unsigned long long handle = PyLong_AsUnsignedLongLong(args[1]);
  if (PyErr_Occurred()) return nullptr;
  if (handle == 0) {
    PyErr_SetString(PyExc_ValueError, "block_done: handle 0 is no enforcer handle");
    return nullptr;
  }
  PyObject* fast = PyObject_GetAttrString(enf, "fast");
  if (fast == nullptr || !IsEnforcer(fast)) {
    Py_XDECREF(fast);
    PyErr_Format(PyExc_TypeError,
                 "block_done: enforcer must be an Enforcer (enforce/enforcer.py) whose fast is a "
                 "bagualu._C.Enforcer, not %.100s",
                 Py_TYPE(enf)->tp_name);
    return nullptr;
  }
  PyObject* cuda_attr = PyObject_GetAttrString(enf, "cuda");
  const int cuda = cuda_attr == nullptr ? -1 : PyObject_IsTrue(cuda_attr);
  Py_XDECREF(cuda_attr);
  PyObject* out = cuda < 0 ? nullptr : NewBlockDone(rec, enf, fast, handle, cuda == 1);
  Py_DECREF(fast);
  return out;
}

}  // namespace bgl::torch_ext

namespace bgl::torch_ext::detail {

bool AddPackedType(PyObject* module, PyTypeObject** type) {
  PyType_Slot slots[] = {
      {Py_tp_doc, const_cast<char*>("What autograd keeps for one saved tensor: Packed(rec, t).")},
      {Py_tp_new, reinterpret_cast<void*>(PackedNew)},
      {Py_tp_methods, packed_methods},
      {Py_tp_members, packed_members},
      {Py_tp_traverse, reinterpret_cast<void*>(PackedTraverse)},
      {Py_tp_clear, reinterpret_cast<void*>(PackedClear)},
      {Py_tp_dealloc, reinterpret_cast<void*>(PackedDealloc)},
      {0, nullptr}};
  PyType_Spec spec = {"bagualu._C.Packed", sizeof(PackedObject), 0,
                      Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, slots};
  PyType_Slot done_slots[] = {
      {Py_tp_doc, const_cast<char*>("A reloaded or uncast block's end (block_done()).")},
      {Py_tp_call, reinterpret_cast<void*>(BlockDoneCall)},
      {Py_tp_traverse, reinterpret_cast<void*>(BlockDoneTraverse)},
      {Py_tp_clear, reinterpret_cast<void*>(BlockDoneClear)},
      {Py_tp_dealloc, reinterpret_cast<void*>(BlockDoneDealloc)},
      {0, nullptr}};
  PyType_Spec done_spec = {"bagualu._C.BlockDone", sizeof(BlockDoneObject), 0,
                           Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, done_slots};
  PyObject* p = PyType_FromSpec(&spec);
  PyObject* d = p == nullptr ? nullptr : PyType_FromSpec(&done_spec);
  if (d == nullptr) {
    Py_XDECREF(p);
    return false;
  }
  Py_INCREF(p);  // packed_type's
  if (PyModule_AddObject(module, "Packed", p) < 0) {
    Py_DECREF(p);
    Py_DECREF(p);
    Py_DECREF(d);
    return false;
  }
  packed_type = reinterpret_cast<PyTypeObject*>(p);
  block_done_type = reinterpret_cast<PyTypeObject*>(d);  // kept for the life of the process
  *type = packed_type;
  return true;
}

}  // namespace bgl::torch_ext::detail
