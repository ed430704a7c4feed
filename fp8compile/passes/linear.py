"""linear pass: a bf16 matmul whose weight is a model parameter -> fp8compile::linear.

After AOTAutograd every linear form (nn.Linear, F.linear, x @ w.t(), torch.matmul, 2-D or
3-D activations) is one of
    mm(x, permute(w, [1, 0]))          addmm(bias, x, permute(w, [1, 0]))      w stored (N, K)
    mm(x, w)                           addmm(bias, x, w)                       w stored (K, N)
with 3-D activations flattened by a view before and after. The transpose may also appear as
aten.t or aten.transpose. The weight is quantized once here, at compile time; its FP8 copy
becomes a graph input (passes/context.py, derived_inputs) and the op quantizes only the
activation at run time.
"""

from __future__ import annotations

import dataclasses
import fnmatch

import torch
import torch.fx as fx

from ..numerics import BLOCK, scale_from_amax
from . import dispatch, dtypes
from .context import PassContext
from ..weights import fp8_weight, fp8_weight_scaled

aten = torch.ops.aten
MATMULS = (aten.mm.default, aten.addmm.default)
# the ops the passes emit -> the registry's name for what their kernels compute
REGISTRY_OPS = {
    torch.ops.fp8compile.qlinear.default: "linear",
    torch.ops.fp8compile.gated_qlinear.default: "gated_linear",
    torch.ops.fp8compile.qlinear_scaled.default: "scaled_linear",
    torch.ops.fp8compile.gated_qlinear_scaled.default: "gated_scaled_linear",
}
# A block-recipe op the passes emit -> its twin in the rowwise and tensor recipes (scaled_call).
SCALED_TWINS = {
    torch.ops.fp8compile.qlinear.default: torch.ops.fp8compile.qlinear_scaled.default,
    torch.ops.fp8compile.gated_qlinear.default: torch.ops.fp8compile.gated_qlinear_scaled.default,
}
# Along K the scaled recipes need only what FP8 tensor cores and cuBLAS need: 16-byte rows.
SCALED_K_ALIGN = 16


@dataclasses.dataclass
class LinearMatch:
    node: fx.Node  # the mm / addmm
    x: fx.Node  # (M, K) activation
    weight: fx.Node  # placeholder of the stored weight
    transposed: bool  # stored as (K, N), i.e. used as x @ w
    bias: fx.Node | None
    # The weight is weight[index] of experts stacked along a first dimension (selected_linear);
    # None: the placeholder is the weight itself.
    index: int | None = None

    @property
    def weight_val(self) -> torch.Tensor:
        """The (fake) value of the weight the matmul reads."""
        val = self.weight.meta["val"]
        return val if self.index is None else val[self.index]


def _is_2d_transpose(node: fx.Node) -> bool:
    if node.target == aten.t.default:
        return True
    if node.target == aten.permute.default:
        return list(node.args[1]) == [1, 0]
    if node.target == aten.transpose.int:
        return {d % 2 for d in node.args[1:3]} == {0, 1}
    return False


def _derives_from_placeholder(node: fx.Node, depth: int = 4) -> fx.Node | None:
    """The placeholder a weight operand is computed from through single-input ops, if any."""
    for _ in range(depth):
        if node.op == "placeholder":
            return node
        tensor_inputs = [a for a in node.all_input_nodes]
        if node.op != "call_function" or len(tensor_inputs) != 1:
            return None
        node = tensor_inputs[0]
    return node if node.op == "placeholder" else None


def linear_pattern(node: fx.Node) -> LinearMatch | fx.Node | None:
    """A LinearMatch; else the placeholder an unsupported weight operand derives from; else None."""
    if node.target == aten.mm.default:
        bias, (x, w) = None, node.args[:2]
    else:
        bias, x, w = node.args[:3]
    if w.op == "call_function" and _is_2d_transpose(w) and w.args[0].op == "placeholder":
        return LinearMatch(node, x, w.args[0], False, bias)
    if w.op == "placeholder":
        return LinearMatch(node, x, w, True, bias)
    return _derives_from_placeholder(w)


def selected_linear(node: fx.Node) -> LinearMatch | None:
    """A matmul whose weight is one expert's of a parameter of experts stacked along dim 0,
    F.linear(x, w[i]): mm(x, permute(select(w, 0, i), [1, 0])) or, stored (E, K, N),
    mm(x, select(w, 0, i)) (JetMoE's experts: a linear per expert on the rows routed to it)."""
    if node.target == aten.mm.default:
        bias, (x, w) = None, node.args[:2]
    else:
        bias, x, w = node.args[:3]
    transposed = not (w.op == "call_function" and _is_2d_transpose(w))
    select = w if transposed else w.args[0]
    if not (
        select.op == "call_function"
        and select.target == aten.select.int
        and select.args[0].op == "placeholder"
        and select.args[1] == 0
        and isinstance(select.args[2], int)
        and select.args[0].meta["val"].dim() == 3
    ):
        return None
    experts = select.args[0].meta["val"].shape[0]
    return LinearMatch(node, x, select.args[0], transposed, bias, select.args[2] % experts)


