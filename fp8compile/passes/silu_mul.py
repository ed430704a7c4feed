"""silu_mul pass: down(act(a, b)) -> fp8compile::gated_qlinear(a, b, w_down's FP8 copy), act silu,
swigluoai, silu_limit or gelu_tanh; gated_qlinear_scaled in the rowwise and tensor recipes
(linear.scaled_call).

A gated MLP writes the bf16 product silu(gate(x)) * up(x) to memory only to read it back and
quantize it for the down projection. The fused op computes the product in fp32 and quantizes
it in the same pass (1x128 groups, or the scaled recipes' scale per token or tensor; inside the
decode GEMM at small M), so the product is never written in bf16 and never quantized twice.
gate and up stay ordinary linears (linear_pass rewrites them); a and b may also be the two
halves of one fused gate_up linear (chunk/split).

silu as it reaches the ATen graph (after Inductor's decompositions):
    x / (1 + exp(-x))       F.silu, nn.SiLU, transformers' ACT2FN["silu"] (fp32 round trip)
    x * sigmoid(x)          written by hand
    aten.silu(x)            where it is not decomposed
and GPT-OSS's swigluoai, (clamp(up, -l, l) + 1) * (g * sigmoid(alpha * g)), g = clamp(gate, max=l),
over interleaved (gate_up[..., ::2], [..., 1::2]) or concatenated halves; and DeepSeek-V4's
silu_limit, silu(clamp(gate, max=l)) * clamp(up, -l, l); and Gemma's gelu_tanh(gate) * up, gelu's
tanh form as its decomposition writes it,
    0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))      (x^3 as x * x * x or pow(x, 3))
or aten.gelu(x, approximate="tanh") where it is not decomposed.
This pass must run before linear_pass: it claims the down projection's matmul.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.fx as fx

from . import dtypes
from .context import PassContext
from .linear import MATMULS, LinearMatch, linear_extra_check, linear_pattern, module_name, replace_with_fp8

aten, prims = torch.ops.aten, torch.ops.prims
_CASTS = (prims.convert_element_type.default, aten._to_copy.default)
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _strip(node, targets):
    while isinstance(node, fx.Node) and node.target in targets:
        node = node.args[0]
    return node


def _is(node, target, *args) -> bool:
    """Whether node calls target with leading arguments args (same node through casts, or equal;
    None matches anything)."""
    return (
        isinstance(node, fx.Node)
        and node.target == target
        and all(a is None or (i < len(node.args) and _same(node.args[i], a)) for i, a in enumerate(args))
    )


def _same(x, y) -> bool:
    return _strip(x, _CASTS) is _strip(y, _CASTS) if isinstance(x, fx.Node) else x == y


def _is_exp_neg_plus_one(node, x) -> bool:
    """1 + exp(-x), in either operand order."""
    if not _is(node, aten.add.Tensor):
        return False
    a, b = node.args[:2]
    return any(
        _is(e, aten.exp.default) and _is(e.args[0], aten.neg.default, x) and o == 1
        for e, o in ((a, b), (b, a))
    )


def _is_sigmoid_of(node, x) -> bool:
    node = _strip(node, _CASTS)
    if _is(node, aten.sigmoid.default, x):
        return True
    return _is(node, aten.reciprocal.default) and _is_exp_neg_plus_one(node.args[0], x)


def silu_input(node) -> fx.Node | None:
    """x (before any dtype round trip) if node computes silu(x), else None."""
    node = _strip(node, _CASTS)
    if _is(node, aten.silu.default):
        return _strip(node.args[0], _CASTS)
    if _is(node, aten.div.Tensor) and _is_exp_neg_plus_one(node.args[1], node.args[0]):
        return _strip(node.args[0], _CASTS)
    if _is(node, aten.mul.Tensor):
        for x, s in (node.args[:2], reversed(node.args[:2])):
            if isinstance(x, fx.Node) and _is_sigmoid_of(s, x):
                return _strip(x, _CASTS)
    return None


def _scaled_by(node, value: float, target=aten.mul.Tensor) -> fx.Node | None:
    """y if node = target(y, value) in either operand order (value a number, to 1e-6), else None."""
    node = _strip(node, _CASTS)
    if not _is(node, target):
        return None
    for y, c in (node.args[:2], reversed(node.args[:2])):
        if isinstance(y, fx.Node) and isinstance(c, (int, float)) and math.isclose(c, value, rel_tol=1e-6):
            return y
    return None


def _is_power_of(node, x, n: int) -> bool:
    """node = x^n, for n 2 or 3, as pow(x, n) or a product of x's."""
    node = _strip(node, _CASTS)
    if _is(node, aten.pow.Tensor_Scalar, x, n):
        return True
    if not _is(node, aten.mul.Tensor):
        return False
    p, q = node.args[:2]
    if n == 2:
        return _same(p, x) and _same(q, x)
    return (_same(p, x) and _is_power_of(q, x, 2)) or (_same(q, x) and _is_power_of(p, x, 2))


