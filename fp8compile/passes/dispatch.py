"""M dispatch: one call site of an FP8 op becomes a torch.cond on M whose branches call the
op with the kernel the registry chose for each range of M, so one graph compiled with dynamic M
serves decode, mid-size batches and prefill without recompiling.

Ranges: M <= small_m (decode), small_m < M <= large_m, M > large_m (large_m by the output width
unless set: Fp8Config.large_m_for), or, with autotune, the
ranges where measurement found one kernel fastest (autotune.py); n ranges are n - 1 nested
conds. Adjacent ranges that get the same kernel merge, so a site whose ranges all get one
kernel (static M, batch-invariant mode, a single backend) has no cond at all.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx

from .. import autotune, registry
from . import inline
from .context import PassContext
from .trace import signature


def op_kwargs(kwargs: dict) -> dict:
    """kwargs as the op itself takes them: without inline.LAUNCH_OPERANDS, operands only a traced
    launch of one side reads, which ride along as operands of the conds."""
    return {key: value for key, value in kwargs.items() if key != inline.LAUNCH_OPERANDS}


class NoDispatch(Exception):
    """This call site cannot get an M dispatch; the caller leaves it in bf16 with this reason."""


@dataclasses.dataclass(frozen=True)
class Side:
    label: str  # "M <= 32", "32 < M <= 1536", "M > 1536", "all M", "M = 7"
    kernel: str  # the registry backend whose kernel runs this side
    m_max: int | None = None  # the side serves M <= m_max (None: unbounded)
    m_min: int = 1  # and M >= m_min


def _label(lo: int, hi: int | None) -> str:
    if lo == hi:
        return f"M = {lo}"
    if lo == 1:
        return "all M" if hi is None else f"M <= {hi}"
    return f"M > {lo - 1}" if hi is None else f"{lo - 1} < M <= {hi}"


def ranges(config, m: Any, n: int) -> list[tuple[str, int, int | None]]:
    """(tier, m_min, m_max) of each range of M a call site with N outputs needs a kernel for; tier
    names the registry's default order for that range. Raises NoDispatch for a static M of 0."""
    if config.batch_invariant:
        return [("large", 1, None)]
    bounds = [
        (b, tier) for b, tier in ((config.small_m, "small"), (config.large_m_for(n), "medium")) if b > 0
    ]
    out, lo = [], 1
    for b, tier in bounds:
        out.append((tier, lo, b))
        lo = b + 1
    out.append(("large", lo, None))
    if isinstance(m, int) and m < 1:  # Dynamo specialises an empty input: no kernel to pick
        raise NoDispatch(f"M = {m}: an empty input, nothing for an FP8 kernel to compute")
    if isinstance(m, int):  # static M: the one range it falls in
        tier = next(t for t, a, b in out if a <= m and (b is None or m <= b))
        return [(tier, m, m)]
    return out


def plan(
    ctx: PassContext,
    op: str,
    device: torch.device,
    n: int,
    k: int,
    m: Any,
    dtype: torch.dtype = torch.bfloat16,
) -> list[Side]:
    """Kernel per range of M, adjacent ranges with the same kernel merged (dtype: the model's,
    which the kernel's activation and output have). Raises (naming every reason) if a range has
    no kernel; NoDispatch (the call site stays as it is) where only the float64 reference would
    serve a range on a GPU (registry.NoGpuKernel)."""
    cfg = ctx.config
    base = registry.Request(op, device, n, k, batch_invariant=cfg.batch_invariant, e8m0=cfg.e8m0, dtype=dtype)
    try:
        if (
            cfg.autotune
            and not cfg.batch_invariant
            and op in autotune.TUNED_OPS
            and autotune.can_tune(device)
        ):
            chosen = autotune.plan(base, cfg.backends, m if isinstance(m, int) else None)
        else:
            chosen = []
            for tier, lo, hi in ranges(cfg, m, n):
                kernel = registry.choose(dataclasses.replace(base, m_min=lo, m_max=hi), cfg.backends, tier)
                if chosen and chosen[-1][2] == kernel:
                    chosen[-1] = (chosen[-1][0], hi, kernel)
                else:
                    chosen.append((lo, hi, kernel))
    except registry.NoGpuKernel as e:  # a GPU without FP8 kernels: bf16, with the reasons
        raise NoDispatch(str(e)) from None
    for lo, hi, kernel in chosen:
        registry.prepare(kernel, dataclasses.replace(base, m_min=lo, m_max=hi))
    if ctx.moving_ints and not isinstance(m, int):
        return [_by_rows(chosen)]
    return [Side(_label(lo, hi), kernel, hi, lo) for lo, hi, kernel in chosen]


