"""A gated MLP's down projection in the scaled recipes ("tensor", "rowwise") above the decode
sizes: act(a, b) quantized by a kernel of ours, then cuBLAS's tensorwise or rowwise FP8 GEMM
(torch._scaled_mm), as fp8compile::gated_linear_scaled_mm.

The plain linear on act(gate, up) (ops/linear/scaled_cublas.py, traced) leaves the product, its
per-token amax and the cast to Inductor's fused reduction; triton_quant_rows.py's kernel does it
in one read of each row, 1.33x faster at Llama-3-8B's down projection on an H100 (its docstring).

The numbers are reference_scaled.gated_linear_scaled's: act(a, b) in fp32, never rounded to
bf16, quantized with the reference's scale. Like fp8compile::linear_scaled_mm (scaled_mm_op.py)
the op is a torch.library.triton_op: traced into the graph (passes/inline.py), its body is the
launch (wrap_triton) and an aten._scaled_mm node that Inductor's generated code calls.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import triton_op

from .reference_scaled import check_recipe
from .scaled_cublas import scaled_mm
from ..quant.triton_quant_rows import quantize


@triton_op("fp8compile::gated_linear_scaled_mm", mutates_args=())
def gated_linear_scaled_mm(
    a: Tensor,
    b: Tensor,
    w_fp8: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    x_scale: Tensor | None = None,
    recipe: str = "rowwise",
    amax_ub: float = 0.0,
    e8m0: bool = False,
    fast_accum: bool = False,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> Tensor:
    """act(a, b) for bf16 a, b (M, K) times w_fp8 (N, K) with w_scale () or (N,) (+ bias) -> bf16
    (M, N): x_scale a static scale, else dynamic (per token for rowwise, over act(a, b) for
    tensor), as reference_scaled.gated_linear_scaled; fast_accum: _scaled_mm's use_fast_accum."""
    check_recipe(recipe)
    torch._check(a.shape == b.shape, lambda: "act(a, b) needs a and b of one shape")
    x_fp8, sx = quantize(a, b, recipe, x_scale, amax_ub, e8m0, (activation, alpha, limit))
    out = scaled_mm(x_fp8, sx, w_fp8, w_scale, recipe, a.dtype, fast_accum)
    return out if bias is None else out + bias


def gated_linear_scaled_cublas(
    a: Tensor,
    b: Tensor,
    w_fp8: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    recipe: str = "rowwise",
    x_scale: Tensor | None = None,
    amax_ub: float = 0.0,
    e8m0: bool = False,
    fast_accum: bool = False,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> Tensor:
    """fp8compile::gated_qlinear_scaled's cublas kernel: gated_linear_scaled_mm over a, b (..., K)."""
    a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    n = w_fp8.shape[0]
    if a2.shape[0] == 0:
        return a.new_empty(*a.shape[:-1], n)
    out = gated_linear_scaled_mm(
        a2, b2, w_fp8, w_scale, bias, x_scale, recipe, amax_ub, e8m0, fast_accum, activation, alpha, limit
    )
    return out.reshape(*a.shape[:-1], n)
