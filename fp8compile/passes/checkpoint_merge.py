"""An FP8 checkpoint's linears that read one x (an attention's q|k|v, an MLP's gate|up) -> one
fp8compile::qlinear over their weights stacked along N, in place.

Three checkpoint linears over one x are three GEMMs, the narrow k and v projections leaving most
SMs idle at decode; on a Llama-3-8B checkpoint they and the separate gate and up took a decode
step from 4.68 ms (the bf16 model's merged FP8 graph) to 5.59 ms (H200, BENCHMARKS.md). Merged,
as passes/merge.py merges a bf16 model's, they are one GEMM and one launch. The stacked weight is
the checkpoint's own, not a copy beside it: stacking.py points each weight at its rows of the
stack, so the model holds its FP8 bytes once. The scales are stacked as an fp32 copy (a 4096th
of the weights' bytes).

A group: checkpoint linears over one x (through views) that the checkpoint pass would rewrite on
their own (checkpoint_linear.why_not), of one K, one scale dtype, all with a bias or none, each
of whole 128-row blocks but the last (no weight block spans two linears). gate|up (the a and b
of a gated product) merges under the gate_up fusion, any other group under qkv. Runs before the
checkpoint pass meets the rest one by one; a group that cannot merge goes back to it.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .. import stacking
from ..numerics import BLOCK
from ..weights import stacked_bias
from . import dispatch
from .checkpoint_linear import DETAIL, TARGET, arguments, site_name, why_not
from .context import PassContext
from .merge import joined_names
from .silu_mul import _CASTS, _VIEWS, _strip, silu_mul_pattern

aten = torch.ops.aten


def groups(ctx: PassContext, nodes: list[fx.Node], names: dict[fx.Node, str]) -> list[list[fx.Node]]:
    """The mergeable groups among checkpoint_linear nodes (two or more each), in graph order."""
    by_x: dict[tuple, list[fx.Node]] = {}
    for node in nodes:
        a = arguments(node)
        if why_not(ctx, a, names[node]) is not None:
            continue  # the checkpoint pass says why, on its own
        x, weight, scale = a["x"], a["weight"].meta["val"], a["weight_scale_inv"].meta["val"]
        key = (_strip(x, _VIEWS), str(x.meta["val"].shape), weight.shape[1], scale.dtype, a["bias"] is None)
        by_x.setdefault(key, []).append(node)
    pairs = _gated_pairs(nodes)
    found = []
    for group in by_x.values():
        seen, whole, partial = set(), [], []
        for node in group:
            weight = arguments(node)["weight"]
            if weight not in seen:  # a weight read twice over one x is one GEMM already
                seen.add(weight)
                (partial if weight.meta["val"].shape[0] % BLOCK else whole).append(node)
        group = whole + partial[:1]
        fusion = "gate_up" if frozenset(group) in pairs else "qkv"
        if len(group) > 1 and fusion in ctx.config.fusions:
            found.append(group)
    return found


def _gated_pairs(nodes: list[fx.Node]) -> set[frozenset]:
    """{gate, up} for each gated product act(gate(x), up(x)) a checkpoint linear reads."""
    pairs = set()
    for node in nodes:
        found = silu_mul_pattern(arguments(node)["x"])
        if isinstance(found, tuple):
            pairs.add(frozenset(_strip(h, _VIEWS + _CASTS) for h in found[:2]))
    return pairs


def merge(ctx: PassContext, group: list[fx.Node], names: list[str]) -> bool:
    """group -> one qlinear behind the M dispatch over the stacked weights, its output sliced back
    into each node's. False, graph unchanged but for unused inputs, where no dispatch is built."""
    args = [arguments(node) for node in group]
    weight = args[0]["weight"].meta["val"]
    device, dtype, k = weight.device, args[0]["x"].meta["val"].dtype, weight.shape[1]
    if dispatch.gpu_why_not(ctx, "linear", device) is not None:
        return False  # each linear on its own says why
    sizes = [a["weight"].meta["val"].shape[0] for a in args]
    (stack,) = ctx.derived_inputs(
        ("checkpoint_stack",), (f"{names[0]}_stacked",), [a["weight"] for a in args], stacking.stack_in_place
    )
    (scales,) = ctx.derived_inputs(
        ("checkpoint_stack_scales",),
        (f"{names[0]}_scales_stacked",),
        [a["weight_scale_inv"] for a in args],
        _stacked_fp32,
    )
    bias = None
    if args[0]["bias"] is not None:
        (bias,) = ctx.derived_inputs(
            ("bias",),
            (f"{names[0]}_bias_stacked",),
            [a["bias"] for a in args],
            lambda b, *more: (stacked_bias(b, more),),
        )
    e8m0 = ctx.config.e8m0 or args[0]["weight_scale_inv"].meta["val"].dtype != torch.float32
    order = {node: i for i, node in enumerate(ctx.gm.graph.nodes)}
    first = min(group, key=order.__getitem__)  # its x is defined before every one of them
    x = arguments(first)["x"]
    with ctx.gm.graph.inserting_before(first):
        flat = dispatch.flatten(ctx, x)
        m = flat.meta["val"].shape[0]
        try:
            sides = dispatch.plan(ctx, "linear", device, sum(sizes), k, m, dtype)
            out = dispatch.emit(
                ctx,
                torch.ops.fp8compile.qlinear.default,
                (flat, stack, scales, bias),
                {"e8m0": e8m0},
                m_source=flat,
                sides=sides,
                name=names[0],
            )
        except dispatch.NoDispatch:
            return False
        parts = []
        for lo, size in zip([sum(sizes[:i]) for i in range(len(sizes))], sizes):
            part = ctx.gm.graph.call_function(aten.slice.Tensor, (out, 1, lo, lo + size))
            part.meta["val"] = ctx.fake(aten.slice.Tensor, *part.args)
            parts.append(dispatch.unflatten(ctx, part, x, size))
    for node, part in zip(group, parts):
        ctx.replace_uses(node, part)
        ctx.gm.graph.erase_node(node)
    kernels = [(s.label, s.kernel) for s in sides]
    for name, size in zip(names, sizes):
        others = ", ".join(other.rsplit(".", 1)[-1] for other in names if other != name)
        ctx.rewrote("linear", name, m, size, k, kernels, detail=f"one GEMM with {others}, {DETAIL}")
    return True


def _stacked_fp32(*scales: torch.Tensor) -> tuple[torch.Tensor]:
    with unset_fake_temporarily(), torch.no_grad():  # made while compiling, then per changed call
        return (torch.cat([s.float() for s in scales]),)


def checkpoint_merge_pass(ctx: PassContext) -> None:
    nodes = list(ctx.gm.graph.find_nodes(op="call_function", target=TARGET))
    names = {node: site_name(ctx, node) for node in nodes}
    for group in groups(ctx, nodes, names):
        members = [names[node] for node in group]
        ctx.at_site(joined_names(members), lambda group=group, members=members: merge(ctx, group, members))
