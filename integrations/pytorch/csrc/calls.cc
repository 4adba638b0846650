#include "calls.h"

#include <dlfcn.h>
#include <structmember.h>

#include <cstddef>
#include <cstdint>

#include "bgl/alloc.h"
#include "bgl/enforce.h"

namespace bgl::torch_ext {
namespace {

// The functions of the two C ABIs the hot path calls, looked up once per object.
struct EnforceApi {
  decltype(&bgl_enf_register_saved) register_saved = nullptr;
  decltype(&bgl_enf_offload_saved) offload_saved = nullptr;
  decltype(&bgl_enf_store_fp8_saved) store_fp8_saved = nullptr;
  decltype(&bgl_enf_add_consumer) add_consumer = nullptr;
  decltype(&bgl_enf_offload) offload = nullptr;
  decltype(&bgl_enf_wait_tensor) wait_tensor = nullptr;
  decltype(&bgl_enf_query) query = nullptr;
  decltype(&bgl_enf_acquire) acquire = nullptr;
  decltype(&bgl_enf_release) release = nullptr;
  decltype(&bgl_enf_unregister) unregister = nullptr;
  decltype(&bgl_enf_prefetch) prefetch = nullptr;
  decltype(&bgl_enf_schedule_at) schedule_at = nullptr;
  decltype(&bgl_enf_schedule_begin) schedule_begin = nullptr;
  decltype(&bgl_enf_enum_value) enum_value = nullptr;
};

template <typename Fn>
bool Find(void* lib, const char* name, Fn* out) {
  *out = reinterpret_cast<Fn>(dlsym(lib, name));
  if (*out == nullptr) {
    PyErr_Format(PyExc_ImportError, "bagualu._C: %s not found in the loaded library (%s)", name,
                 dlerror());
    return false;
  }
  return true;
}

// Reads n integer arguments (int64) into out; false with a TypeError on a wrong count.
bool Ints(const char* what, PyObject* const* args, Py_ssize_t nargs, Py_ssize_t n, int64_t* out) {
  if (nargs != n) {
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", what, n, nargs);
    return false;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    out[i] = PyLong_AsLongLong(args[i]);
  }
  return !PyErr_Occurred();
}

void* AsPtr(int64_t v) { return reinterpret_cast<void*>(static_cast<uintptr_t>(v)); }

// --- Enforcer ----------------------------------------------------------------------------------
struct EnforcerObject {
  PyObject_HEAD bgl_enforcer* enf;
  int holder;  // the consumer every record registers first (native/enforce.py HOLDER)
  EnforceApi api;
  EnforcerLife life;
};

PyMemberDef enforcer_members[] = {
    {"live_blocks", T_LONGLONG, offsetof(EnforcerObject, life.live_blocks), 0,
     "blocks PyTorch still holds"},
    {"tracked", T_LONGLONG, offsetof(EnforcerObject, life.tracked), 0,
     "registered tensors the package has not retired"},
    {"closing", T_BOOL, offsetof(EnforcerObject, life.closing), 0,
     "close() was called: destroy once nothing is outstanding"},
    {"destroyed", T_BOOL, offsetof(EnforcerObject, life.destroyed), 0,
     "the library's enforcer is destroyed"},
    {nullptr, 0, 0, 0, nullptr}};

int EnforcerInit(PyObject* self, PyObject* args, PyObject*) {
  unsigned long long lib = 0, enf = 0;
  int holder = 0;
  if (!PyArg_ParseTuple(args, "KKi:Enforcer", &lib, &enf, &holder)) return -1;
  auto* o = reinterpret_cast<EnforcerObject*>(self);
  if (lib == 0 || enf == 0) {
    PyErr_SetString(PyExc_ValueError,
                    "Enforcer(library handle, enforcer, holder op): non-zero handles");
    return -1;
  }
  void* h = reinterpret_cast<void*>(static_cast<uintptr_t>(lib));
  EnforceApi& a = o->api;
  if (!Find(h, "bgl_enf_register_saved", &a.register_saved) ||
      !Find(h, "bgl_enf_offload_saved", &a.offload_saved) ||
      !Find(h, "bgl_enf_store_fp8_saved", &a.store_fp8_saved) ||
      !Find(h, "bgl_enf_add_consumer", &a.add_consumer) ||
      !Find(h, "bgl_enf_offload", &a.offload) || !Find(h, "bgl_enf_wait_tensor", &a.wait_tensor) ||
      !Find(h, "bgl_enf_query", &a.query) || !Find(h, "bgl_enf_acquire", &a.acquire) ||
      !Find(h, "bgl_enf_release", &a.release) || !Find(h, "bgl_enf_unregister", &a.unregister) ||
      !Find(h, "bgl_enf_prefetch", &a.prefetch) ||
      !Find(h, "bgl_enf_schedule_at", &a.schedule_at) ||
      !Find(h, "bgl_enf_schedule_begin", &a.schedule_begin) ||
      !Find(h, "bgl_enf_enum_value", &a.enum_value)) {
    return -1;
  }
  o->enf = reinterpret_cast<bgl_enforcer*>(static_cast<uintptr_t>(enf));
  o->holder = holder;
  return 0;
}

// The description of a saved storage from (ptr, nbytes, dtype, producer_op, micro_batch,
// need_order, consumer, stream): the registration's arguments, consumer -1 for none.
// The arguments (ptr, nbytes, dtype, producer_op, micro_batch, need_order, consumer, stream) of
// the register-and-move calls; consumer -1 for none yet.
bool ParseSaved(const char* what, PyObject* const* args, Py_ssize_t nargs, SavedDesc* d) {
  int64_t v[8];
  if (!Ints(what, args, nargs, 8, v)) return false;
  d->ptr = AsPtr(v[0]);
  d->bytes = static_cast<size_t>(v[1]);
  d->dtype = static_cast<int>(v[2]);
  d->producer_op = static_cast<int>(v[3]);
  d->micro_batch = static_cast<int>(v[4]);
  d->need_order = v[5];
  d->consumer = static_cast<int>(v[6]);
  d->stream = AsPtr(v[7]);
  return true;
}

// register_saved(ptr, nbytes, dtype, producer_op, micro_batch, need_order, consumer, stream)
//   -> (status, handle)
PyObject* RegisterSavedCall(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  SavedDesc d;
  if (!ParseSaved("register_saved", args, nargs, &d)) return nullptr;
  uint64_t h = 0;
  const int rc = RegisterSaved(self, d, &h);
  return Py_BuildValue("(iK)", rc, static_cast<unsigned long long>(h));
}

// offload_saved(...) -> (status, handle): as register_saved, then the offload.
PyObject* OffloadSavedCall(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  SavedDesc d;
  if (!ParseSaved("offload_saved", args, nargs, &d)) return nullptr;
  uint64_t h = 0;
  const int rc = OffloadSaved(self, d, &h);
  return Py_BuildValue("(iK)", rc, static_cast<unsigned long long>(h));
}

// store_fp8_saved(...) -> (status, handle, fp8 bytes)
PyObject* StoreFp8SavedCall(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  SavedDesc d;
  if (!ParseSaved("store_fp8_saved", args, nargs, &d)) return nullptr;
  uint64_t h = 0;
  size_t fp8 = 0;
  const int rc = StoreFp8Saved(self, d, &h, &fp8);
  return Py_BuildValue("(iKn)", rc, static_cast<unsigned long long>(h),
                       static_cast<Py_ssize_t>(fp8));
}

PyObject* AddConsumer(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  auto* o = reinterpret_cast<EnforcerObject*>(self);
  int64_t v[2];
  if (!Ints("add_consumer", args, nargs, 2, v)) return nullptr;
  return PyLong_FromLong(
      o->api.add_consumer(o->enf, static_cast<uint64_t>(v[0]), static_cast<int>(v[1])));
}

PyObject* Offload(PyObject* self, PyObject* arg) {
  auto* o = reinterpret_cast<EnforcerObject*>(self);
  const auto h = PyLong_AsUnsignedLongLong(arg);
  if (PyErr_Occurred()) return nullptr;
  return PyLong_FromLong(o->api.offload(o->enf, h));
}

PyObject* WaitTensor(PyObject* self, PyObject* arg) {
  auto* o = reinterpret_cast<EnforcerObject*>(self);
  const auto h = PyLong_AsUnsignedLongLong(arg);
  if (PyErr_Occurred()) return nullptr;
  int rc;
  Py_BEGIN_ALLOW_THREADS rc = o->api.wait_tensor(o->enf, h);
  Py_END_ALLOW_THREADS return PyLong_FromLong(rc);
}

PyObject* Unregister(PyObject* self, PyObject* arg) {
  auto* o = reinterpret_cast<EnforcerObject*>(self);
  const auto h = PyLong_AsUnsignedLongLong(arg);
  if (PyErr_Occurred()) return nullptr;
  return PyLong_FromLong(o->api.unregister(o->enf, h));
}

PyObject* Prefetch(PyObject* self, PyObject* arg) {
  auto* o = reinterpret_cast<EnforcerObject*>(self);
  const long mb = PyLong_AsLong(arg);
  if (PyErr_Occurred()) return nullptr;
  return PyLong_FromLong(o->api.prefetch(o->enf, static_cast<int>(mb), nullptr));
}

// state(handle) -> (status, placement, pending, fp8 bytes)
PyObject* State(PyObject* self, PyObject* arg) {
  auto* o = reinterpret_cast<EnforcerObject*>(self);
  const auto h = PyLong_AsUnsignedLongLong(arg);
  if (PyErr_Occurred()) return nullptr;
  bgl_enf_tensor_info info{};
  const int rc = o->api.query(o->enf, h, &info);
  return Py_BuildValue("(iiin)", rc, info.placement, info.pending,
                       static_cast<Py_ssize_t>(info.fp8_bytes));
}

// acquire(handle, stream) -> (status, pointer)
PyObject* Acquire(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  auto* o = reinterpret_cast<EnforcerObject*>(self);
  int64_t v[2];
  if (!Ints("acquire", args, nargs, 2, v)) return nullptr;
  void* ptr = nullptr;
  // The GIL stays held: a recompute callback or a pressure eviction inside the call runs Python.
  const int rc = o->api.acquire(o->enf, static_cast<uint64_t>(v[0]), -1, AsPtr(v[1]), &ptr);
  return Py_BuildValue("(iK)", rc,
                       static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(ptr)));
}

// release(handle, stream) -> status
PyObject* Release(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  auto* o = reinterpret_cast<EnforcerObject*>(self);
  int64_t v[2];
  if (!Ints("release", args, nargs, 2, v)) return nullptr;
  return PyLong_FromLong(o->api.release(o->enf, static_cast<uint64_t>(v[0]), -1, AsPtr(v[1])));
}

PyMethodDef enforcer_methods[] = {
    {"register_saved",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(RegisterSavedCall)), METH_FASTCALL,
     nullptr},
    {"offload_saved", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(OffloadSavedCall)),
     METH_FASTCALL, nullptr},
    {"store_fp8_saved",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(StoreFp8SavedCall)), METH_FASTCALL,
     nullptr},
    {"add_consumer", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(AddConsumer)),
     METH_FASTCALL, nullptr},
    {"acquire", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(Acquire)), METH_FASTCALL,
     nullptr},
    {"release", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(Release)), METH_FASTCALL,
     nullptr},
    {"offload", Offload, METH_O, nullptr},
    {"wait", WaitTensor, METH_O, nullptr},
    {"unregister", Unregister, METH_O, nullptr},
    {"prefetch", Prefetch, METH_O, nullptr},
    {"state", State, METH_O, nullptr},
    {nullptr, nullptr, 0, nullptr}};

