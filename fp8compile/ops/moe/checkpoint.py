"""The routed experts of an FP8 checkpoint as transformers loads them (its `FP8Experts`, from
`FineGrainedFP8Config`), as one op a traced graph can hold: fp8compile::checkpoint_experts.

transformers runs them through an implementation it picks per model (grouped_mm, batched_mm,
deepgemm), each a kernel it loads from the Hub at its first call; Dynamo cannot trace that
choice, and where none loads (the CPU, a machine offline) tracing fails. fp8compile/checkpoints.py
has Dynamo trace this op in its place for the experts fp8compile serves: 128x128 weight blocks,
dynamic activation scales, a gated silu, no bias. Their computation is the block recipe's MoE
(ops/moe/reference.py, moe_block) on the checkpoint's own FP8 weights and scales, which is this
op's kernel; passes/checkpoint_experts.py puts it on fp8compile's MoE op behind the token-count
dispatch. Eager calls are untouched: they run transformers' implementation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..library import fake, op
from .reference import moe_block


@op
def checkpoint_experts(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    gate_up_proj: Tensor,
    gate_up_proj_scale_inv: Tensor,
    down_proj: Tensor,
    down_proj_scale_inv: Tensor,
) -> Tensor:
    """x (T, H) through the experts topk_ids (T, k) name, weighted by topk_weights: gate_up_proj
    (E, 2I, H) e4m3fn, gate rows then up rows, down_proj (E, H, I), each with one fp32 or UE8M0
    scale a 128x128 block (E, 2I/128, H/128), (E, H/128, I/128) -> (T, H) in x's dtype."""
    e8m0 = gate_up_proj_scale_inv.dtype != torch.float32
    out = moe_block(
        x,
        topk_ids,
        topk_weights,
        gate_up_proj,
        gate_up_proj_scale_inv.float(),
        down_proj,
        down_proj_scale_inv.float(),
        e8m0=e8m0,
    )
    return out.to(x.dtype)


@fake(checkpoint_experts)
def _(x, topk_ids, topk_weights, gate_up_proj, gate_up_proj_scale_inv, down_proj, down_proj_scale_inv):
    torch._check(
        x.dim() == 2 and topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == x.shape[0],
        lambda: f"x (T, H), topk_ids and topk_weights (T, k); got {tuple(x.shape)}, {tuple(topk_ids.shape)}",
    )
    torch._check(
        gate_up_proj.shape[2] == x.shape[1] == down_proj.shape[1],
        lambda: (
            f"experts {tuple(gate_up_proj.shape)}, {tuple(down_proj.shape)} do not fit x {tuple(x.shape)}"
        ),
    )
    return x.new_empty(x.shape)