def module_name(param_name: str) -> str:
    return param_name[: -len(".weight")] if param_name.endswith(".weight") else param_name


def _skip_pattern(name: str, patterns: tuple[str, ...]) -> str | None:
    for pattern in patterns:
        if fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern):
            return pattern
    return None


def linear_extra_check(ctx: PassContext, match: LinearMatch, name: str) -> str | None:
    """Why this linear must stay as it is, or None. Dtype: a 16-bit model's linears (dtypes.py);
    shape: the block recipe needs at least one 128-wide group along K (a K of part of a group
    past it is padded with zeros, in the weight's copy and in the activation: emit_fp8), and
    along N at least one 128-row weight block (the last may be partial, as in DeepSeek's own FP8
    checkpoints for an MLA kv_a_proj_with_mqa of N = 576; the registry says which kernels serve
    it); skip: the user asked to leave it."""
    x_val, w_val, out_val = match.x.meta["val"], match.weight_val, match.node.meta["val"]
    if (why := dtypes.why_not({x_val.dtype, w_val.dtype, out_val.dtype}, "linears")) is not None:
        return why
    if (pattern := _skip_pattern(name, ctx.config.skip)) is not None:
        return f"matches skip pattern {pattern!r}"
    if match.node in ctx.keep_bf16:
        return ctx.keep_bf16[match.node]
    if ctx.fp8_checkpoint and not ctx.config.quantize_checkpoint_bf16:
        return (
            "the FP8 checkpoint this model was loaded from keeps it in bf16 (its modules_to_not_convert); "
            "Fp8Config(quantize_checkpoint_bf16=True) quantizes it too"
        )
    k, n = w_val.shape if match.transposed else reversed(w_val.shape)
    recipe = ctx.config.recipe
    if recipe == "block" and k < BLOCK:
        return f"K={k} is less than one {BLOCK}-wide activation group: nothing for FP8 to gain"
    if recipe != "block" and k % SCALED_K_ALIGN:
        return f"K={k} is not a multiple of {SCALED_K_ALIGN} (FP8 GEMMs read 16-byte rows)"
    if ctx.config.act_amax is not None and name not in ctx.config.act_amax:
        return (
            "no calibrated activation amax for it in act_amax (static scales): calibrate on this model "
            "(fp8compile.calibrate) or leave act_amax out for dynamic scales"
        )
    if n < BLOCK:
        return (
            f"N={n} is less than one {BLOCK}-row weight block: nothing for FP8 to gain (a router's N, "
            "where FP8 error would change the top-k)"
        )
    if match.bias is not None:
        alpha, beta = match.node.kwargs.get("alpha", 1), match.node.kwargs.get("beta", 1)
        if alpha != 1 or beta != 1:
            return f"addmm with alpha={alpha}, beta={beta}"
        bias = match.bias.meta["val"]
        if tuple(bias.shape) != (n,) or bias.dtype != x_val.dtype:
            return (
                f"addmm adds a {tuple(bias.shape)} {dtypes.name(bias.dtype)} tensor, not a ({n},) "
                f"{dtypes.name(x_val.dtype)} bias"
            )
    return None


def fp8_weight_inputs(
    ctx: PassContext, name: str, weights: list[fx.Node], kn: bool, index: int | None = None
) -> tuple[fx.Node, fx.Node]:
    """Graph inputs (w_fp8, w_scale) for the FP8 copy of these weight parameters (more than one:
    stacked along N, weights.fp8_weight; index: the weight is weights[0][index], one expert's),
    quantized now and looked up per call."""
    e8m0, recipe = ctx.config.e8m0, ctx.config.recipe
    label = name if index is None else f"{name}_{index}"
    if recipe != "block":
        return ctx.derived_inputs(
            ("scaled", recipe, kn, e8m0, index),
            (f"{label}_fp8", f"{label}_fp8_scale"),
            weights,
            lambda w, *more: fp8_weight_scaled(w, recipe, kn, e8m0, more or None, index),
            memo=True,
            release_now=index is None,
        )
    return ctx.derived_inputs(
        ("linear", kn, e8m0, index),
        (f"{label}_fp8", f"{label}_fp8_scale"),
        weights,
        lambda w, *more: fp8_weight(w, kn, e8m0, more or None, index),
        memo=True,
        release_now=index is None,  # one expert of a stacked parameter: the whole goes at the end
    )


