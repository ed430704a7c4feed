"""moe pass: a routed-experts block -> fp8compile::moe(x, topk_ids, topk_weights, w13, w2, ...).

A block is found from its expert GEMMs: a batched matmul whose weight operand is a stacked
(E, N, K) parameter, either whole (aten._grouped_mm with expert offsets: transformers'
"grouped_mm" experts) or gathered per token-slot (index(W, [ids]) into bmm: transformers'
"batched_mm" experts, gpt-fast's einsum over w1[ids]). The down projection is the expert GEMM
whose input is act(gate, up) (silu, swigluoai, silu_limit or gelu_tanh, the silu_mul pass's matcher); gate
and up are the two halves of one expert GEMM (split: concatenated, stride-2 slices: interleaved)
or two expert GEMMs (w1 and w3). Non-gated experts (Nemotron-H's down(relu(up(x))^2)) have a
down projection whose input is an activation of one expert GEMM alone (gate_up "none"). From
there the pass walks the graph to the block's other ends:
    hidden states x (T, H)   back from the gate/up GEMM through views and the token gather;
    topk_ids (T, k)          the index of the weight gather, or the input of the expert sort;
    output (T, H)            forward from the down GEMM through the bias, the routing-weight
                             multiply, the un-permute and the sum over the k slots;
    topk_weights (T, k)      the other operand of that multiply (or of the einsum's bmm).
Routing (router linear, softmax, top-k) stays outside the op; shared experts are plain linears.
Dense experts (Llama 4's: every token through every expert's whole weight in a bmm, the router's
top-k scores scaling the inputs) are the same op over each token's top-k slots: moe_dense.py,
which runs after this pass and uses its matchers.

Structure alone can misread a block (a gate/up order, a transposed weight whose shape does not
tell), so every match is checked by running it: the matched subgraph, with the real expert
weights, on a few random tokens and routes, against moe_reference.moe_dense (the unquantized
definition of the op). Only a block that agrees (calc_diff < VERIFY_BOUND) is rewritten; any
other stays bf16 with the reason in the report.
"""

from __future__ import annotations

import dataclasses
import logging
import operator

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..numerics import BLOCK, calc_diff, whole_blocks
from ..ops import activations
from ..ops.moe import reference as moe_reference
from . import dispatch, dtypes, inline
from .context import PassContext
from .replay import ReplayError, concrete, run_subgraph, small_symbols
from .silu_mul import silu_mul_pattern
from ..weights import canonical_expert_bias, canonical_experts, expert_bias, fp8_experts

log = logging.getLogger("fp8compile")
aten, prims = torch.ops.aten, torch.ops.prims
EXPERT_MATMULS = (aten._grouped_mm.default, aten.bmm.default)
# transformers' own grouped GEMM, of _grouped_mm's contract (x (S, K), w (E, K, N), offsets), which
# it runs where _grouped_mm cannot: a float16 or float32 model's "grouped_mm" experts
# (transformers/integrations/moe.py). Known by name: transformers registers it when imported.
GROUPED_MM_FALLBACK = "transformers::grouped_mm_fallback"


def _grouped(node: fx.Node) -> bool:
    """Whether node is a grouped GEMM over expert offsets (aten._grouped_mm or transformers' own)."""
    schema = getattr(node.target, "_schema", None)
    return node.target == aten._grouped_mm.default or getattr(schema, "name", None) == GROUPED_MM_FALLBACK


LAYOUT = (
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.permute.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.expand.default,
    aten.clone.default,
    aten.t.default,
    aten.transpose.int,
    aten.alias.default,
    prims.convert_element_type.default,
    aten._to_copy.default,
)
_INDEX = aten.index.Tensor
# Routing bookkeeping between the top-k ids and the expert offsets of a grouped GEMM.
_ROUTING = (
    aten.sort.default,
    aten.sort.stable,
    aten.histc.default,
    aten.cumsum.default,
    aten.bincount.default,
)

# A correct match differs from moe_reference.moe_dense only by bf16 rounding (measured 1e-5..2e-5);
# a misread one (gate/up swapped, a weight transposed) by far more than FP8's own 2e-3.
VERIFY_BOUND = 3e-4
VERIFY_TOKENS = 3  # each dynamic size is set to at most this while checking a match


@dataclasses.dataclass
class ExpertGemm:
    node: fx.Node
    weight: fx.Node  # placeholder of the stacked (E, ., .) parameter
    activation: fx.Node  # the other operand


