// The saved-tensor hooks' hot path in C++ (docs/pytorch.md, "The compiled binding"):
//  - RecordBase: the fields of one saved storage's record (record.py's Record subclasses it and
//    adds the moves), allocated and filled here without a Python frame;
//  - Packed: what autograd keeps per saved tensor (the tensor while its data is on the device,
//    else how to rebuild the view); its death releases the record when it was the last holder;
//  - Hooks: the pack and unpack callables for torch.autograd.graph.saved_tensors_hooks over one
//    tracker (capture/tracker.py): pack makes or finds the record of a plain tensor's storage
//    and applies its producer's strategy where that is keep; everything else (light capture,
//    tensor subclasses, recompute producers, the capture micro-batch, moves) is the tracker's
//    Python, called from here.
// Thread safety: every entry point runs with the GIL held (autograd's worker thread takes it to
// run the hooks on CUDA); nothing here holds a lock of its own.
#ifndef BGL_TORCH_SAVED_H_
#define BGL_TORCH_SAVED_H_

#include <Python.h>

namespace bgl::torch_ext {

// Adds RecordBase, Packed and Hooks to `module`; false with a Python error set on failure.
bool AddSavedTypes(PyObject* module);

// light_count(light_set, storage, key, nbytes, inside): capture/light.py's LightSet.count (its
// one definition: the pack's small storages and light capture both count through it).
PyObject* LightCount(PyObject* self, PyObject* const* args, Py_ssize_t nargs);

// block_done(enforcer, handle, rec): the callable a block the enforcer reloaded or uncast for
// `handle` runs when torch frees its storage (block_storage's done), the same end as this
// binding's own reloads: the block goes back to the enforcer (`enforcer`: enforce/enforcer.py's
// Enforcer), or retires the record `rec` (a RecordBase, or None: the caller retires the handle)
// when it was released meanwhile; a closing enforcer is destroyed once nothing is outstanding.
PyObject* BlockDoneFor(PyObject* self, PyObject* const* args, Py_ssize_t nargs);

}  // namespace bgl::torch_ext

#endif  // BGL_TORCH_SAVED_H_
