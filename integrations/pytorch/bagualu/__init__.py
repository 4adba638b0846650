"""BaGuaLu for PyTorch, the public API: per-micro-batch activation memory planning for MoE
training (docs/pytorch.md opens with the map of the package).

    import bagualu
    bagualu.install(capacity="256MiB", policy="bagualu")   # before the first CUDA allocation
    bagualu.instrument(model)          # any nn.Module: a Hugging Face model as it is
    print(bagualu.describe(model))     # the layers and operators found
    for it in range(steps):
        bagualu.begin_iteration()
        for phase, f, b in schedule:                          # e.g. bagualu.schedule.one_f_one_b
            bagualu.step_point(phase, f, b)
            with bagualu.forward(f): ...
            with bagualu.backward(b): ...
        bagualu.end_iteration()                               # logs the iteration's line

The facade: the functions are api.py's, the loops are loops/'s (which import api.py, never this
module, so the package has no import cycle); nothing in the package imports this module.
"""
from __future__ import annotations

from . import api as _api
from .api import (FP8, KEEP, OFFLOAD, POLICIES, RECOMPUTE, BagualuError, InstallError,
                  InstrumentError, LibraryNotFound, OpBlock, OutOfMemoryError, PlannerError,
                  PolicyError, Step, backward, begin_iteration, current, describe,
                  dump_snapshot, end_iteration, force_strategies, forward, history, install,
                  instrument, layers, model_document, operators, parse_size, plot_iteration,
                  record_iteration, served_plans, sessions, stage_graph, static_plan, stats,
                  step_point, uninstall)
from .loops import pipelining, schedule
from .loops.accumulate import accumulate_gradients, micro_batches
from .loops.hf_trainer import trainer_callback  # Hugging Face's Trainer (imports it when called)

__all__ = list(_api.__all__) + ["pipelining", "schedule", "micro_batches",
                                "accumulate_gradients", "trainer_callback"]
