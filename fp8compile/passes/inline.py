"""The decode and cuBLAS branches of the M dispatch as kernel launches Inductor makes itself.

Outside CUDA graphs a step is host-bound, and an FP8 op in the graph pays a Python kernel
(dispatcher, op body, the kernel's Python entry) around every launch: 80-98 us of host time per
decode linear where bf16 Inductor's cuBLAS call pays 24-27 (H100, `bench host --chain 8`), 94
us per cuBLAS-side linear at M = 1024 against bf16's 16. fp8compile::linear_decode
(ops/decode_op.py) and fp8compile::linear_scaled_mm (ops/scaled_mm_op.py) are
torch.library.triton_ops: traced the way AOTAutograd traces (functionalized, make_fx over the
graph's fake tensors), their bodies become the kernel launches themselves
(triton_kernel_wrapper_functional nodes, and aten._scaled_mm for cuBLAS), which Inductor
compiles and calls from its generated code like its own.

Our passes run after AOTAutograd, so the branch traces that body (passes/trace.py: once per
call signature, the layers after the first copy it) and copies the nodes in. Used where the
call site's side of the dispatch runs the decode kernel or cuBLAS and the config asks for it
(Fp8Config.inductor_launch; by default, outside CUDA graphs, where the host cost is paid;
inside them the decode op's own launch keeps TMA loads and programmatic dependent launch).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.fx as fx

from .context import PassContext
from .trace import TraceCache, inline_traced

_QLINEAR = torch.ops.fp8compile.qlinear.default
_GATED_QLINEAR = torch.ops.fp8compile.gated_qlinear.default
DECODE_BACKEND = "triton_small_m"
CUBLAS_BACKEND = "cublas"
Emitter = Callable[[fx.Graph, Any, tuple, dict, "int | None"], fx.Node]


def inductor_launch(ctx: PassContext, target, args: tuple, kwargs: dict, m_max: int | None) -> Emitter | None:
    """The emitter of the traced launch for this side of the dispatch, or None (the op stays):
    asked for, a (gated) linear on the decode kernel's or cuBLAS's side, on a GPU (Inductor
    launches no Triton kernel on the CPU, where these kernels run only in Triton's interpreter)."""
    if not (ctx.inductor_launch and target in (_QLINEAR, _GATED_QLINEAR) and args[0].meta["val"].device.type == "cuda"):
        return None
    backend = kwargs.get("backend")
    if backend == DECODE_BACKEND and m_max is not None:
        return functools.partial(emit_decode_launch, cache=ctx.traces)
    if backend == CUBLAS_BACKEND:
        return functools.partial(emit_scaled_mm_launch, cache=ctx.traces)
    return None


def _operands(target, args: tuple, kwargs: dict):
    """(named operand nodes present, activation kwargs, e8m0) of a qlinear / gated_qlinear call."""
    if target is _QLINEAR:
        (x, w_fp8, w_scale, bias), b = args, None
    else:
        x, b, w_fp8, w_scale, bias = args
    act = {key: kwargs[key] for key in ("activation", "alpha", "limit") if key in kwargs}
    present = [(name, node) for name, node in (("x", x), ("b", b), ("w_fp8", w_fp8), ("w_scale", w_scale),
                                               ("bias", bias)) if node is not None]
    return present, act, kwargs.get("e8m0", False)


def emit_decode_launch(graph: fx.Graph, target, args: tuple, kwargs: dict, m_max: int | None,
                       cache: TraceCache | None = None) -> fx.Node:
    """Into `graph`: target(*args, **kwargs) as the traced fp8compile::linear_decode (x 2-D, M <= m_max)."""
    from ..ops import decode_op  # noqa: F401  (registers fp8compile::linear_decode)

    present, act, e8m0 = _operands(target, args, kwargs)

    def call(*values):
        v = dict(zip([name for name, _ in present], values))
        return torch.ops.fp8compile.linear_decode(v["x"], v["w_fp8"], v["w_scale"], v.get("bias"), e8m0, m_max,
                                                  v.get("b"), **act)

    key = ("linear_decode", tuple(name for name, _ in present), e8m0, m_max, tuple(sorted(act.items())))
    return inline_traced(graph, call, [node for _, node in present], cache, key)


def emit_scaled_mm_launch(graph: fx.Graph, target, args: tuple, kwargs: dict, m_max: int | None,
                          cache: TraceCache | None = None) -> fx.Node:
    """Into `graph`: target(*args, **kwargs) as the traced fp8compile::linear_scaled_mm (x 2-D)."""
    from ..ops import scaled_mm_op  # noqa: F401  (registers fp8compile::linear_scaled_mm)

    present, act, e8m0 = _operands(target, args, kwargs)

    def call(*values):
        v = dict(zip([name for name, _ in present], values))
        return torch.ops.fp8compile.linear_scaled_mm(v["x"], v["w_fp8"], v["w_scale"], v.get("bias"), e8m0,
                                                     v.get("b"), **act)

    key = ("linear_scaled_mm", tuple(name for name, _ in present), e8m0, tuple(sorted(act.items())))
    return inline_traced(graph, call, [node for _, node in present], cache, key)