@dataclasses.dataclass
class MoeMatch:
    hidden: fx.Node  # (T, H)
    topk_ids: fx.Node  # (T, k)
    topk_weights: fx.Node  # (T, k)
    output: fx.Node  # (T, H)
    w13: fx.Node
    w3: fx.Node | None
    w2: fx.Node
    b13: fx.Node | None
    b2: fx.Node | None
    gate_up: str
    act: dict


class NoMatch(Exception):
    """A candidate block that is not rewritten; the message is the report's reason."""


def _zero_masked(node) -> fx.Node | None:
    """x if node is where(mask, 0, x) or x.masked_fill(mask, 0): the zeroing of expert-parallel
    sentinel rows that transformers applies around its grouped GEMMs (the op drops those rows too)."""
    if node.target == aten.where.self and len(node.args) == 3:
        zero = node.args[1]
        if zero == 0 or (
            isinstance(zero, fx.Node) and zero.target == aten.full.default and zero.args[1] == 0
        ):
            return node.args[2]
    if node.target in (aten.masked_fill.Scalar, aten.masked_fill_.Scalar) and node.args[2] == 0:
        return node.args[0]
    return None


def walk(node, through, want, limit: int = 16):
    """Follow first arguments from node through ops in `through`, getitem and zero masks until want(node)."""
    for _ in range(limit):
        if not isinstance(node, fx.Node):
            return None
        if want(node):
            return node
        if node.op != "call_function":
            return None
        if node.target in through or node.target.__name__ == "getitem":
            node = node.args[0]
        elif (masked := _zero_masked(node)) is not None:
            node = masked
        else:
            return None
    return None


def meta_val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def is_2d(node) -> bool:
    return isinstance(meta_val(node), torch.Tensor) and meta_val(node).dim() == 2


def _shape(node) -> tuple[str, ...]:
    return tuple(str(s) for s in meta_val(node).shape)


def stacked_param(ctx: PassContext, node, dim: int):
    """node if it is the placeholder of a parameter with `dim` dimensions."""
    return (
        node
        if (isinstance(node, fx.Node) and ctx.parameter(node) is not None and meta_val(node).dim() == dim)
        else None
    )


def _gathered(ctx: PassContext, node, dim: int):
    """(parameter, index) if node is parameter[index] through layout ops, else None."""
    g = walk(node, LAYOUT, lambda n: n.target == _INDEX)
    if g is not None and len(g.args[1]) == 1 and stacked_param(ctx, g.args[0], dim) is not None:
        return g.args[0], g.args[1][0]
    return None


def expert_gemm(ctx: PassContext, node: fx.Node) -> ExpertGemm | None:
    """node as an expert GEMM: one operand a stacked (E, ., .) parameter, whole or gathered."""
    for w, x in (node.args[:2], reversed(node.args[:2])):
        whole = walk(w, LAYOUT, lambda n: stacked_param(ctx, n, 3) is not None)
        if whole is not None and _grouped(node):
            return ExpertGemm(node, whole, x)
        found = _gathered(ctx, w, 3)
        if found is not None:
            return ExpertGemm(node, found[0], x)
    return None


def _bias_add(ctx: PassContext, node: fx.Node):
    """(the other operand, bias parameter) if node adds a gathered (E, N) parameter, else None."""
    if node.target not in (aten.add.Tensor, aten.add_.Tensor):
        return None
    for x, b in (node.args[:2], reversed(node.args[:2])):
        found = _gathered(ctx, b, 2) if isinstance(b, fx.Node) else None
        if found is not None:
            return x, found[0]
    return None


_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)


def _half(node) -> tuple[fx.Node, str, int] | None:
    """(source, layout, which) if node is the first (0) or second (1) half of source's last dim:
    chunk/split for "concat", a stride-2 slice for "interleave"."""
    node = walk(
        node,
        LAYOUT,
        lambda n: (
            n.target == aten.slice.Tensor
            or (n.target.__name__ == "getitem" and getattr(n.args[0], "target", None) in _SPLITS)
        ),
    )
    if node is None:
        return None
    if node.target == aten.slice.Tensor:
        src, dim, start, _, step = (*node.args, *(None, 0, None, None, 1)[len(node.args) :])
        last = dim in (-1, meta_val(src).dim() - 1)
        return (src, "interleave", start) if last and step == 2 and start in (0, 1) else None
    split = node.args[0]
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if dim in (-1, meta_val(split.args[0]).dim() - 1) and len(meta_val(split)) == 2:
        return split.args[0], "concat", node.args[1]
    return None


