"""Turns a captured micro-batch into the planner's model document: an explicit "layer_graph"
(docs/planner.md) describing what PyTorch really saved per operator, so the planner's memory
model predicts the captured bytes."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ..vocabulary import SCALING_KINDS, Op
from ..record import Record

_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def build_produced_graph(records: Sequence[Record], ops: Sequence[Op], load: float,
                         op_ms: Dict[str, float], readers: Dict[int, Any],
                         tensor_names: Optional["TensorNames"] = None) -> Dict[str, Any]:
    """The layer_graph of layer ``ops[0].layer`` (strategies follow the producer, recompute.py): every storage the layer's operators made is one graph tensor per
    (producer, dtype), saved by its producer, read by the operators whose calls took it as
    input; the layer's input is the block input. Bytes of producers that scale with the load
    are stated at r = 1. Operator times are inclusive (rerunning the block's own code reruns
    the whole layer)."""
    layer = ops[0].layer
    kinds = {op.name: op.kind for op in ops}
    order = {op.name: i for i, op in enumerate(ops)}
    groups: "OrderedDict[Tuple[Any, ...], Dict[str, Any]]" = OrderedDict()
    x = {"name": "x", "bytes": 0.0, "dtype": "fp32", "block_input": True,
         "consumers": [ops[0].name]}
    for r in sorted(records, key=lambda r: r.seq):
        p = r.producer
        if p.layer != layer or (p.name != "input" and p.name not in kinds):
            continue
        if p.name == "input":
            x["bytes"] += r.nbytes
            x["dtype"] = _DTYPES.get(r.dtype, "fp32")
            continue
        key = _produced_key(r)
        dt = key[1]
        g = groups.get(key)
        scales = kinds[p.name] in SCALING_KINDS
        if g is None:
            g = {"name": f"t{len(groups)}.{p.name}", "bytes": 0.0, "dtype": dt,
                 "producer": p.name, "consumers": [p.name], "readers": set()}
            if tensor_names is not None:
                tensor_names.names[key] = g["name"]
            if scales:
                g["scales_with_load"] = True
            groups[key] = g
        g["bytes"] += r.nbytes / (load if scales and load > 0 else 1.0)
        g["readers"].update(n for n in readers.get(r.ptr, ()) if n in kinds and n != p.name
                            and order[n] > order[p.name])
    x["bytes"] = int(round(x["bytes"]))
    tensors = [x]
    for g in groups.values():
        g["bytes"] = int(round(g["bytes"]))
        g["readers"] = sorted(g["readers"], key=order.get)
        if not g["readers"]:
            del g["readers"]
        tensors.append(g)
    return {"operators": _operators(ops, op_ms), "tensors": tensors}


def _produced_key(r: Record) -> Tuple[str, str]:
    # Integer and boolean storages (indices, masks) are never cast: the planner's "fp8" dtype
    # says so (an FP8 plan leaves them at their size, plus the scales' 3%).
    return (r.producer.name,
            _DTYPES.get(r.dtype) or ("fp32" if r.dtype.is_floating_point else "fp8"))


class TensorNames:
    """Which graph tensor of its layer a record of any micro-batch belongs to: the grouping the
    graph builder used at capture, remembered by key (the plan's issue order names graph
    tensors; enforce/order.py maps records to them)."""

    def __init__(self, ops: Sequence[Op]) -> None:
        self.order = {op.name: i for i, op in enumerate(ops)}
        self.names: Dict[Tuple[Any, ...], str] = {}

    def locate(self, r: Record) -> Tuple[int, Optional[str]]:
        """(layer, graph tensor name within it) of ``r``; name None when the graph has no
        tensor for it."""
        return r.producer.layer, self.names.get(_produced_key(r))


def _operators(ops: Sequence[Op], op_ms: Dict[str, float]) -> List[Dict[str, Any]]:
    """The graph's operators with their measured forward times (backward: twice that)."""
    out = []
    for op in ops:
        fwd = max(op_ms.get(op.name, 0.01), 0.001)
        o: Dict[str, Any] = {"name": op.name, "kind": op.kind, "forward_ms": round(fwd, 4),
                             "backward_ms": round(2 * fwd, 4),
                             "scales_with_load": op.kind in SCALING_KINDS}
        out.append(o)
    return out


def produced_in_layers(records: Iterable[Record]) -> int:
    """Captured bytes of storages produced inside the planned layers (what the graph models
    under producer strategies)."""
    return sum(r.nbytes for r in records if r.consumers and r.in_layers())


def keep_all_bytes(description: Dict[str, Any], load: float) -> float:
    """The planner's keep-all activation bytes of one micro-batch at load factor ``load``
    (StageGraph::KeepAllBytes over the planner's own description)."""
    total = 0.0
    for t in description["tensors"]:
        if t["savers"] or t["block_input"]:
            total += t["bytes"] * (load if t["scales_with_load"] else 1.0)
    return total


def model_document(layer_graph: Dict[str, Any], layers: int, pipeline_stages: int,
                   micro_batches: int, info: Optional[Dict[str, Any]] = None,
                   vp: int = 0) -> Dict[str, Any]:
    """A planner model document for one stage of ``layers`` layers with an explicit graph.

    Static memory (parameters, optimizer, workspace) is zero: the capacity given to the
    planner is the activation capacity."""
    info = dict(info or {})
    doc: Dict[str, Any] = {
        "name": info.pop("name", "pytorch-model"),
        "layers": layers * pipeline_stages,
        "hidden": 64, "moe_hidden": 64, "experts": 1, "top_k": 1, "head_dim": 64,
        "gpus": pipeline_stages, "dp": 1, "tp": 1, "ep": 1, "pp": pipeline_stages, "vp": vp,
        "micro_batches": micro_batches, "dtype": "fp32", "param_bytes": 0, "grad_bytes": 0,
        "optimizer_bytes": 0, "workspace": 0, "safety_margin": 0.0,
        "sequence_parallel": False,
    }
    for k, v in info.items():
        if k in ("hidden", "moe_hidden", "experts", "top_k", "head_dim", "heads", "seq_len",
                 "micro_batch_size", "shared_experts", "shared_expert_hidden", "gpu"):
            doc[k] = v
    doc["layer_graph"] = layer_graph
    return doc
