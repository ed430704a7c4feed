"""The registered FP8 ops of linears, gated linears and MoE blocks, and the activation's
quantization (torch.library, ops/library.py), each with its fake (meta) implementation below it.

The real implementation of each op is the kernel of the backend its `backend` argument names
(ops/kernels.py); the pass fixes that choice at compile time, so the graph says which kernel
runs. Weight quantization runs once, at compile time, and has only the reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...numerics import BLOCK, ceil_div
from ...weights import fp8_weight, stacked_bias
from .. import kernels
from .. import activations
from ..quant import reference as quant_reference
from . import reference_scaled
from ..library import fake, op


def _check_linear_shapes(x: Tensor, w_fp8: Tensor, w_scale: Tensor, bias: Tensor | None) -> None:
    n, k = w_fp8.shape
    torch._check(x.shape[-1] == k, lambda: f"x has K={x.shape[-1]} but the weight has K={k}")
    torch._check(
        tuple(w_scale.shape) == (ceil_div(n, BLOCK), k // BLOCK),
        lambda: f"w_scale shape {tuple(w_scale.shape)} does not match a ({n}, {k}) weight in 128x128 blocks",
    )
    if bias is not None:
        torch._check(tuple(bias.shape) == (n,), lambda: f"bias shape {tuple(bias.shape)} is not ({n},)")


@op
def gemm(
    x_fp8: Tensor,
    x_scale: Tensor,
    w_fp8: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    backend: str = "reference",
) -> Tensor:
    """Block-scaled x_fp8 (M, K) @ w_fp8 (N, K).T (+ bias) -> (M, N) bf16."""
    return kernels.implementation("gemm", backend)(x_fp8, x_scale, w_fp8, w_scale, bias)


@fake(gemm)
def _(x_fp8, x_scale, w_fp8, w_scale, bias=None, backend="reference"):
    _check_linear_shapes(x_fp8, w_fp8, w_scale, bias)
    return x_fp8.new_empty(x_fp8.shape[0], w_fp8.shape[0], dtype=torch.bfloat16)


def _weight_out_features(x: Tensor, w: Tensor, bias: Tensor | None, w_kn: bool) -> int:
    """N of x (..., K) times a bf16 weight stored (N, K), or (K, N) if w_kn; checks K and bias."""
    k, n = w.shape if w_kn else reversed(w.shape)
    torch._check(x.shape[-1] == k, lambda: f"x has K={x.shape[-1]} but the weight has K={k}")
    if bias is not None:
        torch._check(tuple(bias.shape) == (n,), lambda: f"bias shape {tuple(bias.shape)} is not ({n},)")
    return n


@op(
    schema="(Tensor x, Tensor w, Tensor? bias=None, bool e8m0=False, str backend='reference', "
    "bool w_kn=False, "
    "Tensor[]? w_next=None, Tensor[]? bias_next=None) -> Tensor"
)
def linear(
    x: Tensor,
    w: Tensor,
    bias: Tensor | None = None,
    e8m0: bool = False,
    backend: str = "reference",
    w_kn: bool = False,
    w_next: list[Tensor] | None = None,
    bias_next: list[Tensor] | None = None,
) -> Tensor:
    """FP8 linear: bf16 x (..., K) times the bf16 weight w (N, K), or (K, N) if w_kn -> bf16 (..., N).

    w's FP8 copy (128x128 blocks) comes from the per-parameter memo the compiler filled
    (fp8compile/weights.py): no weight is quantized per call. x is quantized per token in 1x128
    groups (fused into the GEMM where the kernel can). With w_next (more weights over the same
    x, same layout), the op is one GEMM over all of them: (..., N + sum N'), w's outputs first;
    bias_next then holds their biases (given exactly when bias is).
    """
    w_fp8, w_scale = fp8_weight(w, w_kn, e8m0, w_next)
    x = quant_reference.pad_k(x, w_fp8.shape[1])  # a K of part of a group: zero columns, as in the copy
    return qlinear(x, w_fp8, w_scale, stacked_bias(bias, bias_next), e8m0, backend)


@fake(linear)
def _(x, w, bias=None, e8m0=False, backend="reference", w_kn=False, w_next=None, bias_next=None):
    n = sum(_weight_out_features(x, weight, None, w_kn) for weight in (w, *(w_next or ())))
    torch._check(
        (bias is None) == (not bias_next) or not w_next,
        lambda: "bias_next is given exactly when bias is (one bias per stacked weight)",
    )
    if bias is not None:
        b = bias.shape[0] + sum(b.shape[0] for b in bias_next or ())
        torch._check(b == n, lambda: f"biases have {b} outputs, the weights {n}")
    return x.new_empty(*x.shape[:-1], n)


@op
def qlinear(
    x: Tensor,
    w_fp8: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    e8m0: bool = False,
    backend: str = "reference",
) -> Tensor:
    """linear on the weight's FP8 copy, passed in: bf16 x (..., K) times w_fp8 (N, K) e4m3fn in
    128x128 blocks with scales w_scale (ceil(N/128), K/128) (+ bias (N,)) -> bf16 (..., N).

    What the passes emit: the compiled graph takes the FP8 copies as inputs, which the backend
    looks up once per call from the parameters passed (backend.py), so the op itself looks up
    nothing."""
    return kernels.implementation("linear", backend)(x, w_fp8, w_scale, bias, e8m0)


@fake(qlinear)
def _(x, w_fp8, w_scale, bias=None, e8m0=False, backend="reference"):
    _check_linear_shapes(x, w_fp8, w_scale, bias)
    return x.new_empty(*x.shape[:-1], w_fp8.shape[0])


def _check_gated(a: Tensor, b: Tensor, activation: str) -> None:
    torch._check(
        a.shape == b.shape, lambda: f"act(a, b) needs equal shapes, got {tuple(a.shape)} and {tuple(b.shape)}"
    )
    torch._check(
        activation in activations.GATED_ACTIVATIONS,
        lambda: f"activation {activation!r}: valid gated activations are {activations.GATED_ACTIVATIONS}",
    )


def _check_scaled_shapes(x, w_fp8, w_scale, bias, recipe, x_scale) -> None:
    n, k = w_fp8.shape
    torch._check(x.shape[-1] == k, lambda: f"x has K={x.shape[-1]} but the weight has K={k}")
    torch._check(
        recipe in reference_scaled.SCALED_RECIPES,
        lambda: f"recipe {recipe!r}: qlinear_scaled serves {reference_scaled.SCALED_RECIPES}",
    )
    want = (n,) if recipe == "rowwise" else ()
    torch._check(
        tuple(w_scale.shape) == want,
        lambda: f"w_scale shape {tuple(w_scale.shape)} does not match recipe {recipe!r} for N={n} ({want})",
    )
    torch._check(
        x_scale is None or x_scale.numel() == 1,
        lambda: f"a static x_scale is one scale, got shape {tuple(x_scale.shape)}",
    )
    if bias is not None:
        torch._check(tuple(bias.shape) == (n,), lambda: f"bias shape {tuple(bias.shape)} is not ({n},)")


@op
def qlinear_scaled(
    x: Tensor,
    w_fp8: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    x_scale: Tensor | None = None,
    recipe: str = "rowwise",
    amax_ub: float = 0.0,
    e8m0: bool = False,
    fast_accum: bool = False,
    backend: str = "reference",
) -> Tensor:
    """FP8 linear of the "tensor" or "rowwise" recipe (reference_scaled.py): bf16 x (..., K) times
    w_fp8 (N, K) e4m3fn with w_scale () or (N,) (+ bias (N,)) -> bf16 (..., N).

    x is quantized with the static scale x_scale (() fp32, calibrated) if given, else with a
    dynamic one: per token ("rowwise") or over x ("tensor"), its amax capped at amax_ub if > 0.
    fast_accum: the cuBLAS kernel's accumulation mode (Fp8Config.fast_accum); the others ignore it.
    """
    _check_scaled_shapes(
        x, w_fp8, w_scale, bias, recipe, x_scale
    )  # a scale of the other recipe would broadcast
    return kernels.implementation("scaled_linear", backend)(
        x, w_fp8, w_scale, bias, recipe, x_scale, amax_ub, e8m0, fast_accum
    )


@fake(qlinear_scaled)
def _(
    x,
    w_fp8,
    w_scale,
    bias=None,
    x_scale=None,
    recipe="rowwise",
    amax_ub=0.0,
    e8m0=False,
    fast_accum=False,
    backend="reference",
):
    _check_scaled_shapes(x, w_fp8, w_scale, bias, recipe, x_scale)
    return x.new_empty(*x.shape[:-1], w_fp8.shape[0])


@op
def gated_linear(
    a: Tensor,
    b: Tensor,
    w: Tensor,
    bias: Tensor | None = None,
    e8m0: bool = False,
    backend: str = "reference",
    w_kn: bool = False,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> Tensor:
    """Gated-MLP down projection: linear(act(a, b), w, bias) in FP8, a (gate) and b (up) bf16 (..., K).

    act is "silu" (silu(a) * b), "swigluoai" (GPT-OSS: clamped, alpha, (b + 1)), "silu_limit"
    (DeepSeek-V4: silu(a) * b with a and b clamped) or "gelu_tanh" (Gemma: gelu(a, approximate=
    "tanh") * b); see activations.gated. It is computed in fp32
    and quantized 1x128 in the same pass (inside the GEMM for the decode kernel): the bf16
    product is never written, never quantized twice.
    """
    w_fp8, w_scale = fp8_weight(w, w_kn, e8m0)
    a, b = (quant_reference.pad_k(t, w_fp8.shape[1]) for t in (a, b))  # act(0, 0) = 0 in every activation
    return gated_qlinear(a, b, w_fp8, w_scale, bias, e8m0, backend, activation, alpha, limit)


@fake(gated_linear)
def _(
    a, b, w, bias=None, e8m0=False, backend="reference", w_kn=False, activation="silu", alpha=1.702, limit=7.0
):
    _check_gated(a, b, activation)
    return a.new_empty(*a.shape[:-1], _weight_out_features(a, w, bias, w_kn))


@op
def gated_qlinear(
    a: Tensor,
    b: Tensor,
    w_fp8: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    e8m0: bool = False,
    backend: str = "reference",
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> Tensor:
    """gated_linear on the weight's FP8 copy, passed in (as qlinear is to linear)."""
    return kernels.implementation("gated_linear", backend)(
        a, b, w_fp8, w_scale, bias, e8m0, activation, alpha, limit
    )


@fake(gated_qlinear)
def _(
    a,
    b,
    w_fp8,
    w_scale,
    bias=None,
    e8m0=False,
    backend="reference",
    activation="silu",
    alpha=1.702,
    limit=7.0,
):
    _check_gated(a, b, activation)
    _check_linear_shapes(a, w_fp8, w_scale, bias)
    return a.new_empty(*a.shape[:-1], w_fp8.shape[0])


@op
def gated_qlinear_scaled(
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
    backend: str = "reference",
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> Tensor:
    """A gated MLP's down projection in the "tensor" or "rowwise" recipe: qlinear_scaled of
    act(a, b) (activations.gated), a (gate) and b (up) bf16 (..., K). The product is computed in
    fp32 and quantized with the recipe's scale in the same pass (inside the GEMM at decode
    sizes), never written in bf16 (reference_scaled.gated_linear_scaled)."""
    _check_gated(a, b, activation)
    _check_scaled_shapes(a, w_fp8, w_scale, bias, recipe, x_scale)
    return kernels.implementation("gated_scaled_linear", backend)(
        a, b, w_fp8, w_scale, bias, recipe, x_scale, amax_ub, e8m0, fast_accum, activation, alpha, limit
    )


@fake(gated_qlinear_scaled)
def _(
    a,
    b,
    w_fp8,
    w_scale,
    bias=None,
    x_scale=None,
    recipe="rowwise",
    amax_ub=0.0,
    e8m0=False,
    fast_accum=False,
    backend="reference",
    activation="silu",
    alpha=1.702,
    limit=7.0,
):
    _check_gated(a, b, activation)
    _check_scaled_shapes(a, w_fp8, w_scale, bias, recipe, x_scale)
    return a.new_empty(*a.shape[:-1], w_fp8.shape[0])
