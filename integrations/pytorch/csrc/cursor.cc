#include "cursor.h"

#include <structmember.h>

#include <unordered_map>
#include <vector>

#include "bgl/enforce.h"
#include "calls.h"

namespace bgl::torch_ext {
namespace {

struct IssueCursorObject {
  PyObject_HEAD PyObject* enforcer;  // the enforcer's _C.Enforcer, or nullptr: nothing to tell
  // Stage-graph index per operator (vocabulary.Op, keys held): the subclass's _op_index once.
  std::unordered_map<PyObject*, int>* ops;
  long long keys[2];  // the units whose forward (F) and backward (B) the point's order runs
  char active;        // an order is loaded
  char issuing;       // the enforcer carries out pieces: calls from their reruns tell nothing
};

PyObject* cursor_type = nullptr;
PyObject* op_index_name = nullptr;  // "_op_index"
PyObject* passed_name = nullptr;    // "_passed"
// The keys of an issue item (the plan's "issue_order" entries, docs/planner.md).
PyObject *chain_key, *stage_key, *round_key, *resource_key, *first_key, *last_key;

PyMemberDef cursor_members[] = {
    {"active", T_BOOL, offsetof(IssueCursorObject, active), 0, "an order is loaded"},
    {"issuing", T_BOOL, offsetof(IssueCursorObject, issuing), 0,
     "the enforcer carries out pieces (calls from their reruns tell the scheduler nothing)"},
    {"forward_key", T_LONGLONG, offsetof(IssueCursorObject, keys[0]), 0,
     "the unit whose forward the point's order runs (F chain)"},
    {"backward_key", T_LONGLONG, offsetof(IssueCursorObject, keys[1]), 0,
     "the unit whose backward the point's order runs (B chain)"},
    {nullptr, 0, 0, 0, nullptr}};

int CursorInit(PyObject* self, PyObject* args, PyObject* kwargs) {
  PyObject* enforcer = nullptr;
  static const char* kwlist[] = {"enforcer", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O:IssueCursor", const_cast<char**>(kwlist),
                                   &enforcer)) {
    return -1;
  }
  if (enforcer != Py_None && !IsEnforcer(enforcer)) {
    PyErr_Format(PyExc_TypeError, "IssueCursor(enforcer): a bagualu._C.Enforcer or None, not %s",
                 Py_TYPE(enforcer)->tp_name);
    return -1;
  }
  auto* o = reinterpret_cast<IssueCursorObject*>(self);
  Py_XDECREF(o->enforcer);
  o->enforcer = nullptr;
  if (enforcer != Py_None) {
    Py_INCREF(enforcer);
    o->enforcer = enforcer;
  }
  if (o->ops == nullptr) o->ops = new std::unordered_map<PyObject*, int>();
  o->keys[0] = o->keys[1] = -1;
  o->active = o->issuing = 0;
  return 0;
}

void CursorDealloc(PyObject* self) {
  auto* o = reinterpret_cast<IssueCursorObject*>(self);
  if (o->ops != nullptr) {
    for (auto& [op, index] : *o->ops) Py_DECREF(op);
    delete o->ops;
    o->ops = nullptr;
  }
  Py_CLEAR(o->enforcer);
  PyTypeObject* type = Py_TYPE(self);
  type->tp_free(self);
  Py_DECREF(type);
}

// The stage-graph index of `op` (-1: not a planned operator); -2 with a Python error set.
int OpIndex(IssueCursorObject* o, PyObject* op) {
  auto it = o->ops->find(op);
  if (it != o->ops->end()) return it->second;
  PyObject* r = PyObject_CallMethodOneArg(reinterpret_cast<PyObject*>(o), op_index_name, op);
  if (r == nullptr) return -2;
  const long index = PyLong_AsLong(r);
  Py_DECREF(r);
  if (index == -1 && PyErr_Occurred()) return -2;
  Py_INCREF(op);
  o->ops->emplace(op, static_cast<int>(index));
  return static_cast<int>(index);
}

// Compute of `chain` (0: F, 1: B) of unit `unit` is at operator `op`. False with an error set.
bool Step(IssueCursorObject* o, int chain, long long unit, PyObject* op) {
  if (!o->active || o->issuing || unit != o->keys[chain] || o->enforcer == nullptr) return true;
  if (o->ops == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "bagualu: IssueCursor.__init__ was not called");
    return false;
  }
  const int index = OpIndex(o, op);
  if (index < 0) return index == -1;
  int passed = 0;
  o->issuing = 1;
  const int rc =
      ScheduleAt(o->enforcer, chain == 0 ? BGL_CHAIN_FORWARD : BGL_CHAIN_BACKWARD, index, &passed);
  bool ok = true;
  if (rc != BGL_OK || passed > 0) {
    PyObject* status = PyLong_FromLong(rc);
    PyObject* stages = status == nullptr ? nullptr : PyLong_FromLong(passed);
    PyObject* r = stages == nullptr
                      ? nullptr
                      : PyObject_CallMethodObjArgs(reinterpret_cast<PyObject*>(o), passed_name,
                                                   status, stages, nullptr);
    ok = r != nullptr;
    Py_XDECREF(r);
    Py_XDECREF(stages);
    Py_XDECREF(status);
  }
  o->issuing = 0;
  return ok;
}

