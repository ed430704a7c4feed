"""Routed experts in pure PyTorch: in FP8 over the block recipe's linears (moe_block, what every
MoE kernel is tested against), and unquantized in fp32 (moe_dense, what the moe pass checks the
blocks it matches against)."""

from __future__ import annotations

import torch

from ..activations import expert_activation
from ..linear.reference import linear_block


def _routed(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, expert
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert(topk_ids[t, j], x[t]) in fp32, written in x.dtype; slots
    routed outside [0, num_experts) (expert-parallel sentinels) contribute nothing."""
    t, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    token = torch.arange(t * k, device=x.device) // k
    out = None
    for e in flat_ids.unique().tolist():
        if not 0 <= e < num_experts:
            continue
        slots = (flat_ids == e).nonzero().squeeze(1)
        y = expert(e, x[token[slots]]) * topk_weights.reshape(-1)[slots, None].float()
        if out is None:
            out = torch.zeros(t * k, y.shape[1], dtype=torch.float32, device=x.device)
        out[slots] = y
    if out is None:
        return x.new_zeros(t, x.shape[1])
    return out.reshape(t, k, -1).sum(dim=1).to(x.dtype)


def moe_block(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_fp8: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_fp8: torch.Tensor,
    w2_scale: torch.Tensor,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    e8m0: bool = False,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Routed experts in FP8: out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]).

    x (T, H); topk_ids, topk_weights (T, k); w13_fp8 (E, 2I, H) gate rows then up rows (or
    (E, I, H), up rows alone, for a non-gated activation), w2_fp8 (E, H, I), scales (E, N/128,
    K/128); biases (E, 2I), (E, H). An expert is down(act(gate(x), up(x))), or down(act(up(x))):
    each GEMM quantizes its input 1x128 per token; gate|up (+ bias) is
    written in bfloat16, as every grouped GEMM writes it (ours, and DeepGEMM's, whose only output
    dtype it is), whatever x.dtype: a float16 model's experts round there to bfloat16, 8 bits
    of mantissa before the activation's FP8 quantization keeps 3 (and bfloat16's range, not
    float16's 65504). The activation runs in fp32 from there. Every slot is computed on its own,
    so the result for a token never depends on the others (batch-invariant whatever the flag says).
    """

    def expert(e, xs):
        h = linear_block(xs, w13_fp8[e], w13_scale[e], None, e8m0, torch.float32)
        if b13 is not None:
            h = h + b13[e].float()
        h = h.to(torch.bfloat16)
        y = linear_block(
            expert_activation(h, activation, alpha, limit),
            w2_fp8[e],
            w2_scale[e],
            None,
            e8m0,
            torch.float32,
        )
        return y if b2 is None else y + b2[e].float()

    return _routed(x, topk_ids, topk_weights, w13_fp8.shape[0], expert)


def moe_dense(
    x, topk_ids, topk_weights, w13, w2, b13=None, b2=None, activation="silu", alpha=1.702, limit=7.0
):
    """The same routed experts without quantization, in fp32: w13 (E, 2I, H) gate rows then up
    rows (or (E, I, H) for a non-gated activation), w2 (E, H, I). What an MoE block computes; the
    moe pass checks its matches against it."""

    def expert(e, xs):
        h = xs.float() @ w13[e].float().T
        if b13 is not None:
            h = h + b13[e].float()
        y = expert_activation(h, activation, alpha, limit) @ w2[e].float().T
        return y if b2 is None else y + b2[e].float()

    return _routed(x, topk_ids, topk_weights, w13.shape[0], expert)
