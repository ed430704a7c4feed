"""checkpoint_experts pass: an FP8 checkpoint's routed experts, as transformers loads them, onto
fp8compile's MoE op with the checkpoint's own weights and scales.

Dynamo traces the `FP8Experts` fp8compile serves as fp8compile::checkpoint_experts
(checkpoints.py): 128x128 weight blocks, dynamic activation scales, gate and up stacked (gate
rows first), a silu. That is the block recipe's MoE, whose op (fp8compile::moe) reads the FP8
copies of a bf16 model's experts from the weight memo; here the checkpoint's weights are those
copies (weights.register_fp8_experts), so the op runs behind the same token-count dispatch on
every kernel the MoE fusion has (decode, grouped, DeepGEMM), with no requantization and no copy
of the weights. Under the moe fusion; what it does not take keeps the op, whose kernel is the
block recipe's reference MoE, with the reason.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .. import weights
from ..numerics import BLOCK, FP8_DTYPE
from . import dtypes
from .context import PassContext
from .moe import MoeMatch, NoMatch, block_name, moe_replacement

TARGET = torch.ops.fp8compile.checkpoint_experts.default
DETAIL = "FP8 checkpoint: its experts' weights and 128x128 block scales, in place"


def why_not(ctx: PassContext, node: fx.Node) -> str | None:
    """Why these checkpoint experts keep the op, or None."""
    x, _, _, w13, s13, w2, s2 = node.args
    if ctx.config.recipe != "block":
        return f"routed experts have FP8 kernels in the block recipe only (recipe={ctx.config.recipe!r})"
    if any(ctx.parameter(n) is None for n in (w13, s13, w2, s2)):
        return "its FP8 weights or scales are not parameters of the model"
    if (why := dtypes.why_not({x.meta["val"].dtype}, "experts")) is not None:
        return why
    e, n13, h = w13.meta["val"].shape
    inter = w2.meta["val"].shape[2]
    if h % BLOCK or inter % BLOCK or n13 != 2 * inter:
        return (
            f"experts ({e}, {n13}, {h}), ({e}, {h}, {inter}): hidden and intermediate sizes are not "
            "whole 128-blocks, with gate and up rows stacked"
        )
    for w, s in ((w13, s13), (w2, s2)):
        rows, cols = w.meta["val"].shape[1:]
        if w.meta["val"].dtype != FP8_DTYPE or tuple(s.meta["val"].shape) != (
            e,
            rows // BLOCK,
            cols // BLOCK,
        ):
            return f"scales {tuple(s.meta['val'].shape)} for FP8 weights {tuple(w.meta['val'].shape)}"
    if (found := {dtypes.name(s.meta["val"].dtype) for s in (s13, s2)}) != {"float32"}:
        return f"scales in {', '.join(sorted(found))}, not fp32"
    return None


def rewrite(ctx: PassContext, node: fx.Node, name: str) -> str | None:
    """node -> fp8compile::moe behind the dispatch, or the reason it stays."""
    if (why := why_not(ctx, node)) is not None:
        return why
    x, topk_ids, topk_weights, w13, s13, w2, s2 = node.args
    for w, s in ((w13, s13), (w2, s2)):
        weights.register_fp8_experts(ctx.parameter(w)[0], ctx.parameter(s)[0])
    match = MoeMatch(x, topk_ids, topk_weights, node, w13, None, w2, None, None, "concat", {})
    e, _, h = w13.meta["val"].shape
    try:
        moe_replacement(ctx, match, e, w2.meta["val"].shape[2], h, False, name)
    except NoMatch as reason:
        return str(reason)
    done = ctx.report.rewrites[-1]
    ctx.report.rewrites[-1] = dataclasses.replace(done, detail=f"{done.detail}, {DETAIL}")
    return None


def checkpoint_experts_pass(ctx: PassContext) -> None:
    for node in list(ctx.gm.graph.find_nodes(op="call_function", target=TARGET)):
        w2 = node.args[5]
        name = block_name(ctx, w2) if ctx.parameter(w2) is not None else w2.name
        shape = "x".join(map(str, w2.meta["val"].shape))
        if "moe" not in ctx.config.fusions:
            ctx.skipped("moe", name, "the moe fusion is off (Fp8Config.fusions)", shape)
            continue
        reason = ctx.at_site(name, lambda node=node, name=name: rewrite(ctx, node, name))
        if reason is not None:
            ctx.skipped("moe", name, reason, shape)