def _gemm_of(ctx: PassContext, node, gemms: dict[fx.Node, ExpertGemm]):
    """(ExpertGemm, bias parameter or None) that node is, through layout ops and a bias add."""
    node = walk(node, LAYOUT, lambda n: n in gemms or _bias_add(ctx, n) is not None)
    if node is None:
        return None
    bias = None
    if node not in gemms:
        node, bias = _bias_add(ctx, node)
        node = walk(node, LAYOUT, lambda n: n in gemms)
        if node is None:
            return None
    return gemms[node], bias


def gate_up_of(
    ctx: PassContext, a: fx.Node, b: fx.Node, gemms
) -> tuple[ExpertGemm, ExpertGemm | None, fx.Node | None, str]:
    """(gate/up GEMM, separate up GEMM or None, gate/up bias, layout) of act(a, b)."""
    ha, hb = _half(a), _half(b)
    if ha is not None and hb is not None and ha[1] == hb[1] and (ha[2], hb[2]) == (0, 1):
        found, found_b = _gemm_of(ctx, ha[0], gemms), _gemm_of(ctx, hb[0], gemms)
        if found is None or found_b is None or found[0] is not found_b[0] or found[1] is not found_b[1]:
            raise NoMatch("gate and up are halves of something other than one expert GEMM")
        return found[0], None, found[1], ha[1]
    ga, gb = _gemm_of(ctx, a, gemms), _gemm_of(ctx, b, gemms)
    if ga is None or gb is None:
        raise NoMatch("gate and up do not come from expert GEMMs (or up comes before gate)")
    if ga[1] is not None or gb[1] is not None:
        raise NoMatch("separate gate and up expert weights with biases")
    return ga[0], gb[0], None, "separate"


def _forward_to_output(ctx: PassContext, gemm: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None]:
    """(output (T, H), routing-weight operand, down bias) walking forward from the down GEMM to
    the first 2-D tensor after the sum over the k slots."""
    node, weights, bias, reduced = gemm, None, None, False
    for _ in range(16):
        if reduced and is_2d(node):
            if weights is None:
                raise NoMatch("expert outputs are summed without routing weights")
            return node, weights, bias
        if len(node.users) != 1:
            raise NoMatch(f"an intermediate of the experts ({node.name}) is used outside the block")
        user = next(iter(node.users))
        other = [a for a in user.args[:2] if isinstance(a, fx.Node) and a is not node]
        if (
            user.target in LAYOUT
            or (user.target == _INDEX and user.args[0] is node)
            or _zero_masked(user) is node
        ):
            pass
        elif weights is None and bias is None and _bias_add(ctx, user) is not None:
            bias = _bias_add(ctx, user)[1]
        elif weights is None and user.target == aten.mul.Tensor and len(other) == 1:
            weights = other[0]
        elif user.target == aten.sum.dim_IntList and len(user.args[1]) == 1:
            reduced = True
        elif weights is None and user.target == aten.bmm.default and len(other) == 1:
            weights, reduced = other[0], True  # einsum("tki,tk->ti", expert_out, topk_weights)
        else:
            op = getattr(user.target, "__name__", user.target)
            raise NoMatch(f"expert outputs go through {op} before the sum over experts")
        node = user
    raise NoMatch("no sum over experts found after the down projection")


def _two_d(node, through):
    return walk(node, through, is_2d)


def gated_product(g: ExpertGemm):
    """silu_mul_pattern's answer for the product g reads (a, b, act) or a reason, if g reads a
    gated product act(gate) * up; None otherwise (a square x * x is not one)."""
    product = walk(g.activation, LAYOUT, lambda n: n.target == aten.mul.Tensor)
    if product is None or product.args[0] is product.args[1]:
        return None
    return silu_mul_pattern(product)


