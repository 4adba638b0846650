"""The capture micro-batch described to the planner: after its forward, the layer graph of
what PyTorch saved (its operators in the order of their first call, what each produced and who
read it, the operators' times, the layer's own time), the bytes saved outside the layers, and
the warning about saved tensors a model's own checkpointing hides; after its backward, the
layer's own backward time.

Not thread-safe: the training thread, at the end of the capture's forward (runtime.py)."""
from __future__ import annotations

import logging
from typing import Any, Dict

from .capture import foreign
from .planning import graph
from .vocabulary import Op

log = logging.getLogger("bagualu")


def describe_capture(rt: Any, unit: int) -> None:
    """After the capture micro-batch ``unit`` of runtime ``rt`` (runtime.py's Runtime, which
    imports this module): the layer graph of what PyTorch saved, to the governor
    (``rt.planning.register``)."""
    # What the backward will need: records released during the forward (graph pieces
    # that lead nowhere, e.g. a router's selection arithmetic) held memory only briefly.
    recs = rt.tracker.store.take_captured(unit)
    loads = rt.planning.loads.get(unit, [])
    load0 = loads[0] if loads else 1.0
    if rt.auto is not None:
        calls, kinds = rt.auto, rt.discovery.kinds
    else:
        calls, kinds = rt.block_path, {op.name: op.kind for op in rt.layer_ops[0]}
    # Operators in the order of their first call (a block's own code first).
    ops = [Op(n, kinds[n], 0) for n in calls.op_order(list(kinds))]
    names = graph.TensorNames(ops)
    op_calls = getattr(calls, "calls", None)
    op_ms = rt.op_ms
    if op_calls is not None and op_calls.per_layer:  # each operator's fastest layer
        op_ms = op_calls.robust_op_ms(op_ms, kinds)
    per_op = rt.auto is not None and rt.auto.compiled.per_op
    if per_op:  # compiled blocks, their operators placed apart (capture/compiled.py)
        produced: Dict[str, int] = {}
        for r in recs:
            if r.producer.layer == 0:
                produced[r.producer.name] = produced.get(r.producer.name, 0) + r.nbytes
        op_ms = rt.auto.compiled_op_times(op_ms, produced)
    lg = graph.build_produced_graph(recs, ops, load0, op_ms, calls.readers, names)
    layer_ms = getattr(op_calls, "layer_ms", 0.0)
    if layer_ms > 0 and not per_op:  # the copy windows: nested operators counted once
        lg["forward_ms"] = round(layer_ms, 4)
    if per_op:  # a compiled graph's operators are rerun only by a variant's recompute set
        may = rt.auto.stashes.recomputable
        for o in lg["operators"]:
            o["recompute_allowed"] = o["name"] in may
    outside = sum(r.nbytes for r in recs if r.consumers and not r.in_layers())
    rt.planning.register(lg, names, outside, rt.model_info)
    if rt.hidden.found and not rt.hidden.reported:
        rt.hidden.reported = True
        s = rt.settings
        in_flight = max(1, min(s.micro_batches, s.pipeline_stages - s.pipeline_rank))
        seen = graph.produced_in_layers(r for r in recs if r.storage is None or
                                        not rt.hidden.holds(r.ptr, r.storage))
        log.warning("%s", foreign.report(rt.hidden, seen, in_flight, rt.capacity))



def describe_backward(rt: Any, at_backward: bool = False) -> None:
    """After the capture's backward: its layer's own backward time (capture/calls.py),
    registered with the planner as the layer graph's backward_ms (the backward window; without
    it the planner takes twice the forward). Registering again starts new planners, so it
    happens where no forward is planned and not yet run back: at the end of the capture's
    backward when that is so (``at_backward``: one micro-batch at a time, as in gradient
    accumulation), else at the iteration's end (or the next one's start where a loop calls no
    end). Not when the capture's backward reran or reloaded what a static policy forced (its
    time is then not the layer's own backward), nor for compiled blocks planned per operator."""
    calls = getattr(rt.auto if rt.auto is not None else rt.block_path, "calls", None)
    planning = rt.planning
    if calls is None or calls.backward_ms <= 0 or planning.model_doc is None:
        return
    if at_backward and planning.plans:
        return  # forwards planned by the planners of now: at the next iteration's start
    backward_ms = calls.backward_ms
    calls.layer_backward.clear()
    lg = planning.model_doc["layer_graph"]
    if calls.rerun_in_capture or rt.strategies.forced is not None or "forward_ms" not in lg:
        return
    log.info("bagualu: the capture's backward took %.3f ms per layer (%.2fx its forward); "
             "planning with it from now on", backward_ms, backward_ms / lg["forward_ms"])
    planning.register_backward(round(backward_ms, 4))