def _half_x_one_plus(node) -> Iterator[tuple[fx.Node, fx.Node]]:
    """(x, f) for each way node reads as 0.5 x * (1 + f), gelu's form (f = erf(x / sqrt 2) or
    tanh(sqrt(2 / pi) (x + 0.044715 x^3))), in either operand order."""
    node = _strip(node, _CASTS)
    if not _is(node, aten.mul.Tensor):
        return
    for half, one in (node.args[:2], node.args[1::-1]):
        x, f = _scaled_by(half, 0.5), _strip(_scaled_by(one, 1, aten.add.Tensor), _CASTS)
        if x is not None and isinstance(f, fx.Node):
            yield x, f


def gelu_tanh_input(node) -> fx.Node | None:
    """x (before any dtype round trip) if node computes gelu(x, approximate="tanh"), else None."""
    node = _strip(node, _CASTS)
    if _is(node, aten.gelu.default):
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return _strip(node.args[0], _CASTS) if approximate == "tanh" else None
    for x, t in _half_x_one_plus(node):
        if not _is(t, aten.tanh.default):
            continue
        inner = _strip(_scaled_by(t.args[0], math.sqrt(2 / math.pi)), _CASTS)
        if not _is(inner, aten.add.Tensor):
            continue
        for y, cubic in (inner.args[:2], inner.args[1::-1]):
            if _same(y, x) and _is_power_of(_scaled_by(cubic, 0.044715), x, 3):
                return _strip(x, _CASTS)
    return None


def _is_plain_gelu(node) -> bool:
    """Whether node is gelu(x) of one tensor, erf or tanh form: GPT-2's, Phi's or BLOOM's MLP
    activation, a product of two factors of x but no gated product."""
    for x, f in _half_x_one_plus(node):
        if f.target in (aten.tanh.default, aten.erf.default):
            frontier = f.all_input_nodes
            for _ in range(6):  # f's argument is x scaled (erf) or x + 0.044715 x^3 scaled (tanh)
                if any(_same(n, x) for n in frontier):
                    return True
                frontier = [i for n in frontier for i in n.all_input_nodes]
    return False


def _exact_upcast_source(node):
    """The 16-bit tensor node casts to fp32 (exactly: an up projection read as up.float(), as
    Beam's experts multiply it with act(gate.float())), else node itself."""
    if (
        isinstance(node, fx.Node)
        and node.target in _CASTS
        and node.meta["val"].dtype == torch.float32
        and isinstance(node.args[0], fx.Node)
        and node.args[0].meta["val"].dtype in dtypes.SERVED
    ):
        return node.args[0]
    return node


def _clamped(node) -> tuple[fx.Node, float | None, float | None]:
    """(x, lo, hi) for node = clamp(x, lo, hi) written with clamp / clamp_min / clamp_max."""
    lo = hi = None
    node = _strip(node, _CASTS)
    while isinstance(node, fx.Node) and node.target in (
        aten.clamp.default,
        aten.clamp_min.default,
        aten.clamp_max.default,
    ):
        if node.target == aten.clamp.default:
            lo, hi = (node.args + (None, None))[1:3] if lo is None and hi is None else (lo, hi)
        elif node.target == aten.clamp_min.default:
            lo = node.args[1]
        else:
            hi = node.args[1]
        node = _strip(node.args[0], _CASTS)
    return node, lo, hi


