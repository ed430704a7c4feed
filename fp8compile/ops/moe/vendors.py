"""Routed experts on DeepGEMM's grouped GEMMs: its contiguous layout (moe_deep_gemm) and, at decode
sizes, its masked layout (moe_deep_gemm_masked), with the contract of fp8compile::moe."""

from __future__ import annotations

import torch

from ...numerics import ceil_div
from ..activations import act_operands
from ..quant.triton_quant import empty_scales, quant_act
from ..vendors import require


def moe_deep_gemm(
    x,
    topk_ids,
    topk_weights,
    w13_fp8,
    w13_scale,
    w2_fp8,
    w2_scale,
    b13=None,
    b2=None,
    e8m0=False,
    activation="silu",
    alpha=1.702,
    limit=7.0,
    batch_invariant=False,
):
    """fp8compile::moe through DeepGEMM's m_grouped_fp8_gemm_nt_contiguous: the quantized tokens
    are gathered into the contiguous layout (each expert's rows padded to DeepGEMM's alignment,
    expert id per row, -1 on padding), both expert GEMMs run grouped, and the Triton top-k sum
    reads each slot's row back (fp32, slot order) with the routing weight and the down bias."""
    from .triton_moe import route, topk_sum

    deep_gemm = require("deep_gemm")
    t, k = topk_ids.shape
    num_experts, n13, _ = w13_fp8.shape
    s = t * k
    if s == 0:
        return x.new_zeros(x.shape)
    align = deep_gemm.get_mk_alignment_for_contiguous_layout()
    slots, block_expert = route(topk_ids, num_experts, align)
    is_slot = slots < s
    row_expert = torch.where(is_slot, block_expert.repeat_interleave(align), -1)
    x_fp8, x_scale = quant_act(x.contiguous(), e8m0, "row")
    token = torch.where(is_slot, slots, 0).long() // k
    a_scale = empty_scales(slots.numel(), x_scale.shape[1], "mn_major", x.device)
    a_scale.copy_(x_scale[token])
    c1 = torch.empty(slots.numel(), n13, dtype=torch.bfloat16, device=x.device)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous(
        (x_fp8[token], a_scale), (w13_fp8, w13_scale), c1, row_expert, disable_ue8m0_cast=True
    )
    del a_scale
    if b13 is not None:
        c1 += b13[row_expert.clamp(min=0).long()]
    gate, up = act_operands(c1, activation)
    h_fp8, h_scale = quant_act(gate, e8m0, "mn_major", b=up, activation=activation, alpha=alpha, limit=limit)
    # Every row of the layout, padding included (Qwen3-30B-A3B, a prompt of 1024 tokens: 24448
    # rows; c1 75 MB, c2 100 MB): c1 freed before c2 is made (as triton_moe.moe_triton does).
    del c1, gate, up
    c2 = torch.empty(slots.numel(), w2_fp8.shape[1], dtype=torch.bfloat16, device=x.device)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous(
        (h_fp8, h_scale), (w2_fp8, w2_scale), c2, row_expert, disable_ue8m0_cast=True
    )
    # Row of each slot in the contiguous layout (slots routed nowhere point at row 0 and are skipped).
    row_of_slot = torch.zeros(s + 1, dtype=torch.int32, device=x.device)
    row_of_slot.scatter_(
        0,
        torch.where(is_slot, slots, s).long(),
        torch.arange(slots.numel(), dtype=torch.int32, device=x.device),
    )
    return topk_sum(c2, topk_ids, topk_weights, num_experts, b2, rows=row_of_slot[:s], out_dtype=x.dtype)


