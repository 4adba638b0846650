"""FP8 (e4m3) storage of activations with per-block FP32 scales, kept in PyTorch tensors."""
from __future__ import annotations

from typing import Tuple

import torch

E4M3_MAX = 448.0
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def supported(dtype: torch.dtype) -> bool:
    """Whether a tensor of ``dtype`` can be stored in FP8."""
    return dtype in FLOAT_DTYPES and hasattr(torch, "float8_e4m3fn")


def quantize(flat: torch.Tensor, block: int = 128) -> Tuple[torch.Tensor, torch.Tensor]:
    """Casts a 1-D float tensor to e4m3 with one scale per ``block`` elements.

    Returns (data as float8_e4m3fn, padded to a multiple of block; scales, float32)."""
    n = flat.numel()
    pad = (-n) % block
    x = flat.float()
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    x = x.view(-1, block)
    amax = x.abs().amax(dim=1, keepdim=True)
    scales = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    data = (x / scales).to(torch.float8_e4m3fn)
    return data.view(-1), scales.view(-1)


def dequantize(data: torch.Tensor, scales: torch.Tensor, numel: int, dtype: torch.dtype,
               block: int = 128) -> torch.Tensor:
    """Inverse of quantize: a 1-D tensor of ``numel`` elements of ``dtype``."""
    x = data.view(-1, block).float() * scales.view(-1, 1)
    return x.view(-1)[:numel].to(dtype).contiguous()


def nbytes(numel: int, block: int = 128) -> int:
    """Bytes of the FP8 copy (data plus scales) of ``numel`` elements."""
    blocks = (numel + block - 1) // block
    return blocks * block + blocks * 4
