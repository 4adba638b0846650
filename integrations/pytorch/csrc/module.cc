// bagualu._C: the package's compiled binding for PyTorch. It holds no state of its own: the
// types of calls.h call the C ABIs of the libraries the package loaded, blocks.h makes the
// enforcer's blocks torch storages, and the torch.ops.bagualu library is defined here (the
// namespace is this binding's: a second TORCH_LIBRARY(bagualu) fails to load).
// Thread safety: every entry point is called with the GIL held (see calls.h and blocks.h).
#include <Python.h>
#include <torch/library.h>

#include <cstdint>

#include "blocks.h"
#include "calls.h"
#include "cursor.h"
#include "saved.h"

namespace bgl::torch_ext {
namespace {

// The version of this binding's interface to the package (native/ext.py checks it): raised when
// a call is added or its arguments or results change, so a stale build is refused by name,
// not misused.
constexpr int64_t kAbiVersion = 6;

int64_t AbiVersion() { return kAbiVersion; }

PyMethodDef module_methods[] = {
    {"block_storage", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(BlockStorage)),
     METH_FASTCALL,
     "block_storage(ptr, nbytes, device_type, device_index, done): the enforcer's block as a "
     "torch.UntypedStorage (no copy); done() runs when torch frees it."},
    {"block_done", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(BlockDoneFor)),
     METH_FASTCALL,
     "block_done(enforcer, handle, rec): the end of a block the enforcer reloaded or uncast for "
     "handle, to pass to block_storage as done (rec: its record or None)."},
    {"light_count", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(LightCount)),
     METH_FASTCALL,
     "light_count(light_set, storage, key, nbytes, inside): LightSet.count (capture/light.py)."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT,
                          "bagualu._C",
                          "bagualu's compiled binding for PyTorch (docs/pytorch.md, \"The "
                          "compiled binding\").",
                          -1,
                          module_methods,
                          nullptr,
                          nullptr,
                          nullptr,
                          nullptr};

}  // namespace
}  // namespace bgl::torch_ext

TORCH_LIBRARY(bagualu, m) { m.def("abi_version() -> int", &bgl::torch_ext::AbiVersion); }

PyMODINIT_FUNC PyInit__C() {
  using namespace bgl::torch_ext;
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  if (PyModule_AddStringConstant(m, "torch_version", BGL_TORCH_BUILT_FOR) < 0 ||
      PyModule_AddIntConstant(m, "abi_version", static_cast<long>(kAbiVersion)) < 0 ||
      !AddCallTypes(m) || !AddCursorType(m) || !AddSavedTypes(m)) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