def _by_rows(chosen: list[tuple[int, int | None, str]]) -> Side:
    """The dispatch of a dynamic M in a graph with a moving int input (PassContext.moving_ints),
    under CUDA graphs: no cond, one call whose backend names each range's kernel and picks one
    by M at every call (registry.by_rows). With conds, Inductor records the whole graph as one
    CUDA graph, again for each value of the moving int: at every decode step of a sliding-window
    cache (Mistral-7B-v0.1, 8 layers, batch 16 after batch 1: 0.05x bf16 Inductor, H200).
    Without them, Inductor partitions the graph as it does bf16's, and records it once per M,
    each with its range's kernel."""
    backend = registry.by_rows([(hi, kernel) for _, hi, kernel in chosen])
    return Side("all M (no cond: an int input moves every call)", backend)


# A weight shape every FP8 kernel takes (multiples of 128 and 512): what gpu_why_not asks about.
_ANY_SHAPE = 4096


def gpu_why_not(ctx: PassContext, op: str, device: torch.device) -> str | None:
    """Why no FP8 kernel runs `op` on this GPU for any shape (its compute capability, missing
    libraries; registry.NoGpuKernel), or None. Asked before a weight is quantized: a GPU without
    FP8 kernels gets no FP8 copies that no kernel would read."""
    if device.type != "cuda" or ctx.config.backends is not None:
        return None
    for tier, lo, hi in ranges(ctx.config, None, _ANY_SHAPE):
        request = registry.Request(
            op, device, _ANY_SHAPE, _ANY_SHAPE, lo, hi, ctx.config.batch_invariant, ctx.config.e8m0
        )
        try:
            registry.choose(request, None, tier)
        except registry.NoGpuKernel as e:
            return str(e)
    return None


def split(sides: list[Side], at: int, kernel: str | None = None) -> list[Side]:
    """sides with the one that serves both at - 1 and at (if given, only a side of `kernel`) cut
    in two there: the same kernel on each part, so the numbers do not change, but each part can
    be compiled for its own range."""
    out = []
    for side in sides:
        if side.m_min < at and (side.m_max is None or at <= side.m_max) and kernel in (None, side.kernel):
            out += [
                Side(_label(side.m_min, at - 1), side.kernel, at - 1, side.m_min),
                Side(_label(at, side.m_max), side.kernel, side.m_max, at),
            ]
        else:
            out.append(side)
    return out


def rows_node(ctx: PassContext, node: fx.Node, graph: fx.Graph | None = None):
    """M of a (..., K) tensor node viewed as (M, K): an int, or a node of `graph` (default: the
    graph being rewritten) computing the SymInt."""
    graph = ctx.gm.graph if graph is None else graph
    rows = None
    for dim, size in enumerate(node.meta["val"].shape[:-1]):
        if isinstance(size, torch.SymInt):
            factor = graph.call_function(torch.ops.aten.sym_size.int, (node, dim))
            factor.meta["val"] = size
        else:
            factor = size
        if rows is None:
            rows = factor
        elif isinstance(rows, int) and isinstance(factor, int):
            rows *= factor
        else:
            product = graph.call_function(operator.mul, (rows, factor))
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


