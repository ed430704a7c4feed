"""checkpoint_rowwise pass: a compressed-tensors FP8 checkpoint's linear, as transformers loads it,
onto fp8compile's rowwise FP8 linear with the checkpoint's own weight and scales.

transformers loads a compressed-tensors FP8 checkpoint (per-channel or per-tensor weight scales,
which it stores per channel) with `use_optimized_inference` as `CompressedTensorsFP8Linear`:
activations quantized per token, a rowwise-scaled matmul. Dynamo traces the two as
fp8compile::checkpoint_quant_rows and fp8compile::checkpoint_scaled_mm_rowwise (checkpoints.py):
the matmul over the quantized rows of x and the transposed weight is the rowwise recipe with
dynamic activation scales, and becomes fp8compile::qlinear_scaled on x behind the M dispatch on the
checkpoint's e4m3fn weight and fp32 scales as they are (a gated MLP's down projection
gated_qlinear_scaled, its activation fused). The recipe is the checkpoint's, whatever
Fp8Config.recipe says. Any other site keeps the op, which runs transformers' own functions,
with the reason.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from ..numerics import FP8_DTYPE
from . import dtypes
from .checkpoint_linear import LinearOps, put_on_linear
from .silu_mul import _VIEWS
from .context import PassContext
from .linear import SCALED_K_ALIGN, _skip_pattern, module_name

TARGET = torch.ops.fp8compile.checkpoint_scaled_mm_rowwise.default
QUANT_ROWS = torch.ops.fp8compile.checkpoint_quant_rows.default
DETAIL = "compressed-tensors FP8 checkpoint: its weights and per-channel scales, in place"
aten = torch.ops.aten
ROWWISE_OPS = LinearOps(
    torch.ops.fp8compile.qlinear_scaled.default,
    "scaled_linear",
    torch.ops.fp8compile.gated_qlinear_scaled.default,
    "gated_scaled_linear",
)


def operands(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, fx.Node | None] | str:
    """(x, weight, weight_scale, bias) of a checkpoint_scaled_mm_rowwise over quant_rows(x) and a
    transposed weight, as CompressedTensorsFP8Linear's forward calls it; else why not."""
    x_fp8, weight_t, scale_a, scale_b, _, *rest = node.args
    bias = rest[0] if rest else node.kwargs.get("bias")
    quant = x_fp8.args[0] if x_fp8.target is operator.getitem and x_fp8.args[1] == 0 else None
    if not (isinstance(quant, fx.Node) and quant.target is QUANT_ROWS):
        return "its activation is not quantized by transformers' quantize_fp8_per_row"
    row_scale = scale_a.args[0] if scale_a.target in (aten.unsqueeze.default, aten.view.default) else None
    if not (
        isinstance(row_scale, fx.Node) and row_scale.target is operator.getitem and row_scale.args[0] is quant
    ):
        return "its activation scale is not quantize_fp8_per_row's"
    if weight_t.target not in (aten.permute.default, aten.t.default, aten.transpose.int):
        return "its weight is not a transposed parameter"
    return quant.args[0], weight_t.args[0], scale_b, bias


def why_not(ctx: PassContext, x: fx.Node, weight: fx.Node, scale: fx.Node, bias, name: str) -> str | None:
    """Why this compressed-tensors linear stays as transformers runs it, or None."""
    if (pattern := _skip_pattern(name, ctx.config.skip)) is not None:
        return f"matches skip pattern {pattern!r}"
    if ctx.parameter(weight) is None or ctx.parameter(scale) is None:
        return "its FP8 weight or scale is not a parameter of the model"
    w_val, s_val = weight.meta["val"], scale.meta["val"]
    if w_val.dtype != FP8_DTYPE or w_val.dim() != 2:
        return (
            f"weight {tuple(w_val.shape)} {dtypes.name(w_val.dtype)}: fp8compile's kernels read e4m3fn (N, K)"
        )
    if (why := dtypes.why_not({x.meta["val"].dtype}, "linears")) is not None:
        return why
    n, k = w_val.shape
    if k % SCALED_K_ALIGN:
        return f"K={k} is not a multiple of {SCALED_K_ALIGN} (FP8 GEMMs read 16-byte rows)"
    if s_val.numel() != n or s_val.dtype != torch.float32:
        scales = f"{tuple(s_val.shape)} {dtypes.name(s_val.dtype)}"
        return f"weight_scale {scales}: not one fp32 scale per output channel"
    if bias is not None and tuple(bias.meta["val"].shape) != (n,):
        return f"bias {tuple(bias.meta['val'].shape)} for N={n}"
    return None


def rewrite(ctx: PassContext, node: fx.Node, name: str) -> None:
    found = operands(node)
    k, n = node.args[1].meta["val"].shape
    shape = f"{n}x{k}"
    if isinstance(found, str):
        ctx.skipped("linear", name, found, shape)
        return
    x, weight, scale, bias = found
    if (why := why_not(ctx, x, weight, scale, bias, name)) is not None:
        ctx.skipped("linear", name, why, shape)
        return

    def per_channel() -> fx.Node:
        flat = ctx.gm.graph.call_function(aten.reshape.default, (scale, [n]))
        flat.meta["val"] = ctx.fake(aten.reshape.default, scale, [n])
        return flat

    kwargs = {"recipe": "rowwise", "x_scale": None, "e8m0": False}
    if ctx.config.cublas_fast_accum():
        kwargs["fast_accum"] = True
    # the forward flattens x to (M, K) before quantizing it: act(a, b) is found above the view
    product = x.args[0] if x.op == "call_function" and x.target in _VIEWS else x
    if put_on_linear(ctx, node, name, ROWWISE_OPS, x, product, (weight, per_channel, bias), kwargs, DETAIL):
        # the checkpoint's recipe, whatever Fp8Config.recipe says
        ctx.report.rewrites[-1] = dataclasses.replace(ctx.report.rewrites[-1], recipe="rowwise, dynamic")


def checkpoint_rowwise_pass(ctx: PassContext) -> None:
    for node in list(ctx.gm.graph.find_nodes(op="call_function", target=TARGET)):
        weight = node.args[1].args[0] if node.args[1].op == "call_function" else node.args[1]
        param = ctx.parameter(weight) if weight.op == "placeholder" else None
        name = module_name(param[1]) if param else weight.name
        ctx.at_site(name, lambda node=node, name=name: rewrite(ctx, node, name))
