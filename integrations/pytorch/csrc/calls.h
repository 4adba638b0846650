// The C ABIs of libbgl_alloc.so and libbgl_enforce.so (bgl/alloc.h, bgl/enforce.h), found at run
// time in the libraries the package loaded, and the Python types that call them without ctypes.
// Thread safety: as the C ABIs (every function is thread safe); the Python objects are used with
// the GIL held.
#ifndef BGL_TORCH_CALLS_H_
#define BGL_TORCH_CALLS_H_

#include <Python.h>

namespace bgl::torch_ext {

// Adds the types Enforcer (the enforcer's hot calls) and Pool (the simulated device's blocks)
// to `module`; false with a Python error set on failure.
bool AddCallTypes(PyObject* module);

}  // namespace bgl::torch_ext

#endif  // BGL_TORCH_CALLS_H_
