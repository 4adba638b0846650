"""``--module bagualu.torchtitan`` for torchtitan's trainer: every torchtitan config function
(``--config deepseek_v3_debugmodel``, ``--config qwen3_moe_debug``, ...) is found here by
name and returns torchtitan's config with bagualu's trainer and its ``--bagualu.*`` section
(bagualu/loops/torchtitan.py; docs/torchtitan.md).

Imports torchtitan: load it only where torchtitan is installed.
"""
from __future__ import annotations

from typing import Any

from .loops.torchtitan import (DISPATCH, TORCHTITAN_OPS, BagualuConfig, BagualuTrainer,
                               bagualu_config, config_function)

__all__ = ["BagualuTrainer", "BagualuConfig", "bagualu_config", "TORCHTITAN_OPS", "DISPATCH"]


def __getattr__(name: str) -> Any:
    """torchtitan's config function ``name``, returning bagualu's trainer config."""
    if name.startswith("_"):
        raise AttributeError(name)
    return config_function(name)