def _unary_chain(g: ExpertGemm, gemms) -> tuple[ExpertGemm, list[fx.Node]] | None:
    """(the expert GEMM, the ops between, from g back) if what g reads is computed from one other
    expert GEMM alone (layout ops and an elementwise activation such as relu(x)^2), else None."""
    frontier, seen, ops, found = [g.activation], set(), [], set()
    while frontier:
        node = frontier.pop(0)
        if node in seen:
            continue
        seen.add(node)
        if len(seen) > 24 or not isinstance(node, fx.Node) or node.op != "call_function":
            return None  # far, or fed by another input (a gate, a parameter): not one GEMM's activation
        if node.target in (*_SPLITS, aten.slice.Tensor):
            return None  # halves of one GEMM's output: a gated product the matcher did not read
        if node in gemms:
            found.add(node)
        elif (masked := _zero_masked(node)) is not None:  # expert-parallel sentinel rows zeroed
            frontier.append(masked)
        else:
            if node.target not in LAYOUT:
                ops.append(node)
            frontier.extend(node.all_input_nodes)
    return (gemms[found.pop()], ops) if len(found) == 1 else None


def _is_square(node: fx.Node) -> bool:
    return (node.target == aten.pow.Tensor_Scalar and node.args[1] == 2) or (
        node.target == aten.mul.Tensor and node.args[0] is node.args[1]
    )


# what names an activation that non-gated experts compute with ops the op has no kernel for
_ACTIVATION_OPS = {
    aten.erf.default: "gelu",
    aten.tanh.default: "tanh / gelu-tanh",
    aten.sigmoid.default: "sigmoid / silu",
    aten.relu.default: "relu",
}


def _unary_activation(ops: list[fx.Node]) -> str:
    """The non-gated activation these ops (from the down projection's input back) compute, or
    NoMatch naming it."""
    if len(ops) == 2 and _is_square(ops[0]) and ops[1].target == aten.relu.default:
        return "relu2"
    names = [_ACTIVATION_OPS[op.target] for op in ops if op.target in _ACTIVATION_OPS]
    found = names[0] if names else " -> ".join(getattr(op.target, "__name__", str(op.target)) for op in ops)
    raise NoMatch(
        f"non-gated experts with the activation {found or 'identity'}: the non-gated activations with "
        f"a kernel are {', '.join(activations.UNARY_ACTIVATIONS)} (relu(x)^2)"
    )


def match_block(ctx: PassContext, down: ExpertGemm, gemms: dict[fx.Node, ExpertGemm]) -> MoeMatch:
    found = gated_product(down)
    if isinstance(found, str):
        raise NoMatch(found)
    if found is not None:
        a, b, act = found
        gate_up, up, b13, layout = gate_up_of(ctx, a, b, gemms)
    else:  # non-gated: down(act(up(x)))
        chain = _unary_chain(down, gemms)
        if chain is None:
            raise NoMatch(
                "the down projection's input is neither a gated product nor one expert GEMM's activation"
            )
        gate_up, ops = chain
        up, b13, layout, act = None, None, "none", {"activation": _unary_activation(ops)}
    output, weights_operand, b2 = _forward_to_output(ctx, down.node)
    # The hidden states: the first tensor back from the gate/up GEMM (through views and the
    # token gather) with the output's shape (T, H).
    hidden = walk(gate_up.activation, (*LAYOUT, _INDEX), lambda n: is_2d(n) and _shape(n) == _shape(output))
    if hidden is None:
        raise NoMatch(f"no input of the gate/up projection has the output's shape {list(_shape(output))}")
    ids = _ids(ctx, gate_up, down)
    topk_weights = walk(weights_operand, (*LAYOUT, _INDEX), lambda n: is_2d(n) and _shape(n) == _shape(ids))
    if topk_weights is None:
        raise NoMatch("routing weights of shape (tokens, top_k) not found")
    if up is not None and up.weight is gate_up.weight:
        raise NoMatch("gate and up read the same expert weights")
    return MoeMatch(
        hidden,
        ids,
        topk_weights,
        output,
        gate_up.weight,
        None if up is None else up.weight,
        down.weight,
        b13,
        b2,
        layout,
        act,
    )


_CLAMPS = (aten.clamp_min.default, aten.clamp_max.default, aten.clamp.default)