// --- Pool --------------------------------------------------------------------------------------
struct PoolObject {
  PyObject_HEAD decltype(&bgl_alloc) alloc;
  decltype(&bgl_free) free;
  int device;
};

int PoolInit(PyObject* self, PyObject* args, PyObject*) {
  unsigned long long lib = 0;
  int device = 0;
  if (!PyArg_ParseTuple(args, "Ki:Pool", &lib, &device)) return -1;
  if (lib == 0) {
    PyErr_SetString(PyExc_ValueError, "Pool(library handle, device): a non-zero handle");
    return -1;
  }
  auto* o = reinterpret_cast<PoolObject*>(self);
  void* h = reinterpret_cast<void*>(static_cast<uintptr_t>(lib));
  if (!Find(h, "bgl_alloc", &o->alloc) || !Find(h, "bgl_free", &o->free)) return -1;
  o->device = device;
  return 0;
}

// alloc(nbytes) -> pointer (0: no room; bgl_alloc_last_error says why)
PyObject* PoolAlloc(PyObject* self, PyObject* arg) {
  auto* o = reinterpret_cast<PoolObject*>(self);
  const long long n = PyLong_AsLongLong(arg);
  if (PyErr_Occurred()) return nullptr;
  void* p = o->alloc(n > 0 ? static_cast<size_t>(n) : 1, o->device, nullptr);
  return PyLong_FromUnsignedLongLong(
      static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(p)));
}

