"""The registered quantization ops (torch.library, ops/library.py), each with its fake (meta)
implementation below it: the activation's 1x128 groups, whose kernel is the backend's its
`backend` argument names (ops/kernels.py), and the weight's 128x128 blocks, which run once, at
compile time, on the reference only."""

from __future__ import annotations

import torch
from torch import Tensor

from ...numerics import BLOCK, FP8_DTYPE, ceil_div, whole_blocks
from .. import kernels
from . import reference as quant_reference
from ..library import fake, op


@op
def quant_act(x: Tensor, e8m0: bool = False, backend: str = "reference") -> tuple[Tensor, Tensor]:
    """x (M, K) -> x_fp8 (M, K) e4m3fn, x_scale (M, K/128) fp32 row-major; 1x128 groups."""
    return kernels.implementation("quant_act", backend)(x, e8m0)


@fake(quant_act)
def _(x: Tensor, e8m0: bool = False, backend: str = "reference") -> tuple[Tensor, Tensor]:
    m, k = x.shape
    return x.new_empty(m, k, dtype=FP8_DTYPE), x.new_empty(m, k // BLOCK, dtype=torch.float32)


@op
def quant_weight(w: Tensor, e8m0: bool = False) -> tuple[Tensor, Tensor]:
    """w (N, K) -> w_fp8 (N, Kp) e4m3fn, w_scale (ceil(N/128), Kp/128) fp32; 128x128 blocks, Kp =
    K in whole 128-wide groups (zero columns past K)."""
    return quant_reference.quant_weight_block(w, e8m0)


@fake(quant_weight)
def _(w: Tensor, e8m0: bool = False) -> tuple[Tensor, Tensor]:
    n, k = w.shape[0], whole_blocks(w.shape[1])
    return w.new_empty(n, k, dtype=FP8_DTYPE), w.new_empty(
        ceil_div(n, BLOCK), k // BLOCK, dtype=torch.float32
    )
