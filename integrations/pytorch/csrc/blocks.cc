#include "blocks.h"

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/core/Storage.h>
#include <torch/csrc/Storage.h>

#include <cstdint>

namespace bgl::torch_ext {
namespace {

// Runs the callable the block was made with, once, when torch frees the storage.
void RunDone(void* ctx) {
  auto* done = static_cast<PyObject*>(ctx);
  if (!Py_IsInitialized()) return;  // the interpreter is gone: nothing to tell
  PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* r = PyObject_CallNoArgs(done);
  if (r == nullptr) {
    PyErr_WriteUnraisable(done);  // as a weakref callback's error: said, never raised
  } else {
    Py_DECREF(r);
  }
  Py_DECREF(done);
  PyGILState_Release(gil);
}

}  // namespace

PyObject* BlockStorage(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError,
                    "block_storage(ptr, nbytes, device_type, device_index, done): 5 arguments");
    return nullptr;
  }
  const auto ptr = PyLong_AsUnsignedLongLong(args[0]);
  const auto nbytes = PyLong_AsLongLong(args[1]);
  const auto device_type = PyLong_AsLong(args[2]);
  const auto device_index = PyLong_AsLong(args[3]);
  if (PyErr_Occurred()) return nullptr;
  if (ptr == 0 || nbytes < 0 || (device_type != 0 && device_type != 1)) {
    PyErr_Format(PyExc_ValueError,
                 "block_storage: bad block (ptr %llu, nbytes %lld, device_type %ld)", ptr, nbytes,
                 device_type);
    return nullptr;
  }
  PyObject* done = args[4];
  if (!PyCallable_Check(done)) {
    PyErr_SetString(PyExc_TypeError, "block_storage: done must be callable");
    return nullptr;
  }
  return MakeBlockStorage(reinterpret_cast<void*>(static_cast<uintptr_t>(ptr)), nbytes,
                          device_type == 1, static_cast<int>(device_index), done);
}

PyObject* MakeBlockStorage(void* data, long long nbytes, bool cuda, int device_index,
                           PyObject* done) {
  const c10::Device device =
      cuda ? c10::Device(c10::kCUDA, static_cast<int8_t>(device_index)) : c10::Device(c10::kCPU);
  Py_INCREF(done);  // RunDone's
  try {
    c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<size_t>(nbytes),
                         c10::DataPtr(data, done, &RunDone, device), /*allocator=*/nullptr,
                         /*resizable=*/false);
    return THPStorage_Wrap(std::move(storage));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

}  // namespace bgl::torch_ext