def unflatten(ctx: PassContext, out: fx.Node, like: fx.Node, n: int) -> fx.Node:
    """out (M, N) viewed with like's leading dimensions and N (flatten's inverse); out itself
    where like is 2-D."""
    shape = like.meta["val"].shape
    if len(shape) == 2:
        return out
    graph, sizes = ctx.gm.graph, []
    for dim, size in enumerate(shape[:-1]):
        if isinstance(size, torch.SymInt):
            node = graph.call_function(torch.ops.aten.sym_size.int, (like, dim))
            node.meta["val"] = size
            sizes.append(node)
        else:
            sizes.append(size)
    view = graph.call_function(torch.ops.aten.reshape.default, (out, [*sizes, n]))
    view.meta["val"] = ctx.fake(torch.ops.aten.reshape.default, out, [*shape[:-1], n])
    return view


def pad_k(ctx: PassContext, node: fx.Node, k: int) -> fx.Node:
    """node (M, K') with zero columns up to K >= K' (reference.pad_k, as a graph node): the
    activation of a weight whose FP8 copy fills a K of part of a group with zero columns."""
    width = node.meta["val"].shape[-1]
    if width == k:
        return node
    padded = ctx.gm.graph.call_function(torch.ops.aten.constant_pad_nd.default, (node, [0, k - width], 0.0))
    padded.meta["val"] = ctx.fake(torch.ops.aten.constant_pad_nd.default, node, [0, k - width], 0.0)
    return padded


def _placeholders(graph: fx.Graph, operands: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    inner = {}
    for i, node in enumerate(operands):
        inner[node] = graph.placeholder(f"arg{i}")
        inner[node].meta["val"] = node.meta["val"]
    return inner


def _branch(
    ctx: PassContext,
    target,
    operands: list[fx.Node],
    args: tuple,
    kwargs: dict,
    sides: list[Side],
    m_source: fx.Node,
) -> fx.GraphModule:
    """GraphModule(*operands) -> (out,): target(*args, **kwargs) with the one side's kernel, or,
    for several sides, the cond between them (a nested cond)."""
    graph = fx.Graph()
    inner = _placeholders(graph, operands)
    owner = torch.nn.Module()
    args, kwargs = fx.node.map_arg((args, kwargs), inner.__getitem__)
    out = _dispatch(
        ctx,
        graph,
        owner,
        lambda side: side,
        target,
        list(inner.values()),
        args,
        kwargs,
        inner[m_source],
        sides,
    )
    graph.output((out,))
    return fx.GraphModule(owner, graph)


def _dispatch(ctx, graph, owner, attr_name, target, operands, args, kwargs, m_source, sides) -> fx.Node:
    """Emit into `graph` the call of target on `sides`: a plain call for one side, else
    cond(M <= first side's m_max, first side, the rest)."""
    if len(sides) == 1:
        call_kwargs = {**kwargs, "backend": sides[0].kernel}
        emit_launch = inline.inductor_launch(ctx, target, args, call_kwargs, sides[0].m_max, sides[0].m_min)
        if emit_launch is not None:
            ctx.traced_launches += 1
            return emit_launch(graph, target, args, call_kwargs, sides[0].m_max)
        call_kwargs = op_kwargs(call_kwargs)
        node = graph.call_function(target, args, call_kwargs)
        node.meta["val"] = ctx.fake(target, *args, **call_kwargs)
        return node
    first, rest = sides[0], sides[1:]
    names = []
    for side_name, part in ((f"m_le_{first.m_max}", [first]), (f"m_gt_{first.m_max}", rest)):
        names.append(attr_name(side_name))
        owner.add_module(names[-1], _branch(ctx, target, operands, args, kwargs, part, m_source))
    return _cond(ctx, graph, names, target, operands, args, kwargs, m_source, first)


def _cond(ctx, graph, names, target, operands, args, kwargs, m_source, first: Side) -> fx.Node:
    """Emit into `graph` cond(M <= first.m_max, *names)(operands)[0]: the branch modules
    `names` (attributes of the graph's module) over this call site's operands."""
    branches = [graph.get_attr(name) for name in names]
    m = rows_node(ctx, m_source, graph)
    pred = graph.call_function(operator.le, (m, first.m_max))
    pred.meta["val"] = _val(m) <= first.m_max
    cond = graph.call_function(torch.ops.higher_order.cond, (pred, *branches, tuple(operands)))
    out_val = ctx.fake(target, *args, **op_kwargs({**kwargs, "backend": first.kernel}))
    cond.meta["val"] = (out_val,)
    out = graph.call_function(operator.getitem, (cond, 0))
    out.meta["val"] = out_val
    return out


def _symbol_operands(ctx: PassContext, operands: list[fx.Node]) -> list[fx.Node]:
    symbols = set()
    for node in operands:
        val = node.meta["val"]
        # Strides count too: the last token of (B, S, H), x[:, -1], is (B, H) with row stride S*H,
        # and the branch checks its input's strides, so it needs S though no size mentions it.
        for size in (*val.shape, *val.stride(), val.storage_offset()):
            if isinstance(size, torch.SymInt):
                symbols |= size.node.expr.free_symbols
    bound = {}
    for node in ctx.gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt) and val.node.expr in symbols:
            # Dynamo can pass one symbol twice (the batch of the token ids and of a KV cache marked
            # as a static address): take the one the graph already reads. Branches handed the
            # unread twin fail in Inductor's codegen ("For s16*s27, expected [s16] to have been
            # codegen-ed"; tests/test_whole_model.py, the cache made before generate()).
            if val.node.expr not in bound or (not bound[val.node.expr].users and node.users):
                bound[val.node.expr] = node
    missing = symbols - bound.keys()
    if missing:
        raise NoDispatch(
            f"dynamic sizes {sorted(map(str, missing))} are not graph inputs (data-dependent?), "
            "so no torch.cond over M can be built"
        )
    return [bound[s] for s in sorted(bound, key=str)]