def masked_layout(topk_ids: torch.Tensor, num_experts: int, max_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepGEMM's masked layout of a routing: (dest (S,) int64: the row of slot t * k + j in the
    flattened (E * max_m) buffer, expert e's rows from e * max_m on in slot order, and E * max_m,
    one row past them, for a slot of an expert outside [0, E) (another rank's); masked_m (E,)
    int32: the rows of each expert). Plain tensor ops that never read a value back to the host
    (unlike bincount or one_hot on CUDA), so a CUDA graph can hold them."""
    e = topk_ids.reshape(-1).long()
    hits = (e[:, None] == torch.arange(num_experts, device=e.device)[None, :]).int()  # (S, E)
    rank = hits.cumsum(0).gather(1, e.clamp(0, num_experts - 1)[:, None]).squeeze(1) - 1
    routed = (e >= 0) & (e < num_experts)
    dest = torch.where(routed, e * max_m + rank, num_experts * max_m)
    return dest, hits.sum(0).int()


# Tokens up to which the masked layout serves a call: its buffers hold max_m >= T rows per expert
# (the most one expert can get), E * max_m rows in all.
MASKED_MAX_TOKENS = 256
# An expert's block of rows is a multiple of this: with blocks of 4 or 16 rows DeepGEMM's masked
# kernel (sgl-deep-gemm 0.1.5, H100) gave wrong rows (calc_diff 0.06-0.74 against the Triton
# path), with 64, 128 and 256 the same numbers (1.5e-5; BENCHMARKS.md, "MoE layers").
MASKED_BLOCK_ROWS = 64


def moe_deep_gemm_masked(
    x,
    topk_ids,
    topk_weights,
    w13_fp8,
    w13_scale,
    w2_fp8,
    w2_scale,
    b13=None,
    b2=None,
    e8m0=False,
    activation="silu",
    alpha=1.702,
    limit=7.0,
    batch_invariant=False,
):
    """fp8compile::moe through DeepGEMM's fp8_m_grouped_gemm_nt_masked, for decode: each expert
    gets a block of max_m >= T rows (the most a routing can give it) and a count of the valid
    ones, so every shape depends on T alone and no value is read back: a CUDA graph holds the
    call. The quantized tokens are scattered into the blocks, both expert GEMMs run masked, the
    gated activation is quantized over the blocks, and the Triton top-k sum reads each slot's
    row back through dest."""
    from .triton_moe import topk_sum

    deep_gemm = require("deep_gemm")
    t, k = topk_ids.shape
    num_experts, n13, h = w13_fp8.shape
    if t == 0:
        return x.new_zeros(x.shape)
    max_m = ceil_div(t, MASKED_BLOCK_ROWS) * MASKED_BLOCK_ROWS
    rows = num_experts * max_m
    dest, masked_m = masked_layout(topk_ids, num_experts, max_m)
    token = torch.arange(t * k, device=x.device) // k
    x_fp8, x_scale = quant_act(x.contiguous(), e8m0, "row")
    a = torch.empty(rows + 1, h, dtype=x_fp8.dtype, device=x.device)  # + the row of unrouted slots
    a_scale = torch.empty(rows + 1, x_scale.shape[1], dtype=torch.float32, device=x.device)
    a[dest] = x_fp8[token]
    a_scale[dest] = x_scale[token]
    expected_m = max(1, ceil_div(t * k, num_experts))
    c1 = torch.empty(num_experts, max_m, n13, dtype=torch.bfloat16, device=x.device)
    deep_gemm.fp8_m_grouped_gemm_nt_masked(
        (a[:rows].view(num_experts, max_m, h), a_scale[:rows].view(num_experts, max_m, -1)),
        (w13_fp8, w13_scale),
        c1,
        masked_m,
        expected_m,
        disable_ue8m0_cast=True,
    )
    if b13 is not None:
        c1 += b13[:, None, :]
    gate, up = act_operands(c1.view(rows, n13), activation)
    h_fp8, h_scale = quant_act(gate, e8m0, "row", b=up, activation=activation, alpha=alpha, limit=limit)
    c2 = torch.empty(num_experts, max_m, w2_fp8.shape[1], dtype=torch.bfloat16, device=x.device)
    deep_gemm.fp8_m_grouped_gemm_nt_masked(
        (h_fp8.view(num_experts, max_m, -1), h_scale.view(num_experts, max_m, -1)),
        (w2_fp8, w2_scale),
        c2,
        masked_m,
        expected_m,
        disable_ue8m0_cast=True,
    )
    return topk_sum(
        c2.view(rows, -1), topk_ids, topk_weights, num_experts, b2, rows=dest.int(), out_dtype=x.dtype
    )