// free(pointer, nbytes)
PyObject* PoolFree(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  auto* o = reinterpret_cast<PoolObject*>(self);
  int64_t v[2];
  if (!Ints("free", args, nargs, 2, v)) return nullptr;
  o->free(AsPtr(v[0]), v[1] > 0 ? static_cast<size_t>(v[1]) : 1, o->device, nullptr);
  Py_RETURN_NONE;
}

PyObject* pool_type = nullptr;
PyObject* enforcer_type = nullptr;

PyMethodDef pool_methods[] = {
    {"alloc", PoolAlloc, METH_O, nullptr},
    {"free", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(PoolFree)), METH_FASTCALL,
     nullptr},
    {nullptr, nullptr, 0, nullptr}};

// A heap type named `qualified` with these methods, added to `module` as `name`.
PyObject* AddType(PyObject* module, const char* name, const char* qualified, const char* doc,
                  int size, initproc init, PyMethodDef* methods, PyMemberDef* members) {
  PyType_Slot slots[] = {{Py_tp_doc, const_cast<char*>(doc)},
                         {Py_tp_new, reinterpret_cast<void*>(PyType_GenericNew)},
                         {Py_tp_init, reinterpret_cast<void*>(init)},
                         {Py_tp_methods, methods},
                         {members != nullptr ? Py_tp_members : 0, members},
                         {0, nullptr}};
  PyType_Spec spec = {qualified, size, 0, Py_TPFLAGS_DEFAULT, slots};
  PyObject* type = PyType_FromSpec(&spec);
  if (type == nullptr) return nullptr;
  if (PyModule_AddObject(module, name, type) < 0) {
    Py_DECREF(type);
    return nullptr;
  }
  return type;  // borrowed: the module holds it
}

}  // namespace

