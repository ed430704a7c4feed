"""The registered FP8 ops of linears, gated linears and MoE blocks, and the activation's
quantization (torch.library, ops/library.py), each with its fake (meta) implementation below it.

The real implementation of each op is the kernel of the backend its `backend` argument names
(ops/kernels.py); the pass fixes that choice at compile time, so the graph says which kernel
runs. Weight quantization runs once, at compile time, and has only the reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..numerics import BLOCK, FP8_DTYPE, ceil_div, whole_blocks
from ..weights import GATE_UP_LAYOUTS, expert_bias, fp8_experts, fp8_weight, stacked_bias
from . import kernels, reference, reference_scaled
from .library import fake, op


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
    return reference.quant_weight_block(w, e8m0)


@fake(quant_weight)
def _(w: Tensor, e8m0: bool = False) -> tuple[Tensor, Tensor]:
    n, k = w.shape[0], whole_blocks(w.shape[1])
    return w.new_empty(n, k, dtype=FP8_DTYPE), w.new_empty(
        ceil_div(n, BLOCK), k // BLOCK, dtype=torch.float32
    )


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
    x = reference.pad_k(x, w_fp8.shape[1])  # a K of part of a group: zero columns, as in the copy
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
        activation in reference.GATED_ACTIVATIONS,
        lambda: f"activation {activation!r}: valid gated activations are {reference.GATED_ACTIVATIONS}",
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

    act is "silu" (silu(a) * b), "swigluoai" (GPT-OSS: clamped, alpha, (b + 1)) or "silu_limit"
    (DeepSeek-V4: silu(a) * b with a and b clamped); see reference.gated. It is computed in fp32
    and quantized 1x128 in the same pass (inside the GEMM for the decode kernel): the bf16
    product is never written, never quantized twice.
    """
    w_fp8, w_scale = fp8_weight(w, w_kn, e8m0)
    a, b = (reference.pad_k(t, w_fp8.shape[1]) for t in (a, b))  # act(0, 0) = 0 in every activation
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
    act(a, b) (reference.gated), a (gate) and b (up) bf16 (..., K). The product is computed in
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


def _check_moe_args(x, topk_ids, topk_weights, w13, w2, w3, b13, w_kn, gate_up, activation) -> None:
    torch._check(
        x.dim() == 2
        and topk_ids.dim() == 2
        and topk_ids.shape == topk_weights.shape
        and topk_ids.shape[0] == x.shape[0],
        lambda: (
            f"moe needs x (T, H), topk_ids and topk_weights (T, k); got {tuple(x.shape)}, "
            f"{tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}"
        ),
    )
    torch._check(
        gate_up in GATE_UP_LAYOUTS, lambda: f"gate_up {gate_up!r}: valid layouts are {GATE_UP_LAYOUTS}"
    )
    torch._check(
        (w3 is not None) == (gate_up == "separate") and not (w3 is not None and b13 is not None),
        lambda: "w3 (the up projection) is given exactly when gate_up is 'separate', and then without b13",
    )
    valid = reference.UNARY_ACTIVATIONS if gate_up == "none" else reference.GATED_ACTIVATIONS
    torch._check(
        activation in valid,
        lambda: (
            f"activation {activation!r} with gate_up {gate_up!r}: valid "
            f"{'non-gated' if gate_up == 'none' else 'gated'} activations are {valid}"
        ),
    )
    hidden = w2.shape[2] if w_kn else w2.shape[1]
    torch._check(
        w13.dim() == 3
        and w2.dim() == 3
        and x.shape[1] == (w13.shape[1] if w_kn else w13.shape[2])
        and hidden == x.shape[1],
        lambda: (
            f"expert weights {tuple(w13.shape)}, {tuple(w2.shape)} (w_kn={w_kn}) "
            f"do not fit x {tuple(x.shape)}"
        ),
    )


@op
def moe(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w13: Tensor,
    w2: Tensor,
    w3: Tensor | None = None,
    b13: Tensor | None = None,
    b2: Tensor | None = None,
    e8m0: bool = False,
    backend: str = "reference",
    w_kn: bool = False,
    gate_up: str = "concat",
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    batch_invariant: bool = False,
) -> Tensor:
    """Routed experts in FP8: x (T, H) -> sum_j topk_weights[:, j] * expert_{topk_ids[:, j]}(x), (T, H).

    An expert is down(act(gate(x), up(x))) over the stacked bf16 parameters: w13 (E, 2I, H) with
    gate/up rows as `gate_up` says ("concat", "interleave"; or "separate": w13 is gate (E, I, H)
    and w3 is up), w2 (E, H, I); with gate_up "none" and a non-gated activation ("relu2"), an
    expert is down(act(up(x))), w13 the up projection (E, I, H); both stored transposed if
    w_kn. Biases b13 (E, 2I), b2 (E, H). Their FP8 copies (128x128 blocks per expert) come from
    the memo the compiler filled. Router and top-k stay outside: topk_ids (T, k) int,
    topk_weights (T, k); an id outside [0, E) adds nothing. batch_invariant asks the kernel for
    one tiling whatever T is.
    """
    _check_moe_args(x, topk_ids, topk_weights, w13, w2, w3, b13, w_kn, gate_up, activation)
    w13_fp8, w13_scale = fp8_experts(w13, w_kn, e8m0, gate_up, w3)
    w2_fp8, w2_scale = fp8_experts(w2, w_kn, e8m0)
    return kernels.implementation("moe", backend)(
        x,
        topk_ids,
        topk_weights,
        w13_fp8,
        w13_scale,
        w2_fp8,
        w2_scale,
        expert_bias(b13, gate_up),
        b2,
        e8m0,
        activation,
        alpha,
        limit,
        batch_invariant,
    )


@fake(moe)
def _(
    x,
    topk_ids,
    topk_weights,
    w13,
    w2,
    w3=None,
    b13=None,
    b2=None,
    e8m0=False,
    backend="reference",
    w_kn=False,
    gate_up="concat",
    activation="silu",
    alpha=1.702,
    limit=7.0,
    batch_invariant=False,
):
    _check_moe_args(x, topk_ids, topk_weights, w13, w2, w3, b13, w_kn, gate_up, activation)
    return x.new_empty(x.shape)
