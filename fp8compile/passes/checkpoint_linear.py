"""checkpoint_linear pass: an FP8 checkpoint's linear, as transformers loads it, onto
fp8compile's FP8 linear with the checkpoint's own weights and scales.

Dynamo traces transformers' `FP8Linear` as fp8compile::checkpoint_linear (checkpoints.py). A
site of 128x128 weight blocks with dynamic activation scales (DeepSeek-V3's recipe, which
`FineGrainedFP8Config` saves) is what fp8compile's block recipe computes: x quantized 1x128 per
token, the weight (N, K) e4m3fn with one fp32 scale a 128x128 block (its `weight_scale_inv`,
the factor that dequantizes it). It becomes fp8compile::qlinear behind the M dispatch, reading
the checkpoint's tensors in place: no requantization, no bf16 copy (UE8M0 scales only get an
fp32 copy of the scales). A gated MLP's down projection becomes fp8compile::gated_qlinear, its
activation and quantization in the GEMM's kernel, as the silu_mul fusion makes of a bf16 one.
Any other site keeps the op, which runs transformers' own kernel, and the report says why.
Linears that read one x (q|k|v, gate|up) are merged into one GEMM before this pass, over their
weights stacked in place (checkpoint_merge.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .. import checkpoints
from ..numerics import BLOCK, E8M0_DTYPE, FP8_DTYPE
from . import dispatch, dtypes
from .context import PassContext
from .linear import _skip_pattern, module_name
from .silu_mul import silu_mul_pattern

TARGET = torch.ops.fp8compile.checkpoint_linear.default
QLINEAR = torch.ops.fp8compile.qlinear.default
GATED_QLINEAR = torch.ops.fp8compile.gated_qlinear.default
COND = torch.ops.higher_order.cond
ARGUMENTS = ("x", "weight", "weight_scale_inv", "bias", "activation_scale", "block_size", "allow_deepgemm")
DEFAULTS = {"bias": None, "activation_scale": None, "block_size": None, "allow_deepgemm": True}
DETAIL = "FP8 checkpoint: its weights and 128x128 block scales, in place"


def arguments(node: fx.Node) -> dict:
    """The op's arguments by name, defaults filled in."""
    bound = dict(DEFAULTS)
    bound.update(zip(ARGUMENTS, node.args))
    bound.update(node.kwargs)
    return bound


