// IssueCursor: where compute is in a scheduling point's issue order (enforce/order.py's
// PointIssuer is its Python subclass). At every operator call of the forward and every unpack
// of the backward it tells the enforcer's stream scheduler which operator compute is at
// (bgl_enf_schedule_at, the one definition of the rule), with no Python frame unless compute
// passed a stage: then the subclass's `_passed(status, stages)` runs (a skipped piece counted,
// the device copies whose offload completed let go of).
// Thread safety: every entry point runs with the GIL held (the training thread, and autograd's
// worker thread while the training thread waits in backward()); nothing here locks.
#ifndef BGL_TORCH_CURSOR_H_
#define BGL_TORCH_CURSOR_H_

#include <Python.h>

namespace bgl::torch_ext {

// Adds the type IssueCursor and the function schedule_begin (the point's issue order into the
// enforcer's stream scheduler: the one reader of the plan's issue items) to `module`; false with
// a Python error set on failure.
bool AddCursorType(PyObject* module);

// Whether `obj` is an IssueCursor (or an instance of a subclass).
bool IsIssueCursor(PyObject* obj);

// The backward of unit `unit` needs what operator `op` (a vocabulary.Op) produced: as the
// cursor's backward_op. False with a Python error set.
bool CursorBackward(PyObject* cursor, long long unit, PyObject* op);

}  // namespace bgl::torch_ext

#endif  // BGL_TORCH_CURSOR_H_
