"""Pure-PyTorch definitions of the per-tensor ("tensor") and per-channel ("rowwise") FP8 recipes,
the W8A8 formats most FP8 checkpoints and torchao's float8 rowwise use. Every kernel of
fp8compile::qlinear_scaled and gated_qlinear_scaled (a gated MLP's down projection,
gated_linear_scaled) is tested against these.

Layouts (M tokens, N output features, K input features):
  recipe "tensor":   w_fp8 (N, K) e4m3fn, w_scale () fp32      x_scale () fp32
  recipe "rowwise":  w_fp8 (N, K) e4m3fn, w_scale (N,) fp32    x_scale (M,) fp32 (one per token)
  out[m, n] = (x_fp8[m] . w_fp8[n]) * x_scale[m or ()] * w_scale[n or ()]
One scale spans the whole K, so the GEMM needs no per-group promotion and K need only suit
FP8 tensor cores (a multiple of 16), not the block recipe's 128.

Activation scales are dynamic (from this call's amax: per token for rowwise, over the whole x
for tensor; an optional upper bound on the amax, vLLM's input_scale_ub) or static: one fp32
scale per linear, calibrated beforehand (fp8compile.calibrate), the same for both recipes.
"""

from __future__ import annotations

import torch

from ...numerics import FP8_DTYPE, FP8_MAX, scale_from_amax
from ..activations import gated

SCALED_RECIPES = ("tensor", "rowwise")


def check_recipe(recipe: str) -> None:
    if recipe not in SCALED_RECIPES:
        raise ValueError(f"recipe {recipe!r}: the scaled linears serve {', '.join(SCALED_RECIPES)}")