def _unclamped(index, experts: int):
    """The index of a weight gather without clamps to [0, E - 1] on its way from the router's
    top-k: transformers 5.17's batched_mm clamps every id (later versions only expert-parallel
    sentinels). Ids top-k drew from E experts' scores are in range, so such a clamp changes
    nothing; any other clamp, or a clamp of ids from elsewhere, stays and ends the match."""
    node, crossed = index, False
    for _ in range(16):
        if not isinstance(node, fx.Node) or node.op != "call_function":
            break
        if node.target in _CLAMPS:
            low = node.args[1] if node.target != aten.clamp_max.default else None
            high = (
                node.args[1]
                if node.target == aten.clamp_max.default
                else (node.args[2] if node.target == aten.clamp.default and len(node.args) > 2 else None)
            )
            if any(not isinstance(b, (int, float)) for b in (low, high) if b is not None):
                return index  # a bound only known at run time
            if (low is not None and low > 0) or (high is not None and high < experts - 1):
                return index
            node, crossed = node.args[0], True
        elif node.target in LAYOUT:
            node = node.args[0]
        else:
            break
    if not crossed:
        return index
    source = _two_d(node, LAYOUT)
    is_topk = (
        source is not None
        and source.target is operator.getitem
        and source.args[1] == 1
        and source.args[0].target == aten.topk.default
        and meta_val(source.args[0].args[0]).shape[-1] == experts
    )  # top-k over E scores
    return node if is_topk else index


def _ids(ctx: PassContext, gate_up: ExpertGemm, down: ExpertGemm) -> fx.Node:
    """topk_ids (T, k): the index of a weight gather, or what the grouped GEMM's offsets count."""
    for g in (gate_up, down):
        if _grouped(g.node):
            offsets = g.node.args[2] if len(g.node.args) > 2 else g.node.kwargs.get("offs")
            ids = _two_d(offsets, (*LAYOUT, *_ROUTING))
        else:
            weight, index = _gathered(ctx, next(a for a in g.node.args[:2] if a is not g.activation), 3)
            ids = _two_d(_unclamped(index, meta_val(weight).shape[0]), LAYOUT)
        if ids is not None and not meta_val(ids).dtype.is_floating_point:
            return ids
    raise NoMatch("top-k expert ids of shape (tokens, top_k) not found")


