"""The registered FP8 MoE op (torch.library, ops/library.py) with its fake (meta) implementation:
routed experts over the model's stacked expert weights, whose FP8 copies the compiler made. The
kernel is the backend's its `backend` argument names (ops/kernels.py)."""

from __future__ import annotations

import torch
from torch import Tensor

from ...weights import GATE_UP_LAYOUTS, expert_bias, fp8_experts
from .. import kernels
from .. import activations
from ..library import fake, op


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
    valid = activations.UNARY_ACTIVATIONS if gate_up == "none" else activations.GATED_ACTIVATIONS
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
