"""The scaled recipes ("tensor", "rowwise") on cuBLAS: torch._scaled_mm's tensorwise and rowwise
FP8 GEMMs, the kernels torchao's float8 recipes run.

The activation is quantized by plain tensor ops (reference_scaled.quant_act_scaled: the amax,
the division, the cast), so where the pass traces this function into the graph (passes/inline.py,
in both compile modes), Inductor fuses the quantization into one kernel with whatever produced
x (a norm, a gated MLP's silu(gate) * up) and calls cuBLAS from its generated code: no Python
of ours at run time. Called as fp8compile::qlinear_scaled's cublas kernel it runs the same ops
eagerly. The numbers are reference_scaled.linear_scaled's, the bias added to the bf16 result
(as the block recipe's cuBLAS side does). The product is summed in the tensor cores' own
reduced-precision accumulator with fast_accum (the compiled scaled recipes' default,
Fp8Config.fast_accum, as torchao runs them), in cuBLAS's fp32 promotion along K without.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .reference_scaled import quant_act_scaled

# cuBLAS FP8 GEMMs want 16-byte aligned rows: K (and N, the output's row) multiples of 16.
ALIGN = 16


def why_not(n: int, k: int) -> str | None:
    if k % ALIGN or n % ALIGN:
        return f"cuBLAS FP8 GEMMs need N and K multiples of {ALIGN}, got N={n}, K={k}"
    return None


def scaled_mm(
    x_fp8: Tensor, sx: Tensor, w_fp8: Tensor, w_scale: Tensor, recipe: str, out_dtype, fast_accum: bool
) -> Tensor:
    """torch._scaled_mm of x_fp8 (M, K) with its scale sx ((M,) per token, or one) and w_fp8
    (N, K) with w_scale ((N,) or ()) -> (M, N) out_dtype, in the recipe's cuBLAS mode."""
    if recipe == "rowwise":
        # cuBLAS's rowwise mode: one scale per row of x (M, 1) and per column of w.T (1, N); a
        # static scale is the same for every row.
        m = x_fp8.shape[0]
        sa = sx.reshape(-1, 1) if sx.dim() else sx.reshape(1, 1).expand(m, 1).contiguous()
        sb = w_scale.reshape(1, -1)
    else:
        sa, sb = sx.reshape(()), w_scale.reshape(())
    return torch._scaled_mm(
        x_fp8, w_fp8.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=fast_accum
    )


def linear_scaled_cublas(
    x: Tensor,
    w_fp8: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    recipe: str = "rowwise",
    x_scale: Tensor | None = None,
    amax_ub: float = 0.0,
    e8m0: bool = False,
    fast_accum: bool = False,
) -> Tensor:
    """bf16 x (..., K) times w_fp8 (N, K) with w_scale () or (N,) (+ bias) -> bf16 (..., N);
    fast_accum: torch._scaled_mm's use_fast_accum (Fp8Config.fast_accum)."""
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    if isinstance(m, int) and m == 0:  # traced, M is the dispatch's symbol, which its branch keeps >= 1
        return x.new_empty(*x.shape[:-1], w_fp8.shape[0])
    x_fp8, sx = quant_act_scaled(x2, recipe, e8m0, x_scale, amax_ub)
    out = scaled_mm(x_fp8, sx, w_fp8, w_scale, recipe, x.dtype, fast_accum)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], w_fp8.shape[0])
