"""The decode branch of the M dispatch as a kernel launch Inductor makes itself.

Outside CUDA graphs a decode step is host-bound, and an FP8 op in the graph pays a Python
kernel (dispatcher, op body, the kernel's Python entry) around every launch: 80-98 us of host
time per linear where bf16 Inductor's cuBLAS call pays 24-27 (H100, `bench host --chain 8`).
fp8compile::linear_decode (ops/decode_op.py) is a torch.library.triton_op: traced the way
AOTAutograd traces (functionalized, make_fx over the graph's fake tensors), its body becomes
the launch of the decode kernel itself, a triton_kernel_wrapper_functional node, which
Inductor compiles and calls from its generated code like one of its own kernels.

Our passes run after AOTAutograd, so the branch traces that body here and copies the nodes
in. Used where the call site's side of the dispatch runs the decode kernel and the config asks
for it (Fp8Config.inductor_launch; by default, outside CUDA graphs, where the host cost is
paid; inside them the op's own launch keeps TMA loads and programmatic dependent launch).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .context import PassContext

_QLINEAR = torch.ops.fp8compile.qlinear.default
_GATED_QLINEAR = torch.ops.fp8compile.gated_qlinear.default
DECODE_BACKEND = "triton_small_m"


def wants_inductor_launch(ctx: PassContext, target, args: tuple, kwargs: dict, m_max: int | None) -> bool:
    """Whether this side of the dispatch becomes the traced decode-kernel launch: asked for, the
    decode kernel's side of a (gated) linear, on a GPU (Inductor launches no Triton kernel on
    the CPU, where the decode kernel runs only in Triton's interpreter)."""
    return (ctx.inductor_launch and kwargs.get("backend") == DECODE_BACKEND and target in (_QLINEAR, _GATED_QLINEAR)
            and m_max is not None and args[0].meta["val"].device.type == "cuda")


def emit_decode_launch(graph: fx.Graph, target, args: tuple, kwargs: dict, m_max: int) -> fx.Node:
    """Into `graph`: target(*args, **kwargs) as the traced fp8compile::linear_decode (x 2-D, M <= m_max)."""
    from ..ops import decode_op  # noqa: F401  (registers fp8compile::linear_decode)

    if target is _QLINEAR:
        (x, w_fp8, w_scale, bias), b = args, None
    else:
        x, b, w_fp8, w_scale, bias = args
    act = {key: kwargs[key] for key in ("activation", "alpha", "limit") if key in kwargs}
    e8m0 = kwargs.get("e8m0", False)
    present = [(name, node) for name, node in (("x", x), ("b", b), ("w_fp8", w_fp8), ("w_scale", w_scale),
                                               ("bias", bias)) if node is not None]

    def call(*values):
        v = dict(zip([name for name, _ in present], values))
        return torch.ops.fp8compile.linear_decode(v["x"], v["w_fp8"], v["w_scale"], v.get("bias"), e8m0, m_max,
                                                  v.get("b"), **act)

    return inline_traced(graph, call, [node for _, node in present])


def inline_traced(graph: fx.Graph, fn, inputs: list[fx.Node]) -> fx.Node:
    """fn(*inputs) traced as AOTAutograd traces for Inductor (functionalized, with Inductor's
    decompositions, over the inputs' fake values: the graph's fake mode and shape environment),
    its nodes copied into `graph` at the current insertion point; returns the node of fn's (one
    tensor) result."""
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.functional_tensor import FunctionalTensorMode, dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    traced = make_fx(dispatch_functionalize(fn, FunctionalTensorMode()), decomposition_table=select_decomp_table(),
                     tracing_mode="symbolic")(*[node.meta["val"] for node in inputs])
    placeholders = list(traced.graph.find_nodes(op="placeholder"))
    out = graph.graph_copy(traced.graph, dict(zip(placeholders, inputs)))
    if not isinstance(out, fx.Node):
        raise AssertionError(f"expected one tensor from the traced call, got {out!r}")
    return out