def emit(
    ctx: PassContext, target, args: tuple, kwargs: dict, m_source: fx.Node, sides: list[Side], name: str
) -> fx.Node:
    """Insert target(*args, **kwargs, backend=...) at the current insertion point, dispatched on
    M = m_source's rows over `sides` (from plan). Returns the output node."""
    operands: list[fx.Node] = []  # the tensors the branches read, each once
    if len(sides) > 1:
        fx.node.map_arg((args, kwargs), lambda n: operands.append(n) if n not in operands else None)
        # Inductor codegens each branch as a function of its operands: the symbols in their shapes
        # and strides (the dynamic M) must come in as operands too, as Dynamo does when it traces torch.cond.
        # Checked before anything is added to the graph, so NoDispatch leaves it as it was.
        operands = _symbol_operands(ctx, operands) + operands
        # Call sites of one signature (every layer's same projection) share the first one's
        # branch modules: Inductor lowers and compiles a subgraph once per attribute name.
        key = _signature(target, operands, args, kwargs, m_source, sides)
        if key in ctx.dispatch_branches:
            return _cond(
                ctx,
                ctx.gm.graph,
                ctx.dispatch_branches[key],
                target,
                operands,
                args,
                kwargs,
                m_source,
                sides[0],
            )
    out = _dispatch(
        ctx,
        ctx.gm.graph,
        ctx.gm,
        lambda side: ctx.attr_name(f"{name}_{side}"),
        target,
        operands,
        args,
        kwargs,
        m_source,
        sides,
    )
    if len(sides) > 1:
        cond = out.args[0]
        ctx.dispatch_branches[key] = [branch.target for branch in cond.args[1:3]]
    return out


def _signature(
    target, operands: list[fx.Node], args: tuple, kwargs: dict, m_source: fx.Node, sides: list[Side]
) -> tuple:
    """What a call site's branches depend on: the op, its constants and where each operand goes,
    the kernels per side, and each operand's dtype, sizes and strides (symbolic expressions)."""
    position = {node: i for i, node in enumerate(operands)}
    where = fx.node.map_arg((args, kwargs), lambda node: f"operand {position[node]}")
    return (
        target,
        repr(where),
        position[m_source],
        tuple(sides),
        tuple(signature(node.meta["val"]) for node in operands),
    )
