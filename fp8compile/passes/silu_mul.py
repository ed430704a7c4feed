"""silu_mul pass: down(silu(a) * b) -> fp8compile::silu_mul_linear(a, b, w_down).

A gated MLP writes the bf16 product silu(gate(x)) * up(x) to memory only to read it back and
quantize it for the down projection. The fused op computes the product in fp32 and quantizes
it 1x128 in the same pass (inside the decode GEMM at small M), so the product is never
written in bf16 and never quantized twice. gate and up stay ordinary linears (linear_pass
rewrites them); a and b may also be the two halves of one fused gate_up linear (chunk/split).

silu as it reaches the ATen graph (after Inductor's decompositions):
    x / (1 + exp(-x))       F.silu, nn.SiLU, transformers' ACT2FN["silu"] (fp32 round trip)
    x * sigmoid(x)          written by hand
    aten.silu(x)            where it is not decomposed
This pass must run before linear_pass: it claims the down projection's matmul.
"""
from __future__ import annotations

import torch
import torch.fx as fx

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
    return isinstance(node, fx.Node) and node.target == target and all(
        a is None or (i < len(node.args) and _same(node.args[i], a)) for i, a in enumerate(args))


def _same(x, y) -> bool:
    return _strip(x, _CASTS) is _strip(y, _CASTS) if isinstance(x, fx.Node) else x == y


def _is_exp_neg_plus_one(node, x) -> bool:
    """1 + exp(-x), in either operand order."""
    if not _is(node, aten.add.Tensor):
        return False
    l, r = node.args[:2]
    return any(_is(e, aten.exp.default) and _is(e.args[0], aten.neg.default, x) and o == 1
               for e, o in ((l, r), (r, l)))


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


def silu_mul_pattern(h: fx.Node) -> tuple[fx.Node, fx.Node] | str | None:
    """(a, b) if h is a view of silu(a) * b over two bf16 tensors of one shape; a reason if h is
    a gated product with another activation; None if h is no product at all."""
    h = _strip(h, _VIEWS)
    if not _is(h, aten.mul.Tensor) or not all(isinstance(a, fx.Node) for a in h.args[:2]):
        return None
    for p, q in (h.args[:2], reversed(h.args[:2])):
        a = silu_input(p)
        if a is None:
            continue
        a_val, b_val = a.meta["val"], q.meta["val"]
        if a_val.shape != b_val.shape or {a_val.dtype, b_val.dtype} != {torch.bfloat16}:
            return f"silu(a) * b over {a_val.dtype}/{b_val.dtype} tensors of shapes {tuple(a_val.shape)}, {tuple(b_val.shape)}"
        return a, q
    if all(_chain(p, MATMULS) for p in h.args[:2]):  # a gated MLP with another activation
        found = [name for p in h.args[:2] for target, name in _ACTIVATIONS if _reaches(p, target)]
        return f"gated product with activation {found[0] if found else 'unknown'}: only silu(a) * b is fused"
    return None  # e.g. RMSNorm's x * rsqrt(...): not a gated MLP


_ACTIVATIONS = ((aten.erf.default, "gelu"), (aten.tanh.default, "tanh / gelu-tanh"), (aten.relu.default, "relu"),
                (aten.sigmoid.default, "sigmoid"))


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
        node = node.args[0]
    return False


def silu_mul_replacement(ctx: PassContext, match: LinearMatch, a: fx.Node, b: fx.Node,
                         param: torch.nn.Parameter, param_name: str) -> None:
    replace_with_fp8(ctx, match, param, param_name, "silu_mul", torch.ops.fp8compile.silu_mul_linear.default, (a, b))


def silu_mul_pass(ctx: PassContext) -> None:
    for node in [n for n in ctx.gm.graph.nodes if n.op == "call_function" and n.target in MATMULS]:
        match = linear_pattern(node)
        if not isinstance(match, LinearMatch) or (param := ctx.parameter(match.weight)) is None:
            continue
        name = module_name(param[1])
        if linear_extra_check(ctx, match, name) is not None:
            continue  # stays bf16: linear_pass records why
        found = silu_mul_pattern(match.x)
        if isinstance(found, tuple):
            silu_mul_replacement(ctx, match, *found, *param)
        elif isinstance(found, str):
            ctx.skipped("silu_mul", name, found)
