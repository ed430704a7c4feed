"""The block-recipe FP8 linear and gated linear in pure PyTorch, the definitions every linear kernel
is tested against: the activation quantized 1x128 per token (quant/reference.py), one GEMM over
128x128 weight blocks whose group dot products are exact in float64."""

from __future__ import annotations

import torch

from ...numerics import BLOCK
from ..activations import gated
from ..quant import reference as quant_reference


def gemm_block(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """out (M, N) = block-scaled x_fp8 @ w_fp8.T (+ bias), written in out_dtype.

    Each 128-long group dot product is computed in float64, where it is exact: e4m3 products
    are multiples of 2**-18 below 2**18, so a sum of 128 of them needs at most 43 of float64's
    53 bits, whatever the summation order. Groups are then scaled and summed in a fixed order.
    Hence the result is the same for a row whatever M is (batch-invariant by construction) and
    is a higher-precision baseline than any fp32-accumulating kernel.
    """
    m, k = x_fp8.shape
    n = w_fp8.shape[0]
    quant_reference.check_k(k)
    groups = k // BLOCK
    xq = x_fp8.double().reshape(m, groups, BLOCK)
    wq = w_fp8.double().reshape(n, groups, BLOCK)
    w_scale_rows = w_scale.double().repeat_interleave(BLOCK, dim=0)[:n]  # (N, G)
    x_scale = x_scale.double()
    out = torch.zeros(m, n, dtype=torch.float64, device=x_fp8.device)
    for g in range(groups):
        exact = xq[:, g] @ wq[:, g].T
        out += exact * x_scale[:, g, None] * w_scale_rows[None, :, g]
    if bias is not None:
        out += bias.double()
    return out.to(out_dtype)


def linear_block(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    e8m0: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """FP8 linear on an activation x (..., K): quantize 1x128, block GEMM, (..., N) in out_dtype
    (default x.dtype). x may have fewer columns than w_fp8 (a K of part of a group): zeros fill it."""
    x2 = quant_reference.pad_k(x.reshape(-1, x.shape[-1]), w_fp8.shape[1])
    x_fp8, x_scale = quant_reference.quant_act_block(x2, e8m0)
    out = gemm_block(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype or x.dtype)
    return out.reshape(*x.shape[:-1], w_fp8.shape[0])


def gated_linear_block(
    a: torch.Tensor,
    b: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    e8m0: bool = False,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """Gated-MLP down projection: the FP8 linear of act(a, b) (fp32), written in a.dtype."""
    return linear_block(gated(a, b, activation, alpha, limit), w_fp8, w_scale, bias, e8m0, a.dtype)
