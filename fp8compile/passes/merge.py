"""Linears that read one x -> one fp8compile::linear over their weights stacked along N.

k linears over the same x quantize x k times and run k GEMMs, each with a fraction of the N that
keeps the SMs busy at decode (a Llama-3-8B's k and v projections have N = 1024). Stacked (made
once, at compile time, in the weight memo), they are one GEMM: x quantized once, one launch,
and outside a CUDA graph one op's host cost instead of k. The (M, N1 + ... + Nk) output is
sliced back into the k outputs, which their users read as strided views (the dispatch's
stride contract, context.replace_uses). Used by gate_up (an MLP's gate and up) and qkv (any
group, q/k/v above all).

Every weight but the last must have whole 128-row blocks (no weight block spans two linears);
biases are stacked the same way, so a group merges only if all or none have one.
"""

from __future__ import annotations

import torch

from . import dispatch
from .context import PassContext
from .linear import LinearMatch, emit_fp8, fp8_weight_inputs, module_name, padded_k, registry_op
from ..weights import stacked_bias

aten = torch.ops.aten


def group_name(ctx: PassContext, matches: list[LinearMatch]) -> str:
    """The linears of a group, for the report: "model.layers.0.self_attn.q_proj|k_proj|v_proj"."""
    return joined_names(
        [module_name(param[1]) if (param := ctx.parameter(m.weight)) else m.weight.name for m in matches]
    )


def joined_names(names: list[str]) -> str:
    """Module names joined for the report, their common parent named once: "a.b.q|k|v"."""
    prefix = names[0].rpartition(".")[0]
    if prefix and all(name.rpartition(".")[0] == prefix for name in names):
        return prefix + "." + "|".join(name.rpartition(".")[2] for name in names)
    return "|".join(names)


def merge_linears(ctx: PassContext, matches: list[LinearMatch]) -> bool:
    """matches (same x, same weight layout, all or no biases; each a linear the linear pass would
    rewrite) -> one FP8 linear, output sliced back. False, graph unchanged, where a bias is no
    parameter or no M dispatch can be built (the linear pass then meets each linear on its own)."""
    params = [ctx.parameter(m.weight) for m in matches]
    names = [module_name(name) for _, name in params]
    head = matches[0]
    biases = [ctx.parameter(m.bias) for m in matches if m.bias is not None]
    if None in biases:
        return False  # a bias that is no parameter may change between calls: it cannot be stacked once
    op = registry_op(ctx, torch.ops.fp8compile.qlinear.default)
    if dispatch.gpu_why_not(ctx, op, head.weight.meta["val"].device) is not None:
        return False  # no stack of FP8 copies no kernel would read; each linear's skip says why
    # Both stacks are made now, at compile time (fp8_weight_inputs, derived_inputs): made at a
    # first call inside a CUDA graph's warm-up run instead, they would land in the graph's memory pool.
    fp8_weight_inputs(ctx, names[0], [m.weight for m in matches], head.transposed)
    bias = None
    if head.bias is not None:
        (bias,) = ctx.derived_inputs(
            ("bias",),
            (f"{names[0]}_bias_stacked",),
            [m.bias for m in matches],
            lambda b, *more: (stacked_bias(b, more),),
        )
    sizes = [m.weight.meta["val"].shape[1 if m.transposed else 0] for m in matches]
    order = {node: i for i, node in enumerate(ctx.gm.graph.nodes)}
    first = min(matches, key=lambda match: order[match.node])  # its x is defined before every matmul
    emitted = emit_fp8(
        ctx,
        head,
        names[0],
        "linear",
        torch.ops.fp8compile.qlinear.default,
        (first.x,),
        [m.weight for m in matches],
        bias,
        {},
        before=first.node,
        record_skip=False,
        names=names,
    )
    if emitted is None:
        return False
    out, sides, (n, k) = emitted
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    with ctx.gm.graph.inserting_before(first.node):
        parts = [
            ctx.gm.graph.call_function(aten.slice.Tensor, (out, 1, lo, lo + size))
            for lo, size in zip(offsets, sizes)
        ]
    for match, part in zip(matches, parts):  # erased after the inserts: first.node is their anchor
        part.meta["val"] = ctx.fake(aten.slice.Tensor, *part.args)
        ctx.replace_uses(match.node, part)
        ctx.gm.graph.erase_node(match.node)
    kernels = [(s.label, s.kernel) for s in sides]
    m = head.x.meta["val"].shape[0]
    for name, size in zip(names, sizes):
        others = ", ".join(o.rsplit(".", 1)[-1] for o in names if o != name)
        detail = ", ".join(filter(None, (f"one GEMM with {others}", padded_k(head, k))))
        ctx.rewrote("linear", name, m, size, k, kernels, detail=detail)
    return True