def swigluoai_inputs(h: fx.Node) -> tuple[fx.Node, fx.Node, dict] | None:
    """(gate, up, op kwargs) if h = (clamp(up, -l, l) + 1) * (g * sigmoid(alpha * g)) with
    g = clamp(gate, max=l): GPT-OSS's activation, as transformers writes it."""
    for plus_one, glu in (h.args[:2], reversed(h.args[:2])):
        plus_one, glu = _strip(plus_one, _CASTS), _strip(glu, _CASTS)
        if not (_is(plus_one, aten.add.Tensor) and 1 in plus_one.args[:2] and _is(glu, aten.mul.Tensor)):
            continue
        up_c = next(a for a in plus_one.args[:2] if isinstance(a, fx.Node))
        for g, s in (glu.args[:2], reversed(glu.args[:2])):
            s = _strip(s, _CASTS)
            if not (_is(s, aten.sigmoid.default) and _is(_strip(s.args[0], _CASTS), aten.mul.Tensor)):
                continue
            scaled = _strip(s.args[0], _CASTS)
            alphas = [a for a in scaled.args[:2] if isinstance(a, float)]
            if not alphas or not any(isinstance(x, fx.Node) and _same(x, g) for x in scaled.args[:2]):
                continue
            gate, lo_g, limit = _clamped(g)
            up, lo_u, hi_u = _clamped(up_c)
            if lo_g is None and limit is not None and hi_u == limit and lo_u == -limit:
                return gate, up, {"activation": "swigluoai", "alpha": float(alphas[0]), "limit": float(limit)}
    return None


def silu_limit_inputs(gate_c: fx.Node, up_c: fx.Node) -> tuple[fx.Node, fx.Node, dict] | None:
    """(gate, up, op kwargs) if gate_c = clamp(gate, max=l) and up_c = clamp(up, -l, l), the
    silu's input and the other factor of a product: DeepSeek-V4's clamped SwiGLU (swiglu_limit)."""
    gate, lo_g, limit = _clamped(gate_c)
    up, lo_u, hi_u = _clamped(up_c)
    if lo_g is None and isinstance(limit, (int, float)) and hi_u == limit and lo_u == -limit:
        return gate, up, {"activation": "silu_limit", "limit": float(limit)}
    return None


def silu_mul_pattern(h: fx.Node) -> tuple[fx.Node, fx.Node, dict] | str | None:
    """(a, b, op kwargs) if h is a view of act(a, b) (silu, swigluoai, silu_limit, gelu_tanh) over
    two bf16 tensors of one shape; a reason if h is a gated product with another activation; None if h is no
    product at all. A product computed in fp32 from the bf16 halves and cast back (Beam's
    act(gate.float()) * up.float()) is one too: the fused op computes it in fp32 and quantizes it
    without the bf16 rounding in between."""
    k = h.meta["val"].shape[-1]  # the linear's K
    h = _strip(h, (*_VIEWS, *_CASTS))
    if not _is(h, aten.mul.Tensor) or not all(isinstance(a, fx.Node) for a in h.args[:2]):
        return None
    candidates = [(silu_input(p), _exact_upcast_source(q), {}) for p, q in (h.args[:2], reversed(h.args[:2]))]
    candidates.append(swigluoai_inputs(h) or (None, None, {}))
    gelu = {"activation": "gelu_tanh"}
    candidates += [
        (gelu_tanh_input(p), _exact_upcast_source(q), gelu) for p, q in (h.args[:2], reversed(h.args[:2]))
    ]
    for a, b, kwargs in candidates:
        if a is None:
            continue
        if not kwargs and _clamped(a)[0] is not a:  # silu of a clamped gate
            limited = silu_limit_inputs(a, b)
            if limited is not None:
                a, b, kwargs = limited
            elif not dtypes.served({a.meta["val"].dtype, b.meta["val"].dtype}):
                # (a bf16 clamp is just how a was made: silu(a) * b is fused over it below)
                return "silu(clamp(a)) * b with clamps other than DeepSeek-V4's (a <= l, -l <= b <= l)"
        a_val, b_val = a.meta["val"], b.meta["val"]
        if a_val.shape != b_val.shape or not dtypes.served({a_val.dtype, b_val.dtype}):
            return (
                f"act(a, b) over {a_val.dtype}/{b_val.dtype} tensors of shapes {tuple(a_val.shape)}, "
                f"{tuple(b_val.shape)}"
            )
        if a_val.shape[-1] != k:  # OLMo-hybrid's per-head gate: rows of a head, reshaped to the heads'
            return (
                f"act(a, b) over rows of {a_val.shape[-1]}, reshaped into the linear's rows of K = {k}: "
                "the fused op reads K from a and b's own rows"
            )
        return a, b, kwargs
    if _is_plain_gelu(h):
        return None  # a non-gated MLP: its down projection is a plain linear
    if all(_chain(p, _PROJECTIONS) for p in h.args[:2]):  # a gated MLP with another activation
        found = [name for p in h.args[:2] for target, name in _ACTIVATIONS if _reaches(p, target)]
        return f"gated product with activation {found[0] if found else 'unknown'}: {FUSED_ACTIVATIONS}"
    return None  # e.g. RMSNorm's x * rsqrt(...): not a gated MLP


