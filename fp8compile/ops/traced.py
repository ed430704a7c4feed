"""Kernel launches written for tracing: the bodies of our torch.library.triton_ops
(moe/decode_op.py, moe/gluon_op.py) launch through these, so AOTAutograd's trace records each
launch (wrap_triton) and Inductor's generated code makes it, with the buffers Inductor allocates."""

from __future__ import annotations

import torch
from torch.library import wrap_triton

from ..numerics import BLOCK, FP8_DTYPE
from .quant import triton_quant


def launch(kernel, grid, args, constexprs, options) -> None:
    """kernel launched through wrap_triton with an *_arguments layout (grid, args, constexprs, options)."""
    wrap_triton(kernel)[grid](*args, **constexprs, **options)


def quant_act(x, b, e8m0: bool, activation: str, alpha: float, limit: float, rows: int):
    """triton_quant.quant_act(x, e8m0, "row", b, ...) as a traced launch, `rows` rows per program
    (the numbers do not depend on it): (x_fp8 (M, K), scale (M, K/128) fp32)."""
    m, k = x.shape
    x_fp8 = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(m, k // BLOCK, dtype=torch.float32, device=x.device)
    grid, args, constexprs = triton_quant.quant_act_arguments(
        x, b, x_fp8, scale, e8m0, activation, alpha, limit, rows
    )
    launch(triton_quant._quant_act_kernel, grid, args, constexprs, dict(num_warps=4))
    return x_fp8, scale