bool AddCallTypes(PyObject* module) {
  enforcer_type = AddType(module, "Enforcer", "bagualu._C.Enforcer",
                          "Enforcer(library handle, enforcer, holder op): the enforcer's hot calls "
                          "(bgl/enforce.h); each returns the bgl_status with its outputs.",
                          sizeof(EnforcerObject), EnforcerInit, enforcer_methods, enforcer_members);
  if (enforcer_type == nullptr) return false;
  Py_INCREF(enforcer_type);  // kept for IsEnforcer
  pool_type = AddType(module, "Pool", "bagualu._C.Pool",
                      "Pool(library handle, device): bgl_alloc and bgl_free of that device.",
                      sizeof(PoolObject), PoolInit, pool_methods, nullptr);
  if (pool_type == nullptr) return false;
  Py_INCREF(pool_type);  // kept for IsPool
  return true;
}

EnforcerLife* LifeOf(PyObject* enforcer) {
  return &reinterpret_cast<EnforcerObject*>(enforcer)->life;
}

bool IsEnforcer(PyObject* obj) {
  return enforcer_type != nullptr && Py_TYPE(obj) == reinterpret_cast<PyTypeObject*>(enforcer_type);
}

namespace {

bgl_enf_tensor_desc Describe(const SavedDesc& d) {
  bgl_enf_tensor_desc desc{};
  desc.ptr = d.ptr;
  desc.bytes = d.bytes;
  desc.dtype = d.dtype;
  desc.producer_op = d.producer_op;
  desc.graph_tensor = -1;
  desc.micro_batch = d.micro_batch;
  desc.stream = d.stream;
  return desc;
}

}  // namespace

int RegisterSaved(PyObject* enforcer, const SavedDesc& d, uint64_t* handle) {
  auto* o = reinterpret_cast<EnforcerObject*>(enforcer);
  const bgl_enf_tensor_desc desc = Describe(d);
  const int consumers[2] = {o->holder, d.consumer};
  return o->api.register_saved(o->enf, &desc, d.need_order, consumers, d.consumer >= 0 ? 2 : 1,
                               handle);
}

int OffloadSaved(PyObject* enforcer, const SavedDesc& d, uint64_t* handle) {
  auto* o = reinterpret_cast<EnforcerObject*>(enforcer);
  const bgl_enf_tensor_desc desc = Describe(d);
  const int consumers[2] = {o->holder, d.consumer};
  return o->api.offload_saved(o->enf, &desc, d.need_order, consumers, d.consumer >= 0 ? 2 : 1,
                              handle);
}