def quant_weight_scaled(
    w: torch.Tensor, recipe: str, e8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) -> (w_fp8 (N, K), w_scale): () for "tensor", (N,) for "rowwise"."""
    check_recipe(recipe)
    w32 = w.float()
    amax = w32.abs().amax() if recipe == "tensor" else w32.abs().amax(dim=1)
    scale = scale_from_amax(amax, e8m0)
    w_fp8 = (w32 / (scale if recipe == "tensor" else scale[:, None])).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return w_fp8, scale


def act_scale(
    x: torch.Tensor,
    recipe: str,
    e8m0: bool = False,
    static_scale: torch.Tensor | None = None,
    amax_ub: float = 0.0,
) -> torch.Tensor:
    """The activation scale for x (M, K): static_scale as given; else dynamic, from the amax per
    token ("rowwise", (M,)) or over x ("tensor", ()), the amax capped at amax_ub when it is > 0."""
    check_recipe(recipe)
    if static_scale is not None:
        return static_scale.float()
    x32 = x.float()
    rows = x32.abs().amax(dim=1)  # (M,); traced over a symbolic M (passes/inline.py) without a branch on it
    if recipe == "rowwise":
        amax = rows
    elif isinstance(x.shape[0], int) and x.shape[0] == 0:
        amax = x32.new_zeros(())
    else:
        amax = rows.amax()
    if amax_ub > 0:
        amax = amax.clamp(max=amax_ub)
    return scale_from_amax(amax, e8m0)


def quant_act_scaled(
    x: torch.Tensor,
    recipe: str,
    e8m0: bool = False,
    static_scale: torch.Tensor | None = None,
    amax_ub: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (x_fp8 (M, K), x_scale: (M,) or ()); values past 448 * scale saturate (a static
    scale calibrated on other data, or a capped amax)."""
    scale = act_scale(x, recipe, e8m0, static_scale, amax_ub)
    per_row = scale.dim() == 1
    x_fp8 = (x.float() / (scale[:, None] if per_row else scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x_fp8, scale


def gemm_scaled(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """out (M, N) = x_fp8 @ w_fp8.T scaled per row of x (or once) and per row of w (or once), +
    bias. The dot products run in float64, exact for K < 2**17 (e4m3 products are multiples of
    2**-18 below 2**18), so every row's result is independent of M and of summation order."""
    exact = x_fp8.double() @ w_fp8.double().T
    sx = x_scale.double()
    sw = w_scale.double()
    out = exact * (sx[:, None] if sx.dim() else sx) * (sw[None, :] if sw.dim() else sw)
    if bias is not None:
        out = out + bias.double()
    return out.to(out_dtype)


def linear_scaled(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    recipe: str = "rowwise",
    x_scale: torch.Tensor | None = None,
    amax_ub: float = 0.0,
    e8m0: bool = False,
    fast_accum: bool = False,
) -> torch.Tensor:
    """FP8 linear of the scaled recipes on x (..., K): quantize (x_scale: a static scale, else
    dynamic), GEMM, (..., N) in x.dtype. fast_accum names a GPU GEMM's accumulation mode: the
    reference's sums are exact either way."""
    x2 = x.reshape(-1, x.shape[-1])
    x_fp8, sx = quant_act_scaled(x2, recipe, e8m0, x_scale, amax_ub)
    return gemm_scaled(x_fp8, sx, w_fp8, w_scale, bias, x.dtype).reshape(*x.shape[:-1], w_fp8.shape[0])


def gated_linear_scaled(
    a: torch.Tensor,
    b: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    recipe: str = "rowwise",
    x_scale: torch.Tensor | None = None,
    amax_ub: float = 0.0,
    e8m0: bool = False,
    fast_accum: bool = False,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """A gated MLP's down projection in the scaled recipes: linear_scaled of act(a, b)
    (reference.gated, fp32, never rounded to bf16) over a and b (..., K), written in a.dtype."""
    h = gated(a, b, activation, alpha, limit)
    h2 = h.reshape(-1, h.shape[-1])
    x_fp8, sx = quant_act_scaled(h2, recipe, e8m0, x_scale, amax_ub)
    out = gemm_scaled(x_fp8, sx, w_fp8, w_scale, bias, a.dtype)
    return out.reshape(*a.shape[:-1], w_fp8.shape[0])


def dequant_weight_scaled(w_fp8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """fp32 weight that w_fp8 and its scale (() or (N,)) stand for."""
    return w_fp8.float() * (w_scale[:, None] if w_scale.dim() else w_scale)


def requantize_with_max_scale(
    shards: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor FP8 shards [(w_fp8 (N_i, K), scale ())] of one fused weight (a qkv or gate_up
    quantized part by part, as per-tensor checkpoints store them) -> one (sum N_i, K) weight
    with one scale, the largest: each shard is dequantized and quantized again with it, so no
    value saturates; a shard with a smaller scale loses the precision of its own scale."""
    if not shards:
        raise ValueError("requantize_with_max_scale needs at least one shard")
    if any(scale.numel() != 1 for _, scale in shards):
        raise ValueError("requantize_with_max_scale takes per-tensor shards (one scale each)")
    top = torch.stack([scale.float().reshape(()) for _, scale in shards]).max()
    parts = [
        (dequant_weight_scaled(w, scale.float().reshape(())) / top).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        for w, scale in shards
    ]
    return torch.cat(parts), top


def e4m3fn_to_e4m3fnuz(w_fp8: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same weight in ROCm's FP8 format (e4m3fnuz: exponent bias 8, one zero, 0x80 is NaN).
    An e4m3fn byte read as e4m3fnuz is half its value, so the scale doubles; 0x80, e4m3fn's -0,
    becomes +0 (it would read as NaN). Dequantized, the weight is unchanged."""
    if w_fp8.dtype != FP8_DTYPE:
        raise ValueError(f"expected an {FP8_DTYPE} weight, got {w_fp8.dtype}")
    bits = w_fp8.view(torch.int8).clone()
    bits[bits == -128] = 0
    return bits.view(torch.float8_e4m3fnuz), scale * 2
