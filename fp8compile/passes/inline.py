"""The decode and cuBLAS branches of the M dispatch as kernel launches Inductor makes itself.

Outside CUDA graphs a step is host-bound, and an FP8 op in the graph pays a Python kernel
(dispatcher, op body, the kernel's Python entry) around every launch: 80-98 us of host time per
decode linear where bf16 Inductor's cuBLAS call pays 24-27 (H100, `bench host --chain 8`), 94
us per cuBLAS-side linear at M = 1024 against bf16's 16. fp8compile::linear_decode
(ops/linear/decode_op.py) and fp8compile::linear_scaled_mm (ops/linear/scaled_mm_op.py) are
torch.library.triton_ops: traced the way AOTAutograd traces (functionalized, make_fx over the
graph's fake tensors), their bodies become the kernel launches themselves
(triton_kernel_wrapper_functional nodes, and aten._scaled_mm for cuBLAS), which Inductor
compiles and calls from its generated code like its own.

The routed experts' decode side too: fp8compile::moe paid 190-290 us of host time a call at
one token on an H100 lease's host (six launches behind its Python), and fp8compile::moe_decode
(ops/moe/decode_op.py) is the same six kernels as a triton_op. From 32 routed rows per expert
up, where the op runs the Gluon GEMMs, fp8compile::moe_gluon (ops/moe/gluon_op.py) is its
routing, quantizations and top-k sum as launches around two calls of the Gluon GEMM: the moe
pass cuts the triton side of the dispatch at both ends of the op's own range (moe_decode_cut,
moe_gluon_cut), so a graph of dynamic M takes each launch in its range. Both read the FP8
expert weights as graph values, which the moe pass adds to its call site under LAUNCH_OPERANDS
(the op itself looks them up from the bf16 parameters).

Our passes run after AOTAutograd, so the branch traces that body (passes/trace.py: once per
call signature, the layers after the first copy it) and copies the nodes in. Used where the
call site's side of the dispatch runs the decode kernel, cuBLAS or (for MoE) the triton kernel
at decode sizes, and the config asks for it (Fp8Config.inductor_launch; by default, outside
CUDA graphs, where the host cost is paid; inside them the decode op's own launch keeps TMA
loads and programmatic dependent launch).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.fx as fx

from ..ops.moe.tiles import decode_fits, gluon_min_tokens
from .context import PassContext
from .trace import TraceCache, inline_traced

_QLINEAR = torch.ops.fp8compile.qlinear.default
_GATED_QLINEAR = torch.ops.fp8compile.gated_qlinear.default
_MOE = torch.ops.fp8compile.moe.default
_QLINEAR_SCALED = torch.ops.fp8compile.qlinear_scaled.default
_GATED_QLINEAR_SCALED = torch.ops.fp8compile.gated_qlinear_scaled.default
_SCALED = (_QLINEAR_SCALED, _GATED_QLINEAR_SCALED)
DECODE_BACKEND = "triton_small_m"
CUBLAS_BACKEND = "cublas"
MOE_BACKEND = "triton"
# The kwarg of a moe call site that carries the FP8 expert weights (w13_fp8, w13_scale, w2_fp8,
# w2_scale, b13 in their row order or None): fp8compile::moe itself takes the bf16 parameters
# and looks their FP8 copies up per call, a traced launch needs them as graph values.
# dispatch.op_kwargs drops it from the op's own calls.
LAUNCH_OPERANDS = "launch_operands"
Emitter = Callable[[fx.Graph, Any, tuple, dict, "int | None"], fx.Node]


def inductor_launch(
    ctx: PassContext, target, args: tuple, kwargs: dict, m_max: int | None, m_min: int = 1
) -> Emitter | None:
    """The emitter of the traced launch for this side of the dispatch (M in [m_min, m_max]), or
    None (the op stays): asked for, on a GPU (Inductor launches no Triton kernel on the CPU,
    where these kernels run only in Triton's interpreter), a (gated) linear on the decode
    kernel's or cuBLAS's side, or routed experts on the triton kernel's side where moe_decode
    or moe_gluon serves all of it."""
    # The scaled recipes' sides are traced under CUDA graphs too (unless the config says no): their
    # op's own path quantizes with unfused tensor ops (cuBLAS side) or an extra launch (decode),
    # where traced, Inductor fuses the quantization with what made x. Measured on an H100, Llama-3-8B
    # widths, 4 layers, reduce-overhead, rowwise, the op's own path: prefill 0.74x bf16.
    wanted = ctx.inductor_launch or (target in _SCALED and ctx.config.inductor_launch is not False)
    if not (wanted and args[0].meta["val"].device.type == "cuda"):
        return None
    backend = kwargs.get("backend")
    if target is _MOE:
        if backend != MOE_BACKEND or LAUNCH_OPERANDS not in kwargs or kwargs.get("batch_invariant"):
            return None
        if m_max is not None and moe_decode_fits(args, kwargs, m_max):
            return functools.partial(emit_moe_decode_launch, cache=ctx.traces)
        if moe_gluon_fits(args, kwargs, m_min):
            return functools.partial(emit_moe_gluon_launch, cache=ctx.traces, tokens_from=m_min)
        return None
    if target in _SCALED:
        if backend == DECODE_BACKEND and m_max is not None:
            return functools.partial(emit_scaled_launch, cache=ctx.traces, decode=True)
        if backend == CUBLAS_BACKEND:
            return functools.partial(emit_scaled_launch, cache=ctx.traces, decode=False)
        return None
    if target not in (_QLINEAR, _GATED_QLINEAR):
        return None
    if backend == DECODE_BACKEND and m_max is not None:
        return functools.partial(emit_decode_launch, cache=ctx.traces)
    if backend == CUBLAS_BACKEND:
        return functools.partial(emit_scaled_mm_launch, cache=ctx.traces)
    return None


def _moe_launches(ctx: PassContext, device: torch.device) -> bool:
    """Whether a moe call site on this device may get traced launches at all (batch-invariant
    keeps the op's 64-row blocks)."""
    return bool(ctx.inductor_launch) and device.type == "cuda" and not ctx.config.batch_invariant


def moe_launch_wanted(
    ctx: PassContext,
    sides,
    num_experts: int,
    top_k: int,
    n13: int,
    inter: int,
    hidden: int,
    device: torch.device,
) -> bool:
    """Whether a moe call site on these sides of the dispatch gets a traced launch on one of them
    (so its FP8 expert weights must enter the graph: LAUNCH_OPERANDS)."""
    if not _moe_launches(ctx, device):
        return False
    from ..ops.moe import gluon_op as moe_gluon_op

    return any(
        side.kernel == MOE_BACKEND
        and (
            side.m_max is not None
            and decode_fits(num_experts, top_k, side.m_max)
            or moe_gluon_op.fits(num_experts, top_k, side.m_min, n13, inter, hidden, device)
        )
        for side in sides
    )


def moe_decode_cut(ctx: PassContext, num_experts: int, top_k: int, device: torch.device) -> int | None:
    """The token count just past a moe call site's decode range (the most tokens, at most
    small_m, that moe_decode serves with moe_triton's own choices: decode_fits), where its triton
    side is cut (dispatch.split) so that the part below can be moe_decode's traced launch; None
    where no traced launch is wanted. Without the cut the small and medium ranges, both on the
    triton kernel, are one side, and a graph compiled for dynamic M (generate() at a second batch
    size) ran every decode step's experts through the op: 0.9 ms of host time a layer under
    cProfile (H100, Qwen3-30B-A3B widths, batch 4), where a graph of static M takes the launch."""
    if not _moe_launches(ctx, device):
        return None
    most = next((m for m in range(ctx.config.small_m, 0, -1) if decode_fits(num_experts, top_k, m)), 0)
    return most + 1 if most else None


def moe_gluon_cut(
    ctx: PassContext, num_experts: int, top_k: int, n13: int, inter: int, hidden: int, device: torch.device
) -> int | None:
    """The token count at which a moe call site's triton side is cut (dispatch.split), so that
    its part from there up can be moe_gluon's traced launch: the Gluon GEMMs' first count
    (moe_gluon_op.min_tokens, where the op itself switches kernels: the numbers stay), or None
    where no traced launch is wanted or the Gluon kernel cannot serve these experts."""
    if not _moe_launches(ctx, device):
        return None
    from ..ops.moe import (
        gluon_op as moe_gluon_op,
    )  # the Gluon kernel's limits need Triton, present with a GPU

    at = gluon_min_tokens(num_experts, top_k)
    return at if moe_gluon_op.fits(num_experts, top_k, at, n13, inter, hidden, device) else None


def moe_decode_fits(args: tuple, kwargs: dict, m_max: int) -> bool:
    """Whether a moe call site (not batch-invariant, which keeps 64-row blocks; its FP8 weights in
    kwargs: inductor_launch checks both) can be fp8compile::moe_decode for up to m_max tokens."""
    num_experts = kwargs[LAUNCH_OPERANDS][0].meta["val"].shape[0]
    return decode_fits(num_experts, args[1].meta["val"].shape[1], m_max)


def moe_gluon_fits(args: tuple, kwargs: dict, m_min: int) -> bool:
    """Whether a moe call site (as for moe_decode_fits) can be fp8compile::moe_gluon for m_min
    tokens and more (moe_gluon_op.fits)."""
    from ..ops.moe import gluon_op as moe_gluon_op

    num_experts, n13, hidden = kwargs[LAUNCH_OPERANDS][0].meta["val"].shape
    inter = kwargs[LAUNCH_OPERANDS][2].meta["val"].shape[2]  # w2_fp8 (E, H, I)
    return moe_gluon_op.fits(
        num_experts, args[1].meta["val"].shape[1], m_min, n13, inter, hidden, args[0].meta["val"].device
    )


def _operands(target, args: tuple, kwargs: dict):
    """(named operand nodes present, activation kwargs, e8m0) of a (gated) qlinear or qlinear_scaled call."""
    if target in (_QLINEAR, _QLINEAR_SCALED):
        (x, w_fp8, w_scale, bias), b = args, None
    else:
        x, b, w_fp8, w_scale, bias = args
    act = {key: kwargs[key] for key in ("activation", "alpha", "limit") if key in kwargs}
    present = [
        (name, node)
        for name, node in (("x", x), ("b", b), ("w_fp8", w_fp8), ("w_scale", w_scale), ("bias", bias))
        if node is not None
    ]
    return present, act, kwargs.get("e8m0", False)


def emit_decode_launch(
    graph: fx.Graph, target, args: tuple, kwargs: dict, m_max: int | None, cache: TraceCache | None = None
) -> fx.Node:
    """Into `graph`: target(*args, **kwargs) as the traced fp8compile::linear_decode (x 2-D, M <= m_max)."""
    from ..ops.linear import decode_op  # noqa: F401  (registers fp8compile::linear_decode)

    present, act, e8m0 = _operands(target, args, kwargs)

    def call(*values):
        v = dict(zip([name for name, _ in present], values))
        return torch.ops.fp8compile.linear_decode(
            v["x"], v["w_fp8"], v["w_scale"], v.get("bias"), e8m0, m_max, v.get("b"), **act
        )

    key = ("linear_decode", tuple(name for name, _ in present), e8m0, m_max, tuple(sorted(act.items())))
    return inline_traced(graph, call, [node for _, node in present], cache, key)


def emit_scaled_mm_launch(
    graph: fx.Graph, target, args: tuple, kwargs: dict, m_max: int | None, cache: TraceCache | None = None
) -> fx.Node:
    """Into `graph`: target(*args, **kwargs) as the traced fp8compile::linear_scaled_mm (x 2-D)."""
    from ..ops.linear import scaled_mm_op  # noqa: F401  (registers fp8compile::linear_scaled_mm)

    present, act, e8m0 = _operands(target, args, kwargs)

    def call(*values):
        v = dict(zip([name for name, _ in present], values))
        return torch.ops.fp8compile.linear_scaled_mm(
            v["x"], v["w_fp8"], v["w_scale"], v.get("bias"), e8m0, v.get("b"), **act
        )

    key = ("linear_scaled_mm", tuple(name for name, _ in present), e8m0, tuple(sorted(act.items())))
    return inline_traced(graph, call, [node for _, node in present], cache, key)


def emit_scaled_launch(
    graph: fx.Graph,
    target,
    args: tuple,
    kwargs: dict,
    m_max: int | None,
    cache: TraceCache | None = None,
    decode: bool = False,
) -> fx.Node:
    """Into `graph`: the (gated_)qlinear_scaled call target(*args, **kwargs) (x 2-D) traced: as
    fp8compile::linear_scaled_decode (M <= m_max) if decode; else a plain linear as the cuBLAS
    kernel's own tensor ops and aten._scaled_mm (ops/linear/scaled_cublas.py), whose quantization
    Inductor fuses, and a gated one as fp8compile::gated_linear_scaled_mm (ops/linear/scaled_gated_mm.py)."""
    from ..ops.linear import scaled_cublas

    if decode:
        from ..ops.linear import triton_scaled  # noqa: F401  (registers fp8compile::linear_scaled_decode)
    elif target is _GATED_QLINEAR_SCALED:
        from ..ops.linear import scaled_gated_mm  # noqa: F401  (registers fp8compile::gated_linear_scaled_mm)

    present, act, e8m0 = _operands(target, args, kwargs)
    if kwargs.get("x_scale") is not None:
        present.append(("x_scale", kwargs["x_scale"]))
    names = tuple(name for name, _ in present)
    recipe, amax_ub, fast_accum = (
        kwargs.get("recipe", "rowwise"),
        kwargs.get("amax_ub", 0.0),
        kwargs.get("fast_accum", False),
    )

    def call(*values):
        v = dict(zip(names, values))
        operands = (v["x"], v["w_fp8"], v["w_scale"], v.get("bias"))
        if decode:
            return torch.ops.fp8compile.linear_scaled_decode(
                *operands, v.get("x_scale"), recipe, amax_ub, e8m0, m_max, v.get("b"), **act
            )
        if "b" in v:
            return torch.ops.fp8compile.gated_linear_scaled_mm(
                v["x"], v["b"], *operands[1:], v.get("x_scale"), recipe, amax_ub, e8m0, fast_accum, **act
            )
        return scaled_cublas.linear_scaled_cublas(
            *operands, recipe, v.get("x_scale"), amax_ub, e8m0, fast_accum
        )

    key = (
        "linear_scaled",
        decode,
        names,
        recipe,
        amax_ub,
        e8m0,
        fast_accum,
        m_max if decode else None,
        tuple(sorted(act.items())),
    )
    return inline_traced(graph, call, [node for _, node in present], cache, key)


def emit_moe_decode_launch(
    graph: fx.Graph, target, args: tuple, kwargs: dict, m_max: int | None, cache: TraceCache | None = None
) -> fx.Node:
    """Into `graph`: the moe call target(*args, **kwargs) as the traced fp8compile::moe_decode
    (up to m_max tokens), on the FP8 expert weights kwargs[LAUNCH_OPERANDS] carries."""
    from ..ops.moe import decode_op as moe_decode_op  # noqa: F401  (registers fp8compile::moe_decode)

    return _emit_moe(graph, args, kwargs, cache, torch.ops.fp8compile.moe_decode, "max_tokens", m_max)


def emit_moe_gluon_launch(
    graph: fx.Graph,
    target,
    args: tuple,
    kwargs: dict,
    m_max: int | None,
    cache: TraceCache | None = None,
    tokens_from: int = 1,
) -> fx.Node:
    """Into `graph`: the moe call target(*args, **kwargs) as the traced fp8compile::moe_gluon
    (tokens_from tokens and more), on the FP8 expert weights kwargs[LAUNCH_OPERANDS] carries."""
    from ..ops.moe import gluon_op as moe_gluon_op  # noqa: F401  (registers fp8compile::moe_gluon)

    return _emit_moe(graph, args, kwargs, cache, torch.ops.fp8compile.moe_gluon, "tokens_from", tokens_from)


def _emit_moe(
    graph: fx.Graph, args: tuple, kwargs: dict, cache: TraceCache | None, op, bound: str, value: int
) -> fx.Node:
    """op(x, topk_ids, topk_weights, <FP8 expert weights>, b13, b2, e8m0, **{bound: value}, act...)
    traced into graph for a moe call site."""
    x, topk_ids, topk_weights = args[:3]
    w13_fp8, w13_scale, w2_fp8, w2_scale, b13 = kwargs[LAUNCH_OPERANDS]
    b2 = args[7] if len(args) > 7 else kwargs.get("b2")
    act = {key: kwargs[key] for key in ("activation", "alpha", "limit") if key in kwargs}
    e8m0 = kwargs.get("e8m0", False)
    present = [
        (name, node)
        for name, node in (
            ("x", x),
            ("topk_ids", topk_ids),
            ("topk_weights", topk_weights),
            ("w13_fp8", w13_fp8),
            ("w13_scale", w13_scale),
            ("w2_fp8", w2_fp8),
            ("w2_scale", w2_scale),
            ("b13", b13),
            ("b2", b2),
        )
        if node is not None
    ]
    names = tuple(name for name, _ in present)

    def call(*values):
        v = dict(zip(names, values))
        return op(
            v["x"],
            v["topk_ids"],
            v["topk_weights"],
            v["w13_fp8"],
            v["w13_scale"],
            v["w2_fp8"],
            v["w2_scale"],
            v.get("b13"),
            v.get("b2"),
            e8m0,
            **{bound: value},
            **act,
        )

    key = (str(op), names, e8m0, bound, value, tuple(sorted(act.items())))
    return inline_traced(graph, call, [node for _, node in present], cache, key)