def why_not(ctx: PassContext, a: dict, name: str) -> str | None:
    """Why this checkpoint linear stays as transformers runs it, or None."""
    weight, scale, x = a["weight"], a["weight_scale_inv"], a["x"]
    if (pattern := _skip_pattern(name, ctx.config.skip)) is not None:
        return f"matches skip pattern {pattern!r}"
    if ctx.parameter(weight) is None or ctx.parameter(scale) is None:
        return "its FP8 weight or scale is not a parameter of the model"
    w_val, s_val, x_val = weight.meta["val"], scale.meta["val"], x.meta["val"]
    if w_val.dtype != FP8_DTYPE:
        return f"weight dtype {dtypes.name(w_val.dtype)}: fp8compile's kernels read e4m3fn weights"
    if list(a["block_size"] or ()) != [BLOCK, BLOCK]:
        scales = "one scale for the whole weight" if a["block_size"] is None else f"{a['block_size']} blocks"
        return f"the checkpoint's weight scales are {scales}: fp8compile serves 128x128 blocks"
    if a["activation_scale"] is not None:
        return "a static activation scale from the checkpoint: fp8compile's block recipe scales per token"
    if (why := dtypes.why_not({x_val.dtype}, "linears")) is not None:
        return why
    n, k = w_val.shape
    if k % BLOCK:
        return f"K={k} is not a whole number of 128-wide groups: it would need a padded copy of the weight"
    if n < BLOCK:
        return f"N={n} is less than one {BLOCK}-row weight block"
    if tuple(s_val.shape) != (-(-n // BLOCK), k // BLOCK) or s_val.dtype not in (torch.float32, E8M0_DTYPE):
        return (
            f"weight_scale_inv is {tuple(s_val.shape)} {dtypes.name(s_val.dtype)}, not fp32 or UE8M0 "
            f"({-(-n // BLOCK)}, {k // BLOCK}) for a ({n}, {k}) weight"
        )
    bias = a["bias"]
    if bias is not None and (bias.meta["val"].dtype != x_val.dtype or tuple(bias.meta["val"].shape) != (n,)):
        b = bias.meta["val"]
        return f"bias is {tuple(b.shape)} {dtypes.name(b.dtype)}, not ({n},) {dtypes.name(x_val.dtype)}"
    return None


def _fp32_scales(ctx: PassContext, scale: fx.Node, name: str) -> fx.Node:
    """The scales as fp32: the parameter itself, or for UE8M0 scales an fp32 copy (a graph input)."""
    if scale.meta["val"].dtype == torch.float32:
        return scale
    (node,) = ctx.derived_inputs(("checkpoint_scale_fp32",), (f"{name}_scale_fp32",), [scale], _as_fp32)
    return node


def _as_fp32(scale: torch.Tensor) -> tuple[torch.Tensor]:
    with unset_fake_temporarily(), torch.no_grad():  # made while compiling, then per changed call
        return (scale.float(),)


def gated(ctx: PassContext, x: fx.Node) -> tuple[tuple[fx.Node, fx.Node], dict] | None:
    """((a, b), the activation's op kwargs) where x is a gated MLP's act(a, b) that the silu_mul
    fusion serves (silu_mul.silu_mul_pattern) and a has x's leading dimensions; else None."""
    if "silu_mul" not in ctx.config.fusions:
        return None
    found = silu_mul_pattern(x)
    if not isinstance(found, tuple):
        return None
    a, b, act = found
    if tuple(a.meta["val"].shape[:-1]) != tuple(x.meta["val"].shape[:-1]):
        return None
    return (a, b), act


@dataclasses.dataclass(frozen=True)
class LinearOps:
    """The FP8 linear a checkpoint's recipe runs on, its gated twin, and the registry names their
    kernels are planned under (dispatch.plan)."""

    plain: torch._ops.OpOverload
    plain_op: str
    gated: torch._ops.OpOverload
    gated_op: str


BLOCK_OPS = LinearOps(QLINEAR, "linear", GATED_QLINEAR, "gated_linear")


def put_on_linear(
    ctx: PassContext,
    node: fx.Node,
    name: str,
    ops: LinearOps,
    x: fx.Node,
    product: fx.Node,
    operands: tuple[fx.Node, Callable[[], fx.Node], fx.Node | None],
    kwargs: dict,
    detail: str,
) -> bool:
    """node (a checkpoint's linear of x, its output x's leading dimensions and N) -> ops' linear
    behind the M dispatch on operands (weight, a maker of its scales' node, bias), or its gated
    twin where product (x, or what x views) is a gated MLP's act(a, b): one kernel for the
    activation, its quantization and the GEMM. False, the graph unchanged and the reason in the
    report, where no kernel serves it."""
    weight, scales, bias = operands
    n, k = weight.meta["val"].shape
    kind, target, op, activations, act = "linear", ops.plain, ops.plain_op, (x,), {}
    if (found := gated(ctx, product)) is not None:
        activations, act = found
        kind, target, op = "silu_mul", ops.gated, ops.gated_op
        detail = f"{act.get('activation', 'silu')}, {detail}"
    device = weight.meta["val"].device
    if (why := dispatch.gpu_why_not(ctx, op, device)) is not None:
        ctx.skipped(kind, name, why, f"{n}x{k}")
        return False
    with ctx.gm.graph.inserting_before(node):
        flat = [dispatch.flatten(ctx, a) for a in activations]
        m = flat[0].meta["val"].shape[0]
        try:
            sides = dispatch.plan(ctx, op, device, n, k, m, x.meta["val"].dtype)
            out = dispatch.emit(
                ctx,
                target,
                (*flat, weight, scales(), bias),
                {**kwargs, **act},
                m_source=flat[0],
                sides=sides,
                name=name,
            )
        except dispatch.NoDispatch as reason:
            ctx.skipped(kind, name, str(reason), f"{n}x{k}")
            return False
        out = dispatch.unflatten(ctx, out, x, n)
    ctx.replace_uses(node, out)
    ctx.gm.graph.erase_node(node)
    ctx.rewrote(kind, name, m, n, k, [(s.label, s.kernel) for s in sides], detail)
    return True


def rewrite(ctx: PassContext, node: fx.Node, a: dict, name: str) -> None:
    """node -> qlinear(x, weight, scales, bias) behind the M dispatch (gated_qlinear(a, b, ...)
    where x is a gated MLP's act(a, b): its activation and quantization in one kernel), or kept
    with the reason."""
    weight, scale = a["weight"], a["weight_scale_inv"]
    if (why := why_not(ctx, a, name)) is not None:
        ctx.skipped("linear", name, why, "x".join(map(str, weight.meta["val"].shape)))
        return
    e8m0 = ctx.config.e8m0 or scale.meta["val"].dtype == E8M0_DTYPE
    operands = (weight, lambda: _fp32_scales(ctx, scale, name), a["bias"])
    put_on_linear(ctx, node, name, BLOCK_OPS, a["x"], a["x"], operands, {"e8m0": e8m0}, DETAIL)


def site_name(ctx: PassContext, node: fx.Node) -> str:
    """The checkpoint linear's module name (its weight's), for the report."""
    weight = arguments(node)["weight"]
    param = ctx.parameter(weight) if weight.op == "placeholder" else None
    return module_name(param[1]) if param else weight.name


def checkpoint_linear_pass(ctx: PassContext) -> None:
    """Each checkpoint linear checkpoint_merge left, on its own; then the FP8 parameters the graph
    reads otherwise, named in the report."""
    nodes = list(ctx.gm.graph.find_nodes(op="call_function", target=TARGET))
    read = {arguments(node)["weight"] for node in nodes}  # before the rewrites erase the nodes
    for node in nodes:
        a, name = arguments(node), site_name(ctx, node)
        ctx.at_site(name, lambda node=node, a=a, name=name: rewrite(ctx, node, a, name))
    for node in ctx.parameters:
        val = node.meta.get("val")
        # (a weight checkpoint_merge stacked is read through the stack: no node reads it any more)
        if isinstance(val, torch.Tensor) and val.dtype == FP8_DTYPE and node not in read and _foreign(node):
            ctx.skipped(
                "linear", module_name(ctx.parameter(node)[1]), _untraced(val), "x".join(map(str, val.shape))
            )


_VIEW_OPS = (
    torch.ops.aten.permute.default,
    torch.ops.aten.t.default,
    torch.ops.aten.transpose.int,
    torch.ops.aten.view.default,
    torch.ops.aten.reshape.default,
)


def _foreign(node: fx.Node) -> bool:
    """Whether a node other than fp8compile's (its ops, its dispatch's conds) reads node, through
    views (a compressed-tensors weight reaches its op transposed)."""
    ours = (torch._ops.OpOverload, torch._ops.HigherOrderOperator)
    for user in node.users:
        if user.target in _VIEW_OPS:
            if _foreign(user):
                return True
        elif not (
            isinstance(user.target, ours) and (user.target.namespace == "fp8compile" or user.target is COND)
        ):
            return True
    return False


def _untraced(val: torch.Tensor) -> str:
    """Why an FP8 parameter the graph reads is not an FP8 checkpoint linear the pass can take."""
    if val.dim() == 3:
        return (
            "an FP8 checkpoint's routed experts fp8compile's MoE does not compute (checkpoints."
            "served_experts: 128x128 blocks with fp32 scales, dynamic activations, gate and up "
            f"stacked, silu; FP8 experts here {checkpoints.experts_status()}): they run as the model "
            "runs them"
        )
    return (
        "an FP8 weight read other than through transformers' FP8Linear, which fp8compile takes as "
        f"fp8compile::checkpoint_linear (here {checkpoints.status()}); it runs as the model runs it"
    )