def check_block(m: MoeMatch) -> tuple[int, int, int]:
    """(E, I, H) of a matched block, or NoMatch saying why it stays as it is."""
    x, w13, w2 = meta_val(m.hidden), meta_val(m.w13), meta_val(m.w2)
    # bfloat16 or float16: the op writes x.dtype (ops/moe/reference.py says how it rounds)
    if (why := dtypes.why_not({x.dtype, w13.dtype, w2.dtype}, "experts")) is not None:
        raise NoMatch(why)
    # Routing weights come as the router made them (fp32 from a softmax in many models); their
    # product with the experts' output, and so the block's output, is then fp32 too, cast back
    # to bf16 after the sum over the k slots. The op takes the weights as they are and sums in fp32.
    for what, node in (("routing weights", m.topk_weights), ("output", m.output)):
        if meta_val(node).dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise NoMatch(
                f"{what} of dtype {dtypes.name(meta_val(node).dtype)}: bfloat16, float16 or "
                "float32 are rewritten"
            )
    e, h = w13.shape[0], x.shape[1]
    inter = (w13.shape[1] * w13.shape[2] // h) // (1 if m.gate_up in ("separate", "none") else 2)
    if h % BLOCK:  # an intermediate size of part of a block is padded (weights.fp8_experts)
        raise NoMatch(f"hidden size {h} is not a multiple of {BLOCK} (128x128 blocks per expert)")
    return e, inter, h


def _n13(m: MoeMatch, inter: int) -> int:
    """Rows of the first expert GEMM in its FP8 copy (inter in whole blocks): gate and up
    (2I, "separate" stacked), or up alone (I)."""
    return inter if m.gate_up == "none" else 2 * inter


def weight_orientations(m: MoeMatch, e: int, inter: int, h: int) -> list[bool]:
    """w_kn values the weight shapes allow (both when I == H: the shapes cannot tell)."""
    n13 = inter if m.gate_up in ("separate", "none") else 2 * inter  # rows of the w13 tensor itself
    w13, w2 = tuple(meta_val(m.w13).shape), tuple(meta_val(m.w2).shape)
    return [
        kn
        for kn in (False, True)
        if w13 == ((e, h, n13) if kn else (e, n13, h)) and w2 == ((e, inter, h) if kn else (e, h, inter))
    ]


def verify(ctx: PassContext, m: MoeMatch, w_kn: bool) -> float:
    """calc_diff between the matched subgraph, run on random tokens and routes with the real
    weights, and moe_reference.moe_dense read with this interpretation."""
    symbols = small_symbols(ctx, VERIFY_TOKENS)
    param = {n: ctx.parameter(n)[0] for n in (m.w13, m.w3, m.w2, m.b13, m.b2) if n is not None}
    device = param[m.w13].device
    gen = torch.Generator(device).manual_seed(0)
    x_val, ids_val = meta_val(m.hidden), meta_val(m.topk_ids)
    t, k = concrete(ids_val.shape[0], symbols), concrete(ids_val.shape[1], symbols)
    num_experts = meta_val(m.w13).shape[0]
    with unset_fake_temporarily(), torch.no_grad():
        x = torch.randn(t, x_val.shape[1], generator=gen, device=device).to(x_val.dtype)
        ids = torch.randint(0, num_experts, (t, k), generator=gen, device=device).to(ids_val.dtype)
        weights = torch.rand(t, k, generator=gen, device=device).to(meta_val(m.topk_weights).dtype)
        try:
            env = {m.hidden: x, m.topk_ids: ids, m.topk_weights: weights}
            got = run_subgraph(ctx, env, m.output, symbols, "the experts")
        except ReplayError as e:
            raise NoMatch(str(e)) from None
        layout = m.gate_up
        w13 = canonical_experts(param[m.w13], w_kn, layout, param.get(m.w3))
        w2 = canonical_experts(param[m.w2], w_kn)
        b13 = canonical_expert_bias(param.get(m.b13), layout)
        want = moe_reference.moe_dense(x, ids, weights, w13, w2, b13, param.get(m.b2), **m.act)
        return calc_diff(got, want)


def block_name(ctx: PassContext, down_weight: fx.Node) -> str:
    """The experts module: the down projection parameter's owner ("model.layers.0.mlp.experts")."""
    name = ctx.parameter(down_weight)[1]
    return name.rsplit(".", 1)[0] if "." in name else "(top level)"


ROUTER_UNQUANTIZED = (
    "router of a rewritten MoE block: kept in the model's dtype, as DeepSeek-V3 keeps its gate, "
    "since FP8 error would change which experts tokens go to"
)


def _router(topk_ids: fx.Node, depth: int = 12) -> fx.Node | None:
    """The matmul nearest upstream of the top-k that produced topk_ids: the router's linear."""
    frontier, seen = [topk_ids], set()
    for _ in range(depth):
        frontier = [i for n in frontier for i in n.all_input_nodes if i not in seen]
        seen.update(frontier)
        found = [n for n in frontier if n.target in (aten.mm.default, aten.addmm.default)]
        if found:
            return found[0]
    return None


def moe_replacement(
    ctx: PassContext, m: MoeMatch, e: int, inter: int, h: int, w_kn: bool, name: str, dense_k: int = 0
) -> None:
    """m.output -> fp8compile::moe behind the token-count dispatch. The expert weights' FP8 copies
    (and the reordered gate/up bias) are made here, at compile time, into the memo the op reads.
    dense_k: m is dense experts over their slots (moe_dense.py), k rows a token, summed here."""
    param = {n: ctx.parameter(n)[0] for n in (m.w13, m.w3, m.w2, m.b13) if n is not None}
    device = param[m.w13].device
    top_k = meta_val(m.topk_ids).shape[1]
    inter_bf16, inter = inter, whole_blocks(inter)  # the kernels' sizes are the FP8 copies'
    n13 = _n13(m, inter)
    # Every MoE kernel writes its expert GEMMs' products in bfloat16, whatever the model's dtype
    # (DeepGEMM's only output dtype; ops/moe/reference.py), and the op its output in x.dtype from
    # its own fp32 sum: the kernels' request is a bfloat16 one for a float16 model's experts too.
    try:  # before the copies are made: no FP8 copies where no kernel would read them
        sides = dispatch.plan(ctx, "moe", device, n13, h, meta_val(m.hidden).shape[0], torch.bfloat16)
    except dispatch.NoDispatch as reason:
        raise NoMatch(str(reason)) from None
    fp8_experts(param[m.w13], w_kn, ctx.config.e8m0, m.gate_up, param.get(m.w3))
    fp8_experts(param[m.w2], w_kn, ctx.config.e8m0)
    expert_bias(param.get(m.b13), m.gate_up)
    for cut in (
        inline.moe_decode_cut(ctx, e, top_k, device),
        inline.moe_gluon_cut(ctx, e, top_k, n13, inter, h, device),
    ):
        if cut is not None and not ctx.moving_ints:  # a cut is a cond (dispatch._by_rows says why not)
            sides = dispatch.split(sides, cut, inline.MOE_BACKEND)
    kwargs = {
        "e8m0": ctx.config.e8m0,
        "w_kn": w_kn,
        "gate_up": m.gate_up,
        "batch_invariant": ctx.config.batch_invariant,
        **m.act,
    }
    if inline.moe_launch_wanted(ctx, sides, e, top_k, n13, inter, h, device):
        kwargs[inline.LAUNCH_OPERANDS] = _fp8_expert_inputs(ctx, m, w_kn, name, inter != inter_bf16)
    with ctx.gm.graph.inserting_before(m.output):
        try:
            out = dispatch.emit(
                ctx,
                torch.ops.fp8compile.moe.default,
                (m.hidden, m.topk_ids, m.topk_weights, m.w13, m.w2, m.w3, m.b13, m.b2),
                kwargs,
                m_source=m.hidden,
                sides=sides,
                name=name,
            )
        except dispatch.NoDispatch as reason:
            raise NoMatch(str(reason)) from None
        if dense_k > 1:  # the k slots of each token
            out = ctx.gm.graph.call_function(aten.view.default, (out, [-1, dense_k, h]))
            out.meta["val"] = ctx.fake(aten.view.default, out.args[0], [-1, dense_k, h])
            out = ctx.gm.graph.call_function(aten.sum.dim_IntList, (out, [1]))
            out.meta["val"] = ctx.fake(aten.sum.dim_IntList, out.args[0], [1])
        dtype = meta_val(m.output).dtype
        if dtype != meta_val(out).dtype:
            # The op writes x.dtype from its fp32 sum; the block gave the weights' dtype (fp32).
            # Mixtral and DeepSeek-V3 cast that to bf16 next, so their numbers round once, as before.
            out = ctx.gm.graph.call_function(prims.convert_element_type.default, (out, dtype))
            out.meta["val"] = ctx.fake(prims.convert_element_type.default, out.args[0], dtype)
    ctx.replace_uses(m.output, out)
    router = _router(m.topk_ids)
    if router is not None:
        ctx.keep_bf16[router] = ROUTER_UNQUANTIZED
    bias = ", bias" if m.b13 is not None or m.b2 is not None else ""
    detail = f"{e} experts, top-{dense_k or top_k}, {m.gate_up}{bias}"
    detail += f", {m.act.get('activation', 'silu')}"
    if dense_k:
        detail += ", dense (router-scaled inputs: a top-1 row per slot)"
    if inter != inter_bf16:
        detail += f", intermediate {inter_bf16} padded to {inter}"
    m_desc = meta_val(m.hidden).shape[0]
    ctx.rewrote("moe", name, m_desc, n13, h, [(s.label, s.kernel) for s in sides], detail)


def _fp8_expert_inputs(ctx: PassContext, m: MoeMatch, w_kn: bool, name: str, padded: bool) -> tuple:
    """(w13_fp8, w13_scale, w2_fp8, w2_scale, b13 in their row order and padding or None) as graph
    inputs the backend derives per call from the parameters passed (what a traced launch reads);
    padded: the intermediate size is padded to whole blocks."""
    e8m0, gate_up = ctx.config.e8m0, m.gate_up
    w13 = ctx.derived_inputs(
        ("experts", w_kn, e8m0, gate_up),
        (f"{name}_w13_fp8", f"{name}_w13_fp8_scale"),
        [m.w13] + ([m.w3] if m.w3 is not None else []),
        lambda w, w3=None: fp8_experts(w, w_kn, e8m0, gate_up, w3),
        memo=True,
        release_now=False,  # the op takes the bf16 experts too (its eager sides look their copies up)
    )
    w2 = ctx.derived_inputs(
        ("experts", w_kn, e8m0),
        (f"{name}_w2_fp8", f"{name}_w2_fp8_scale"),
        [m.w2],
        lambda w: fp8_experts(w, w_kn, e8m0),
        memo=True,
        release_now=False,
    )
    b13 = m.b13
    if b13 is not None and (gate_up == "interleave" or padded):  # the bias rows follow the weight's rows
        (b13,) = ctx.derived_inputs(
            ("expert_bias", gate_up), (f"{name}_b13_ordered",), [m.b13], lambda b: (expert_bias(b, gate_up),)
        )
    return (*w13, *w2, b13)


def _is_down_projection(g: ExpertGemm, gemms) -> bool:
    """Whether g reads a gated product act(gate) * up, or an activation of one other expert
    GEMM (non-gated experts): g is then a block's down projection."""
    return gated_product(g) is not None or _unary_chain(g, gemms) is not None


def _one_hot_mask_leaves_graph(ctx: PassContext) -> bool:
    """Whether a one-hot of expert ids (one_hot, or eq(ids[..., None], iota(E))) reaches the
    graph's outputs: the routing mask of a Python loop over experts, returned to Python."""
    output = next(iter(ctx.gm.graph.find_nodes(op="output")))
    for node in ctx.gm.graph.nodes:
        one_hot = node.target == aten.one_hot.default or (
            node.target == aten.eq.Tensor
            and any(getattr(a, "target", None) == prims.iota.default for a in node.args)
        )
        if one_hot:
            frontier = [node]
            for _ in range(8):
                frontier = [u for n in frontier for u in n.users]
                if output in frontier:
                    return True
    return False


EXPERT_LOOP = (
    "the routing mask (a one-hot of expert ids) leaves the graph: the experts run as a Python loop over "
    "the experts hit, which Dynamo splits into graphs around data-dependent shapes, so their matmuls run "
    "in bf16 outside any graph. transformers models whose experts take an experts implementation: set "
    "config._experts_implementation = 'grouped_mm' or 'batched_mm' (LongCat-Flash's, with identity "
    "experts, have only this loop)"
)


def moe_pass(ctx: PassContext) -> None:
    if _one_hot_mask_leaves_graph(ctx):
        ctx.skipped("moe", f"graph {ctx.graph_index}", EXPERT_LOOP)
    gemms = {}
    for node in ctx.gm.graph.nodes:
        if (
            node.op == "call_function"
            and (node.target in EXPERT_MATMULS or _grouped(node))
            and (g := expert_gemm(ctx, node))
        ):
            gemms[node] = g
    # Each block is taken from its down projection: the expert GEMM that reads the activation.
    for down in [g for g in gemms.values() if _is_down_projection(g, gemms)]:
        rewrite_block(ctx, down, lambda down=down: _routed(ctx, down, gemms))


def rewrite_block(ctx: PassContext, down: ExpertGemm, rewrite, report: bool = True) -> str | None:
    """rewrite() the block whose down projection is `down`, or keep it bf16: then the reason,
    on the report unless report=False (the caller may still take the block another way)."""
    name = block_name(ctx, down.weight)
    shape = "x".join(map(str, meta_val(down.weight).shape))
    if ctx.site_failed(name):  # the report has the error already (passes/guard.py)
        return f"the {ctx.current_pass} pass raised an error at this block"

    def attempt() -> str | None:
        try:
            if ctx.config.recipe != "block":
                raise NoMatch(
                    f"routed experts have FP8 kernels in the block recipe only (recipe={ctx.config.recipe!r})"
                )
            why = dtypes.why_not({meta_val(down.weight).dtype}, "experts")
            if why is not None:
                raise NoMatch(why)
            rewrite()
            return None
        except NoMatch as error:
            return str(error)

    # any other exception: the graph is put back and the block stays bf16 (passes/guard.py)
    reason = ctx.at_site(name, attempt)
    if reason is not None and report:
        ctx.skipped("moe", name, reason, shape)
    return reason


def verified_orientation(m: MoeMatch, orientations: list[bool], verify_one) -> bool:
    """The weight orientation (w_kn) under which the match computes what it was read as, or
    NoMatch: verify_one(w_kn) is its calc_diff against the reference."""
    if not orientations:
        shapes = f"{tuple(meta_val(m.w13).shape)}, {tuple(meta_val(m.w2).shape)}"
        raise NoMatch(f"expert weight shapes {shapes} do not fit H={meta_val(m.hidden).shape[1]}")
    diffs = [verify_one(w_kn) for w_kn in orientations]
    diffs = [d if d == d else float("inf") for d in diffs]  # NaN: did not verify
    if min(diffs) >= VERIFY_BOUND:
        raise NoMatch(
            f"run on random tokens, the matched block does not compute routed experts with "
            f"{m.gate_up} gate/up (calc_diff {min(diffs):.2g} against moe_reference.moe_dense)"
        )
    return orientations[diffs.index(min(diffs))]


def _routed(ctx: PassContext, down: ExpertGemm, gemms) -> None:
    m = match_block(ctx, down, gemms)
    e, inter, h = check_block(m)
    w_kn = verified_orientation(m, weight_orientations(m, e, inter, h), lambda kn: verify(ctx, m, kn))
    moe_replacement(ctx, m, e, inter, h, w_kn, block_name(ctx, down.weight))
