// The enforcer's blocks (a reload, an uncast) as torch storages: no copy, and the storage's death
// runs a Python callable (the package tells the enforcer PyTorch let go of the block).
// Thread safety: the storage may die on any thread (autograd's worker on CUDA); its deleter takes
// the GIL to run the callable and holds no other lock.
#ifndef BGL_TORCH_BLOCKS_H_
#define BGL_TORCH_BLOCKS_H_

#include <Python.h>

namespace bgl::torch_ext {

// block_storage(ptr, nbytes, device_type, device_index, done) -> torch.UntypedStorage.
// device_type: 0 CPU (the host backend's blocks), 1 CUDA.
PyObject* BlockStorage(PyObject* self, PyObject* const* args, Py_ssize_t nargs);

// The same from C++: a new reference to the storage (nullptr with the error set); `done` is
// called without arguments once torch frees it (a reference is taken here).
PyObject* MakeBlockStorage(void* ptr, long long nbytes, bool cuda, int device_index,
                           PyObject* done);

}  // namespace bgl::torch_ext

#endif  // BGL_TORCH_BLOCKS_H_