def static_act_scale(ctx: PassContext, names: list[str], weight: fx.Node) -> fx.Node | None:
    """The graph input holding the static activation scale of linears over one x (names), from
    the largest of their calibrated amax (Fp8Config.act_amax); None for dynamic scales."""
    table = ctx.config.act_amax
    if table is None:
        return None
    amax = max(table[name] for name in names)
    e8m0 = ctx.config.e8m0

    def make(w):
        return (scale_from_amax(torch.tensor(amax, device=w.device), e8m0),)

    (node,) = ctx.derived_inputs(("act_scale", amax, e8m0), (f"{names[0]}_act_scale",), [weight], make)
    return node


def registry_op(ctx: PassContext, target) -> str:
    """The registry's name for what `target` computes once scaled_call has put it in the
    configured recipe: "scaled_linear" or "gated_scaled_linear" in the rowwise and tensor recipes."""
    return REGISTRY_OPS[SCALED_TWINS[target] if ctx.config.recipe != "block" else target]


def scaled_call(
    ctx: PassContext, target, names: list[str], weight: fx.Node, op_kwargs: dict
) -> tuple[object, dict]:
    """(target, kwargs) of a linear in the configured recipe: the block recipe's op as given, or
    its scaled twin (qlinear_scaled, gated_qlinear_scaled) with the recipe's activation scale
    (static or dynamic)."""
    if ctx.config.recipe == "block":
        return target, op_kwargs
    if target not in SCALED_TWINS:
        raise ValueError(f"{target} has no kernel in the {ctx.config.recipe} recipe")
    kwargs = {**op_kwargs, "recipe": ctx.config.recipe, "x_scale": static_act_scale(ctx, names, weight)}
    if ctx.config.act_amax_ub:
        kwargs["amax_ub"] = ctx.config.act_amax_ub
    if ctx.config.cublas_fast_accum():
        kwargs["fast_accum"] = True
    return SCALED_TWINS[target], kwargs


def emit_fp8(
    ctx: PassContext,
    match: LinearMatch,
    name: str,
    kind: str,
    target,
    activations: tuple[fx.Node, ...],
    weights: list[fx.Node],
    bias: fx.Node | None,
    op_kwargs: dict,
    before: fx.Node | None = None,
    record_skip: bool = True,
    names: list[str] | None = None,
):
    """Insert target(*activations, w_fp8, w_scale, bias, **op_kwargs) before `before` (default
    match.node), the activations viewed as the matmul's (M, K), behind the M dispatch; w_fp8 and
    w_scale are the graph inputs of the weights' FP8 copy (fp8_weight_inputs). In the rowwise and
    tensor recipes a linear becomes qlinear_scaled (scaled_call; names: the module names of the
    linears over this x, default [name], for their static activation scale). Returns
    (output node, dispatch sides, (N, K)), or None (after recording why, if record_skip) when
    no M dispatch can be built."""
    m = match.x.meta["val"].shape[0]
    why = dispatch.gpu_why_not(ctx, registry_op(ctx, target), match.weight.meta["val"].device)
    if why is not None:  # before the weights are quantized: no copies no kernel would read
        if record_skip:
            ctx.skipped(kind, name, why, "x".join(map(str, match.weight.meta["val"].shape)))
        return None
    with ctx.gm.graph.inserting_before(before or match.node):
        w_fp8, w_scale = fp8_weight_inputs(ctx, name, weights, match.transposed, match.index)
        target, op_kwargs = scaled_call(ctx, target, names or [name], match.weight, op_kwargs)
        n, k = w_fp8.meta["val"].shape
        try:
            device, dtype = match.weight.meta["val"].device, activations[0].meta["val"].dtype
            sides = dispatch.plan(ctx, REGISTRY_OPS[target], device, n, k, m, dtype)
            # unused if NoDispatch: removed as dead code. A K of part of a group: zero columns up
            # to the copy's (the block recipe's weights.fp8_weight pads the weight alike).
            flat = [dispatch.pad_k(ctx, dispatch.flatten(ctx, a), k) for a in activations]
            out = dispatch.emit(
                ctx,
                target,
                (*flat, w_fp8, w_scale, bias),
                {"e8m0": ctx.config.e8m0, **op_kwargs},
                m_source=flat[0],
                sides=sides,
                name=name,
            )
        except dispatch.NoDispatch as reason:
            if record_skip:
                ctx.skipped(kind, name, str(reason), f"{n}x{k}")
            return None
    return out, sides, (n, k)


