"""all_reduce_norm pass: fp8compile's all-reduce (passes/all_reduce.py), the residual add that
reads it and the RMSNorm of that sum -> fp8compile::all_reduce_rms_norm, one kernel on symmetric
memory that pushes each rank's row to its peers (ops/collectives/triton_push.py).

In a tensor-parallel decoder every o and down projection's partial product is summed over the
ranks, added to the residual stream, and the sum normalized for the next layer's projections:

    r = fp8compile.all_reduce(x, group)     s = add(residual, r)     f = convert(s, float32)
    n = f * rsqrt(mean(f ** 2, -1, keepdim) + eps)     out = weight * convert(n, dtype)

(transformers' RMSNorm: Llama, Qwen, Mistral and their like). The rewrite puts
    a = fp8compile.all_reduce_rms_norm(x, residual, weight, eps, group)
in its place: out is a[0] and s, which the next residual add reads, a[1].

It runs where its kernel serves the graph's sizes, so that no call falls back to running the
arithmetic eagerly after the all-reduce, slower than Inductor's one kernel: the rows a known
number (a graph per batch size), no more of them than the GPU has multiprocessors, what a rank
takes in within the one-shot kernel's sizes, and the group's push buffers made. Elsewhere (a
graph of symbolic rows, a prefill past those sizes, CPU tensors, no symmetric memory) the report
says why, and the three stay.
A norm of another form (Gemma's 1 + weight, a bias, a LayerNorm) is not matched.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..ops.collectives import op as collectives
from .context import PassContext

aten, prims = torch.ops.aten, torch.ops.prims


@dataclass
class Site:
    all_reduce: fx.Node
    add: fx.Node  # residual + all_reduce
    residual: fx.Node
    chain: list[fx.Node]  # the RMSNorm's nodes, the upcast first and the weight's multiply last
    weight: fx.Node
    eps: float


def all_reduce_norm_pass(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    found = [
        n
        for n in graph.nodes
        if n.op == "call_function" and n.target is torch.ops.fp8compile.all_reduce.default
    ]
    sites, reasons = 0, {}
    for node in found:  # matched one at a time: a rewrite gives the next site its residual
        site = match(node)
        if site is None:
            continue
        sites += 1
        reason = kernel_refuses(site)
        if reason is None:
            _rewrite(ctx, site)
        else:
            reasons[reason] = reasons.get(reason, 0) + 1
    if not sites:
        return
    fused = sites - sum(reasons.values())
    words = f"{fused} of {sites} all-reduces with the residual add and RMSNorm after them in one kernel"
    if reasons:
        words += "; the rest as they were: " + "; ".join(f"{n}: {r}" for r, n in reasons.items())
    ctx.report.all_reduce_paths[f"graph {ctx.graph_index}, with the RMSNorm after"] = words


def match(all_reduce: fx.Node) -> Site | None:
    """The residual add and RMSNorm that read this all-reduce, if that is what follows it."""
    users = list(all_reduce.users)
    if len(users) != 1 or users[0].target is not aten.add.Tensor or users[0].kwargs:
        return None
    add = users[0]
    residual = next((a for a in add.args if a is not all_reduce), None)
    if not isinstance(residual, fx.Node) or _val(residual).shape != _val(all_reduce).shape:
        return None
    dtype = _val(add).dtype
    if _val(residual).dtype != dtype or len(add.args) != 2 or add.args.count(all_reduce) != 1:
        return None
    ups = [u for u in add.users if _cast_to(u, torch.float32)]
    if len(ups) != 1 or len(ups[0].users) != 2:
        return None
    up = ups[0]
    square = _only(up.users, lambda n: n.target is aten.pow.Tensor_Scalar and n.args[1:] == (2,))
    if square is None:
        return None
    mean = _single_user(square)
    if mean is None or mean.target is not aten.mean.dim or not _last_dim_kept(mean, _val(up).dim()):
        return None
    plus_eps = _single_user(mean)
    if plus_eps is None or plus_eps.target is not aten.add.Tensor or not isinstance(plus_eps.args[1], float):
        return None
    root = _single_user(plus_eps)
    if root is None or root.target is not aten.rsqrt.default:
        return None
    scaled = _single_user(root)
    if scaled is None or scaled.target is not aten.mul.Tensor or set(scaled.args) != {up, root}:
        return None
    down = _single_user(scaled)
    if down is None or not _cast_to(down, dtype):
        return None
    out = _single_user(down)
    if out is None or out.target is not aten.mul.Tensor or len(out.args) != 2 or down not in out.args:
        return None
    weight = out.args[1] if out.args[0] is down else out.args[0]
    h = _val(add).shape[-1]
    if not isinstance(weight, fx.Node) or tuple(_val(weight).shape) != (h,) or _val(weight).dtype != dtype:
        return None
    return Site(
        all_reduce,
        add,
        residual,
        [up, square, mean, plus_eps, root, scaled, down, out],
        weight,
        plus_eps.args[1],
    )


def kernel_refuses(site: Site) -> str | None:
    """None where fp8compile::all_reduce_rms_norm's kernel serves the site at every call, else why not."""
    x = _val(site.all_reduce.args[0])
    rows = x.numel() // x.shape[-1] if x.dim() else 1
    if not isinstance(rows, int) or not isinstance(x.shape[-1], int):
        return "the rows are not a known number (a graph per batch size has them)"
    with unset_fake_temporarily():  # a buffer not made yet is made now, of real memory
        return collectives.push_refuses(rows, x.shape[-1], x.dtype, x.device, site.all_reduce.args[1])


def _rewrite(ctx: PassContext, site: Site) -> None:
    graph, (x, group_name) = ctx.gm.graph, site.all_reduce.args[:2]
    target = torch.ops.fp8compile.all_reduce_rms_norm.default
    args = (x, site.residual, site.weight, site.eps, group_name)
    with graph.inserting_before(site.add):
        fused = graph.call_function(target, args)
        normed = graph.call_function(operator.getitem, (fused, 0))
        summed = graph.call_function(operator.getitem, (fused, 1))
    fused.meta["val"] = ctx.fake(target, *args)
    for i, node in enumerate((normed, summed)):
        node.meta["val"] = fused.meta["val"][i]
    for node in (fused, normed, summed):  # where it came from, for the graph dumps
        node.meta.update(
            {k: site.add.meta[k] for k in ("stack_trace", "nn_module_stack") if k in site.add.meta}
        )
    out = site.chain[-1]
    out.replace_all_uses_with(normed)
    for node in reversed(site.chain):
        graph.erase_node(node)
    site.add.replace_all_uses_with(summed)
    graph.erase_node(site.add)
    graph.erase_node(site.all_reduce)


def _val(node: fx.Node):
    return node.meta["val"]


def _cast_to(node: fx.Node, dtype: torch.dtype) -> bool:
    if node.target is prims.convert_element_type.default:
        return node.args[1] == dtype
    if node.target is aten._to_copy.default:
        return node.kwargs.get("dtype") == dtype and set(node.kwargs) <= {"dtype"}
    return False


def _single_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _only(nodes, want) -> fx.Node | None:
    chosen = [n for n in nodes if want(n)]
    return chosen[0] if len(chosen) == 1 else None


def _last_dim_kept(mean: fx.Node, ndim: int) -> bool:
    dims = mean.args[1] if len(mean.args) > 1 else mean.kwargs.get("dim")
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    return keepdim and list(dims or []) in ([-1], [ndim - 1]) and "dtype" not in mean.kwargs
