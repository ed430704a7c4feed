"""Small/large-M dispatch: one call site of an FP8 op becomes a torch.cond on M whose two
branches call the op with the kernel the registry chose for each side, so one graph compiled
with dynamic M serves decode and prefill without recompiling.

Static M, batch-invariant mode, or small_m == 0 need one kernel only: no cond is emitted.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx

from .. import registry
from .context import PassContext


class NoDispatch(Exception):
    """This call site cannot get an M dispatch; the caller leaves it in bf16 with this reason."""


@dataclasses.dataclass(frozen=True)
class Side:
    label: str  # "M <= 32", "M > 32", "all M", "M = 7"
    kernel: str  # the registry backend whose kernel runs this side


def plan(ctx: PassContext, op: str, device: torch.device, n: int, k: int, m: Any) -> list[Side]:
    """Kernel per side of the dispatch. Raises (naming every reason) if a side has no kernel."""
    cfg = ctx.config
    base = registry.Request(op, device, n, k, batch_invariant=cfg.batch_invariant, e8m0=cfg.e8m0)
    if cfg.batch_invariant:
        ranges = [("all M", 1, None)]
    elif isinstance(m, int):
        ranges = [(f"M = {m}", m, m)]
    elif cfg.small_m == 0:
        ranges = [("all M", 1, None)]
    else:
        ranges = [(f"M <= {cfg.small_m}", 1, cfg.small_m), (f"M > {cfg.small_m}", cfg.small_m + 1, None)]
    return [
        Side(label, registry.choose(dataclasses.replace(base, m_min=lo, m_max=hi), cfg.backends))
        for label, lo, hi in ranges
    ]


def rows_node(ctx: PassContext, node: fx.Node):
    """M of a (..., K) tensor node viewed as (M, K): an int, or a node computing the SymInt."""
    rows = None
    for dim, size in enumerate(node.meta["val"].shape[:-1]):
        if isinstance(size, torch.SymInt):
            factor = ctx.gm.graph.call_function(torch.ops.aten.sym_size.int, (node, dim))
            factor.meta["val"] = size
        else:
            factor = size
        if rows is None:
            rows = factor
        elif isinstance(rows, int) and isinstance(factor, int):
            rows *= factor
        else:
            product = ctx.gm.graph.call_function(operator.mul, (rows, factor))
            product.meta["val"] = _val(rows) * _val(factor)
            rows = product
    return 1 if rows is None else rows


def _val(x):
    return x.meta["val"] if isinstance(x, fx.Node) else x


def flatten(ctx: PassContext, node: fx.Node) -> fx.Node:
    """node (..., K) as (M, K); the node itself when it is 2-D already."""
    val = node.meta["val"]
    if val.dim() == 2:
        return node
    rows = rows_node(ctx, node)
    flat = ctx.gm.graph.call_function(torch.ops.aten.reshape.default, (node, [rows, val.shape[-1]]))
    flat.meta["val"] = ctx.fake(torch.ops.aten.reshape.default, node, [_val(rows), val.shape[-1]])
    return flat


def _branch(ctx: PassContext, target, operands: list[fx.Node], args: tuple, kwargs: dict) -> fx.GraphModule:
    """GraphModule(*operands) -> (target(*args, **kwargs),) with operands as its placeholders."""
    graph = fx.Graph()
    inner = {}
    for i, node in enumerate(operands):
        inner[node] = graph.placeholder(f"arg{i}")
        inner[node].meta["val"] = node.meta["val"]
    call = graph.call_function(target, *fx.node.map_arg((args, kwargs), inner.__getitem__))
    call.meta["val"] = ctx.fake(target, *args, **kwargs)
    graph.output((call,))
    return fx.GraphModule(ctx.gm, graph)


def _symbol_operands(ctx: PassContext, operands: list[fx.Node]) -> list[fx.Node]:
    symbols = set()
    for node in operands:
        for size in node.meta["val"].shape:
            if isinstance(size, torch.SymInt):
                symbols |= size.node.expr.free_symbols
    bound = {}
    for node in ctx.gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt) and val.node.expr in symbols:
            bound.setdefault(val.node.expr, node)
    missing = symbols - bound.keys()
    if missing:
        raise NoDispatch(f"dynamic sizes {sorted(map(str, missing))} are not graph inputs (data-dependent?), "
                         "so no torch.cond over M can be built")
    return [bound[s] for s in sorted(bound, key=str)]


def emit(ctx: PassContext, target, args: tuple, kwargs: dict, m_source: fx.Node, sides: list[Side],
         name: str) -> fx.Node:
    """Insert target(*args, **kwargs, backend=...) at the current insertion point, dispatched on
    M = m_source.shape[0] when `sides` has a small and a large side. Returns the output node."""
    graph = ctx.gm.graph
    if len(sides) == 1:
        call_kwargs = {**kwargs, "backend": sides[0].kernel}
        node = graph.call_function(target, args, call_kwargs)
        node.meta["val"] = ctx.fake(target, *args, **call_kwargs)
        return node

    small, large = sides
    operands: list[fx.Node] = []  # the tensors the branches read, each once
    fx.node.map_arg((args, kwargs), lambda n: operands.append(n) if n not in operands else None)
    # Inductor codegens each branch as a function of its operands: the symbols in their shapes
    # (the dynamic M) must come in as operands too, as Dynamo does when it traces torch.cond.
    # Checked before anything is added to the graph, so NoDispatch leaves it as it was.
    operands = _symbol_operands(ctx, operands) + operands
    branches = []
    for side in (small, large):
        gm = _branch(ctx, target, operands, args, {**kwargs, "backend": side.kernel})
        attr = ctx.attr_name(f"{name}_{'small' if side is small else 'large'}_m")
        ctx.gm.add_submodule(attr, gm)
        branches.append(graph.get_attr(attr))

    m = rows_node(ctx, m_source)
    small_m = graph.call_function(operator.le, (m, ctx.config.small_m))
    small_m.meta["val"] = m.meta["val"] <= ctx.config.small_m
    cond = graph.call_function(torch.ops.higher_order.cond, (small_m, *branches, tuple(operands)))
    out_val = ctx.fake(target, *args, **{**kwargs, "backend": small.kernel})
    cond.meta["val"] = (out_val,)
    out = graph.call_function(operator.getitem, (cond, 0))
    out.meta["val"] = out_val
    return out