bool Args(const char* what, PyObject* const* args, Py_ssize_t nargs, long long* unit) {
  if (nargs != 2) {
    PyErr_Format(PyExc_TypeError, "%s(unit, op) takes 2 arguments (%zd given)", what, nargs);
    return false;
  }
  *unit = PyLong_AsLongLong(args[0]);
  return !PyErr_Occurred();
}

// forward_op(unit, op): the forward of `unit` enters operator `op`.
PyObject* ForwardOp(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  long long unit = 0;
  if (!Args("forward_op", args, nargs, &unit)) return nullptr;
  if (!Step(reinterpret_cast<IssueCursorObject*>(self), 0, unit, args[1])) return nullptr;
  Py_RETURN_NONE;
}

// backward_op(unit, op): the backward of `unit` needs what operator `op` produced.
PyObject* BackwardOp(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  long long unit = 0;
  if (!Args("backward_op", args, nargs, &unit)) return nullptr;
  if (!Step(reinterpret_cast<IssueCursorObject*>(self), 1, unit, args[1])) return nullptr;
  Py_RETURN_NONE;
}

PyMethodDef cursor_methods[] = {
    {"forward_op", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(ForwardOp)),
     METH_FASTCALL,
     "forward_op(unit, op): the forward of unit enters op (tells the scheduler where it is)."},
    {"backward_op", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(BackwardOp)),
     METH_FASTCALL,
     "backward_op(unit, op): the backward of unit needs what op produced (the unpack's call)."},
    {nullptr, nullptr, 0, nullptr}};

// The int of item `i`'s `key` into *out; where the item has none, *fallback (nullptr: the field
// is required, an error). False with a Python error set.
bool ItemInt(PyObject* item, Py_ssize_t i, PyObject* key, const int* fallback, int* out) {
  PyObject* v = PyDict_GetItemWithError(item, key);  // borrowed
  if (v == nullptr) {
    if (PyErr_Occurred()) return false;
    if (fallback == nullptr) {
      PyErr_Format(PyExc_ValueError, "issue item %zd: no '%U'", i, key);
      return false;
    }
    *out = *fallback;
    return true;
  }
  const long x = PyLong_AsLong(v);
  if (x == -1 && PyErr_Occurred()) {
    PyErr_Format(PyExc_ValueError, "issue item %zd: '%U' must be an int, not %s", i, key,
                 Py_TYPE(v)->tp_name);
    return false;
  }
  *out = static_cast<int>(x);
  return true;
}

// The number of item `i`'s `key` (a name of the ABI's `kind`: chain, resource) into *out.
bool ItemEnum(PyObject* enforcer, PyObject* item, Py_ssize_t i, PyObject* key, const char* kind,
              int* out) {
  PyObject* v = PyDict_GetItemWithError(item, key);  // borrowed
  if (v == nullptr) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "issue item %zd: no '%U'", i, key);
    return false;
  }
  const char* name = PyUnicode_Check(v) ? PyUnicode_AsUTF8(v) : nullptr;
  if (name == nullptr || EnumValue(enforcer, kind, name, out) != BGL_OK) {
    PyErr_Clear();
    PyErr_Format(PyExc_ValueError, "issue item %zd: %s %R unknown", i, kind, v);
    return false;
  }
  return true;
}