FUSED_ACTIVATIONS = "only silu (and its clamped forms) and gelu_tanh are fused"
# where a gated MLP's gate and up come from: bf16 matmuls, or the FP8 GEMM that gate_up or qkv made of them
_PROJECTIONS = (*MATMULS, torch.ops.fp8compile.qlinear.default, torch.ops.fp8compile.qlinear_scaled.default)
_ACTIVATIONS = (
    (aten.erf.default, "gelu"),
    (aten.tanh.default, "tanh / gelu-tanh"),
    (aten.relu.default, "relu"),
    (aten.sigmoid.default, "sigmoid"),
)


def _reaches(node, target, depth: int = 8) -> bool:
    """Whether target is among the ops within `depth` steps upstream of node."""
    frontier = [node]
    for _ in range(depth):
        frontier = [n for n in frontier if isinstance(n, fx.Node) and n.op == "call_function"]
        if any(n.target == target for n in frontier):
            return True
        frontier = [i for n in frontier for i in n.all_input_nodes]
    return False


def _chain(node, targets, depth: int = 12) -> bool:
    """Whether walking back along first arguments from node meets one of targets."""
    for _ in range(depth):
        if not isinstance(node, fx.Node) or node.op != "call_function":
            return False
        if node.target in targets:
            return True
        if not node.args:  # an op of keyword arguments only (Gemma-2's graph on a GPU had one)
            return False
        node = node.args[0]
    return False


def silu_mul_replacement(
    ctx: PassContext,
    match: LinearMatch,
    a: fx.Node,
    b: fx.Node,
    act: dict,
    param: torch.Tensor,
    param_name: str,
) -> None:
    replace_with_fp8(
        ctx,
        match,
        param_name,
        "silu_mul",
        torch.ops.fp8compile.gated_qlinear.default,
        (a, b),
        act,
        detail=act.get("activation", "silu"),
    )


def silu_mul_pass(ctx: PassContext) -> None:
    for node in [n for n in ctx.gm.graph.nodes if n.op == "call_function" and n.target in MATMULS]:
        match = linear_pattern(node)
        if not isinstance(match, LinearMatch) or (param := ctx.parameter(match.weight)) is None:
            continue
        name = module_name(param[1])
        ctx.at_site(name, lambda match=match, param=param, name=name: _silu_mul_site(ctx, match, param, name))


def _silu_mul_site(ctx: PassContext, match: LinearMatch, param: tuple[torch.Tensor, str], name: str) -> None:
    if linear_extra_check(ctx, match, name) is not None:
        return  # stays bf16: linear_pass records why
    found = silu_mul_pattern(match.x)
    if isinstance(found, tuple):
        silu_mul_replacement(ctx, match, *found, *param)
    elif isinstance(found, str):
        ctx.skipped("silu_mul", name, found)