def replace_with_fp8(
    ctx: PassContext,
    match: LinearMatch,
    param_name: str,
    kind: str,
    target,
    activations: tuple[fx.Node, ...],
    op_kwargs: dict | None = None,
    detail: str = "",
) -> None:
    """match.node -> target(*activations, w_fp8, w_scale, bias) behind the M dispatch. The
    weight's FP8 copy is made here, at compile time, and becomes a graph input the backend looks
    up per call from the parameter passed."""
    name = module_name(param_name) + ("" if match.index is None else f"[{match.index}]")
    emitted = emit_fp8(
        ctx, match, name, kind, target, activations, [match.weight], match.bias, op_kwargs or {}
    )
    if emitted is None:
        return
    out, sides, (n, k) = emitted
    ctx.replace_uses(match.node, out)
    ctx.gm.graph.erase_node(match.node)
    detail = ", ".join(filter(None, (detail, padded_k(match, k))))
    ctx.rewrote(kind, name, match.x.meta["val"].shape[0], n, k, [(s.label, s.kernel) for s in sides], detail)


def padded_k(match: LinearMatch, k: int) -> str:
    """The report's note for a linear whose FP8 copy pads K (k) past the weight's own."""
    w_val = match.weight_val
    own = w_val.shape[0] if match.transposed else w_val.shape[1]
    return f"K={own} padded to {k}" if own != k else ""


def linear_replacement(ctx: PassContext, match: LinearMatch, param: torch.Tensor, param_name: str) -> None:
    replace_with_fp8(ctx, match, param_name, "linear", torch.ops.fp8compile.qlinear.default, (match.x,))


def linear_pass(ctx: PassContext) -> None:
    for node in [n for n in ctx.gm.graph.nodes if n.op == "call_function" and n.target in MATMULS]:
        found = linear_pattern(node)
        found = selected_linear(node) or found
        if found is None or (not isinstance(found, LinearMatch) and ctx.parameter(found) is None):
            continue  # activation x activation: not a linear
        if isinstance(found, LinearMatch) and _derives_from_placeholder(found.x) is found.weight:
            continue  # x @ x.t(): both sides are the same activation
        weight = found.weight if isinstance(found, LinearMatch) else found
        param = ctx.parameter(weight)
        value, input_name = ctx.inputs.get(weight, (None, weight.name))
        name = module_name(param[1] if param else (input_name or weight.name))
        if isinstance(found, LinearMatch) and found.index is not None:
            name += f"[{found.index}]"
        ctx.at_site(
            name, lambda node=node, found=found, name=name: _linear_site(ctx, node, found, name, param, value)
        )


def _linear_site(ctx: PassContext, node: fx.Node, found, name: str, param, value) -> None:
    """found (a LinearMatch, or the weight placeholder of a form not supported) rewritten, or
    kept bf16 with the reason; param the model parameter behind its weight, value its input."""
    weight = found.weight if isinstance(found, LinearMatch) else found
    w_val = found.weight_val if isinstance(found, LinearMatch) else weight.meta["val"]
    shape = "x".join(map(str, w_val.shape))
    if not isinstance(found, LinearMatch):
        ctx.skipped("linear", name, _unsupported_weight_reason(node, weight), shape)
    elif param is None:
        kind = "buffer or input" if isinstance(value, torch.Tensor) else "graph input"
        ctx.skipped(
            "linear",
            name,
            f"weight is a {kind}, not a parameter: it may change between calls, "
            "so it is not quantized at compile time",
            shape,
        )
    elif (reason := linear_extra_check(ctx, found, name)) is not None:
        ctx.skipped("linear", name, reason, shape)
    else:
        linear_replacement(ctx, found, *param)


def _unsupported_weight_reason(node: fx.Node, placeholder: fx.Node) -> str:
    path, dtype = _path(node, placeholder), node.meta["val"].dtype
    if dtype not in dtypes.SERVED and "convert_element_type" in path:
        name = dtypes.name(dtype)
        return f"dtype {name}: its weight cast to {name} (a router's scores), a precision the model asked for"
    return f"weight reaches the matmul through {path}; only a plain transpose is supported"


def _path(node: fx.Node, placeholder: fx.Node) -> str:
    ops, cur = [], node.args[-1] if node.target == aten.mm.default else node.args[2]
    while cur is not placeholder and cur.op == "call_function":
        ops.append(getattr(cur.target, "__name__", str(cur.target)))
        cur = cur.all_input_nodes[0]
    return " -> ".join(reversed(ops)) or "an unsupported form"