// schedule_begin(enforcer, order, offload_unit, recover_unit) -> status: loads a point's issue
// order (the plan's items: dicts of chain, stage, round, resource, first, last) into the
// enforcer's stream scheduler (bgl_enf_schedule_begin): the one reader of the items.
PyObject* ScheduleBeginCall(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_Format(PyExc_TypeError,
                 "schedule_begin(enforcer, order, offload_unit, recover_unit) takes 4 arguments "
                 "(%zd given)",
                 nargs);
    return nullptr;
  }
  PyObject* enforcer = args[0];
  if (!IsEnforcer(enforcer)) {
    PyErr_Format(PyExc_TypeError, "schedule_begin: a bagualu._C.Enforcer, not %s",
                 Py_TYPE(enforcer)->tp_name);
    return nullptr;
  }
  const long offload = PyLong_AsLong(args[2]);
  const long recover = offload == -1 && PyErr_Occurred() ? 0 : PyLong_AsLong(args[3]);
  if (PyErr_Occurred()) return nullptr;
  PyObject* seq = PySequence_Fast(args[1], "schedule_begin: the order must be a sequence");
  if (seq == nullptr) return nullptr;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  std::vector<bgl_enf_issue_item> items(static_cast<std::size_t>(n));
  static constexpr int kNone = -1;  // an item's first or last operator where it names none
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* it = PySequence_Fast_GET_ITEM(seq, i);
    bgl_enf_issue_item& out = items[static_cast<std::size_t>(i)];
    if (!PyDict_Check(it)) {
      PyErr_Format(PyExc_ValueError, "issue item %zd: a dict, not %s", i, Py_TYPE(it)->tp_name);
      Py_DECREF(seq);
      return nullptr;
    }
    if (!ItemEnum(enforcer, it, i, chain_key, "chain", &out.chain) ||
        !ItemInt(it, i, stage_key, nullptr, &out.stage) ||
        !ItemInt(it, i, round_key, nullptr, &out.round) ||
        !ItemEnum(enforcer, it, i, resource_key, "resource", &out.resource) ||
        !ItemInt(it, i, first_key, &kNone, &out.first) ||
        !ItemInt(it, i, last_key, &kNone, &out.last)) {
      Py_DECREF(seq);
      return nullptr;
    }
  }
  Py_DECREF(seq);
  return PyLong_FromLong(ScheduleBegin(enforcer, items.data(), items.size(),
                                       static_cast<int>(offload), static_cast<int>(recover)));
}

PyMethodDef module_functions[] = {
    {"schedule_begin",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(ScheduleBeginCall)), METH_FASTCALL,
     "schedule_begin(enforcer, order, offload_unit, recover_unit) -> status: a point's issue "
     "order into the enforcer's stream scheduler (bgl_enf_schedule_begin)."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

bool AddCursorType(PyObject* module) {
  op_index_name = PyUnicode_InternFromString("_op_index");
  passed_name = PyUnicode_InternFromString("_passed");
  chain_key = PyUnicode_InternFromString("chain");
  stage_key = PyUnicode_InternFromString("stage");
  round_key = PyUnicode_InternFromString("round");
  resource_key = PyUnicode_InternFromString("resource");
  first_key = PyUnicode_InternFromString("first");
  last_key = PyUnicode_InternFromString("last");
  if (op_index_name == nullptr || passed_name == nullptr || chain_key == nullptr ||
      stage_key == nullptr || round_key == nullptr || resource_key == nullptr ||
      first_key == nullptr || last_key == nullptr) {
    return false;
  }
  if (PyModule_AddFunctions(module, module_functions) < 0) return false;
  PyType_Slot slots[] = {
      {Py_tp_doc,
       const_cast<char*>("IssueCursor(enforcer): where compute is in a point's issue order "
                         "(bgl_enf_schedule_at); subclasses give _op_index(op) and "
                         "_passed(status, stages).")},
      {Py_tp_new, reinterpret_cast<void*>(PyType_GenericNew)},
      {Py_tp_init, reinterpret_cast<void*>(CursorInit)},
      {Py_tp_dealloc, reinterpret_cast<void*>(CursorDealloc)},
      {Py_tp_methods, cursor_methods},
      {Py_tp_members, cursor_members},
      {0, nullptr}};
  PyType_Spec spec = {"bagualu._C.IssueCursor", sizeof(IssueCursorObject), 0,
                      Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE, slots};
  cursor_type = PyType_FromSpec(&spec);
  if (cursor_type == nullptr) return false;
  Py_INCREF(cursor_type);  // kept for IsIssueCursor
  if (PyModule_AddObject(module, "IssueCursor", cursor_type) < 0) {
    Py_DECREF(cursor_type);
    return false;
  }
  return true;
}

bool IsIssueCursor(PyObject* obj) {
  return cursor_type != nullptr &&
         PyObject_TypeCheck(obj, reinterpret_cast<PyTypeObject*>(cursor_type));
}

bool CursorBackward(PyObject* cursor, long long unit, PyObject* op) {
  return Step(reinterpret_cast<IssueCursorObject*>(cursor), 1, unit, op);
}

}  // namespace bgl::torch_ext