int StoreFp8Saved(PyObject* enforcer, const SavedDesc& d, uint64_t* handle, size_t* fp8_bytes) {
  auto* o = reinterpret_cast<EnforcerObject*>(enforcer);
  const bgl_enf_tensor_desc desc = Describe(d);
  const int consumers[2] = {o->holder, d.consumer};
  return o->api.store_fp8_saved(o->enf, &desc, d.need_order, consumers, d.consumer >= 0 ? 2 : 1,
                                handle, fp8_bytes);
}

int Acquire(PyObject* enforcer, uint64_t handle, void* stream, void** ptr) {
  auto* o = reinterpret_cast<EnforcerObject*>(enforcer);
  return o->api.acquire(o->enf, handle, -1, stream, ptr);
}

int ReleaseBlock(PyObject* enforcer, uint64_t handle, void* stream) {
  auto* o = reinterpret_cast<EnforcerObject*>(enforcer);
  return o->api.release(o->enf, handle, -1, stream);
}

int Unregister(PyObject* enforcer, uint64_t handle) {
  auto* o = reinterpret_cast<EnforcerObject*>(enforcer);
  return o->api.unregister(o->enf, handle);
}

int QueryPlacement(PyObject* enforcer, uint64_t handle, int* placement) {
  auto* o = reinterpret_cast<EnforcerObject*>(enforcer);
  bgl_enf_tensor_info info{};
  const int rc = o->api.query(o->enf, handle, &info);
  *placement = info.placement;
  // Back on the device without its record: reloaded or uncast ahead of the consumer (or a block
  // PyTorch still holds after the record went): where the record's data is, is what moved it.
  if (info.placement == BGL_PLACE_DEVICE && info.applied == BGL_STRATEGY_OFFLOAD) {
    *placement = BGL_PLACE_HOST;
  } else if (info.placement == BGL_PLACE_DEVICE && info.applied == BGL_STRATEGY_FP8) {
    *placement = BGL_PLACE_FP8;
  }
  return rc;
}

int QueryOffload(PyObject* enforcer, uint64_t handle, bool* waiting, bool* issued) {
  auto* o = reinterpret_cast<EnforcerObject*>(enforcer);
  bgl_enf_tensor_info info{};
  const int rc = o->api.query(o->enf, handle, &info);
  *waiting = rc == 0 && info.planned == BGL_STRATEGY_OFFLOAD && info.applied == BGL_STRATEGY_KEEP;
  *issued = rc == 0 && info.applied == BGL_STRATEGY_OFFLOAD && info.placement == BGL_PLACE_HOST;
  return rc;
}

int ScheduleAt(PyObject* enforcer, int chain, int op, int* passed) {
  auto* o = reinterpret_cast<EnforcerObject*>(enforcer);
  return o->api.schedule_at(o->enf, chain, op, passed);
}

int ScheduleBegin(PyObject* enforcer, const bgl_enf_issue_item* items, size_t count,
                  int offload_micro_batch, int recover_micro_batch) {
  auto* o = reinterpret_cast<EnforcerObject*>(enforcer);
  return o->api.schedule_begin(o->enf, items, count, offload_micro_batch, recover_micro_batch);
}

int EnumValue(PyObject* enforcer, const char* kind, const char* name, int* value) {
  auto* o = reinterpret_cast<EnforcerObject*>(enforcer);
  return o->api.enum_value(kind, name, value);
}

bool IsPool(PyObject* obj) {
  return pool_type != nullptr && Py_TYPE(obj) == reinterpret_cast<PyTypeObject*>(pool_type);
}

long long PoolAllocRaw(PyObject* pool, long long nbytes) {
  auto* o = reinterpret_cast<PoolObject*>(pool);
  void* p = o->alloc(nbytes > 0 ? static_cast<size_t>(nbytes) : 1, o->device, nullptr);
  return static_cast<long long>(reinterpret_cast<uintptr_t>(p));
}

void PoolFreeRaw(PyObject* pool, long long block, long long nbytes) {
  auto* o = reinterpret_cast<PoolObject*>(pool);
  o->free(AsPtr(block), nbytes > 0 ? static_cast<size_t>(nbytes) : 1, o->device, nullptr);
}

}  // namespace bgl::torch_ext
