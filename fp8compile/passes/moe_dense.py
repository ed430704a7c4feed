"""Dense experts -> fp8compile::moe over the routed slots (the moe fusion's second pass).

Llama 4's Llama4TextExperts runs every token through every expert's whole weight: two bmm's over
(E, T, .) batches of the tokens repeated E times, each copy scaled by the router's score for that
expert (sigmoid of the top-k logits, exactly 0 off the top-k):

    out_t = sum_e down_e(act(gate_e(s_te x_t)) * up_e(s_te x_t)).

An expert whose score is 0 adds down_e(act(0) * 0) = 0 (the experts have no biases), so only
each token's k top experts count, and each of those slots is one expert applied to its own input
s x. That is the routed moe op at top-1 over T*k rows: row (t, j) is x_t times the j-th top
score (in the model's dtype, rounded where the model rounds it), routed to that expert with
weight 1; the k rows of a token are summed after. The FP8 GEMMs then do the slots' work, not the
E/k times more of the dense bmm's. The scores the top-k reads are the ones the model multiplies,
and k is the router's own (the top-k upstream of the scores).

Like every moe match, the block is run on random tokens and scores with the real weights before
it is rewritten, against moe_reference.moe_dense over the slots; and the router, from random logits
to scores, must give zero off its top-k (a router whose scores only pass through a top-k, every
expert still counting, keeps the block bf16 with that reason).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..numerics import calc_diff
from ..ops.moe import reference as moe_reference
from ..weights import canonical_experts
from . import dtypes
from .context import PassContext
from .moe import (
    LAYOUT,
    VERIFY_TOKENS,
    ExpertGemm,
    MoeMatch,
    NoMatch,
    block_name,
    check_block,
    gate_up_of,
    gated_product,
    is_2d,
    weight_orientations,
    stacked_param,
    meta_val,
    walk,
    moe_replacement,
    rewrite_block,
    verified_orientation,
)
from .replay import ReplayError, concrete, run_subgraph, small_symbols

aten, prims = torch.ops.aten, torch.ops.prims

# Between the scores and the multiply that scales the repeated tokens: the layout ops, not the
# conversions (the scores are taken in the dtype the model multiplies).
_RELAYOUT = tuple(
    op for op in LAYOUT if op not in (prims.convert_element_type.default, aten._to_copy.default)
)


NOT_A_BLOCK = (
    "dense experts: a bmm over a whole (E, K, N) parameter, every token through every expert, in a form "
    "other than Llama 4's (tokens repeated once per expert and scaled by the router's top-k scores, "
    "act(gate) * up, the sum over the experts): no FP8 op takes it, so it stays bf16"
)
# A dense bmm that is not Llama 4's form becomes one matmul per expert, each an FP8 linear of
# that expert's weight (the linear pass's selected_linear), up to this many experts: each is a
# launch and an M dispatch of its own, so the host's cost grows with the experts (a bound chosen
# for shared experts, 1-2 in the models seen, not measured against a GPU).
SPLIT_EXPERTS = 16


def moe_dense_pass(ctx: PassContext) -> None:
    """Each dense block, from its down projection, over its slots; any other bmm over a whole
    expert parameter (shared experts stacked in one parameter, a block not read as Llama 4's)
    split into one matmul per expert for the linear pass, or kept bf16 with the reason, once per
    experts module."""
    gemms = {node: g for node in ctx.gm.graph.nodes if (g := dense_expert_gemm(ctx, node))}
    done, reasons = set(), {}
    for down in [g for g in gemms.values() if gated_product(g) is not None]:
        reason = rewrite_block(ctx, down, lambda down=down: done.update(_rewrite(ctx, down, gemms)), False)
        if reason is not None:
            reasons[block_name(ctx, down.weight)] = reason
    kept = {}
    for g in gemms.values():
        if g.node not in done and not split_into_matmuls(ctx, g):
            kept.setdefault(block_name(ctx, g.weight), g.weight)
    for name, w in kept.items():
        ctx.skipped("moe", name, reasons.get(name, NOT_A_BLOCK), "x".join(map(str, meta_val(w).shape)))


def split_into_matmuls(ctx: PassContext, g: ExpertGemm) -> bool:
    """g's bmm(x (E, T, K), w) over a whole stacked parameter W as E matmuls, stacked: mm(x[e],
    W[e]) for W stored (E, K, N), mm(x[e], W[e].t()) for W stored (E, N, K) and read transposed.
    Each is then one expert's linear to the linear pass. False (nothing changed) for any other
    form, or more than SPLIT_EXPERTS experts."""
    x, w = g.node.args[:2]
    experts = meta_val(g.weight).shape[0]
    if x is not g.activation or experts > SPLIT_EXPERTS or meta_val(x).dim() != 3:
        return False
    if w is g.weight:
        transposed = False
    elif w.op == "call_function" and w.args[0] is g.weight and _swaps_last_two(w):
        transposed = True
    else:
        return False
    graph = ctx.gm.graph
    with graph.inserting_before(g.node):
        rows = []
        for e in range(experts):
            weight = _call(ctx, aten.select.int, g.weight, 0, e)
            if transposed:
                weight = _call(ctx, aten.permute.default, weight, [1, 0])
            out = _call(ctx, aten.mm.default, _call(ctx, aten.select.int, x, 0, e), weight)
            rows.append(_call(ctx, aten.unsqueeze.default, out, 0))
        stacked = _call(ctx, aten.cat.default, rows)  # (aten.stack is decomposed before here)
    ctx.replace_uses(g.node, stacked)
    return True


def _swaps_last_two(node: fx.Node) -> bool:
    if node.target == aten.permute.default:
        return list(node.args[1]) == [0, 2, 1]
    if node.target == aten.transpose.int:
        return {d % 3 for d in node.args[1:3]} == {1, 2}
    return False


def _call(ctx: PassContext, target, *args) -> fx.Node:
    node = ctx.gm.graph.call_function(target, args)
    node.meta["val"] = ctx.fake(target, *args)
    return node


def dense_expert_gemm(ctx: PassContext, node: fx.Node) -> ExpertGemm | None:
    """node as a bmm over a whole 3-D parameter (through layout ops), not gathered per token."""
    if node.op != "call_function" or node.target != aten.bmm.default:
        return None
    for w, x in (node.args[:2], reversed(node.args[:2])):
        whole = walk(w, LAYOUT, lambda n: stacked_param(ctx, n, 3) is not None)
        if whole is not None:
            return ExpertGemm(node, whole, x)
    return None


def _rewrite(ctx: PassContext, down: ExpertGemm, gemms) -> set[fx.Node]:
    """The block over its slots; the dense GEMMs it replaced."""
    m, slots = match_dense(ctx, down, gemms)
    e, inter, h = check_block(m)
    w_kn = verified_orientation(m, weight_orientations(m, e, inter, h), lambda kn: verify(ctx, m, slots, kn))
    m = emit_slots(ctx, m, slots)
    moe_replacement(ctx, m, e, inter, h, w_kn, block_name(ctx, down.weight), dense_k=slots.top_k)
    return {g.node for g in gemms.values() if g.weight in (m.w13, m.w3, m.w2)}


@dataclasses.dataclass
class DenseSlots:
    """What the slot rewrite reads besides a MoeMatch: the tokens (T, H), the router's scores
    (T, E) and the router's k."""

    tokens: fx.Node
    scores: fx.Node
    top_k: int
    router_topk: fx.Node  # the aten.topk the scores come from


def match_dense(
    ctx: PassContext, down: ExpertGemm, gemms: dict[fx.Node, ExpertGemm]
) -> tuple[MoeMatch, DenseSlots]:
    """The dense block whose down projection is `down` (gemms: the dense expert GEMMs), as a
    MoeMatch over the tokens (hidden, and the scores for both routing operands until
    emit_slots makes the slots) and its DenseSlots; NoMatch saying why not."""
    found = gated_product(down)
    if isinstance(found, str):
        raise NoMatch(found)
    if found is None:
        raise NoMatch("dense experts whose down projection does not read a gated product act(gate) * up")
    a, b, act = found
    gate_up, up, b13, layout = gate_up_of(ctx, a, b, gemms)
    if b13 is not None:
        raise NoMatch("dense experts with biases: an expert off the top-k would add its bias")
    experts = meta_val(down.weight).shape[0]
    output = _output(down.node, experts)
    slots = _slots(gate_up.activation, experts)
    m = MoeMatch(
        slots.tokens,
        slots.scores,
        slots.scores,
        output,
        gate_up.weight,
        None if up is None else up.weight,
        down.weight,
        None,
        None,
        layout,
        act,
    )
    return m, slots


def _source(node, through) -> fx.Node:
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in through:
        node = node.args[0]
    return node


def _output(down: fx.Node, experts: int) -> fx.Node:
    """The (T, H) sum over the experts' dimension of the down projection's (E, T, H) output."""
    node = down
    for _ in range(8):
        if len(node.users) != 1:
            raise NoMatch(f"an intermediate of the experts ({node.name}) is used outside the block")
        user = next(iter(node.users))
        val = meta_val(node)
        if (
            user.target == aten.sum.dim_IntList
            and list(user.args[1]) in ([0], [-3])
            and val.dim() == 3
            and val.shape[0] == experts
        ):
            return user
        if user.target not in LAYOUT:
            op = getattr(user.target, "__name__", user.target)
            raise NoMatch(f"dense expert outputs go through {op} before the sum over the experts")
        node = user
    raise NoMatch("no sum over the experts' dimension after the dense down projection")


def _slots(gate_up_input: fx.Node, experts: int) -> DenseSlots:
    """The tokens, scores and k behind the gate/up bmm's input x.repeat(E, 1) * scores^T."""
    product = walk(gate_up_input, LAYOUT, lambda n: n.target == aten.mul.Tensor)
    tokens = scores = None
    for a in product.args[:2] if product is not None else ():
        src = _source(a, _RELAYOUT)
        if not isinstance(src, fx.Node):
            continue
        if src.target == aten.repeat.default and list(src.args[1]) == [experts, 1]:
            tokens = src.args[0]
        elif is_2d(src) and meta_val(src).shape[1] == experts:
            scores = src
    if tokens is None or scores is None or not is_2d(tokens):
        raise NoMatch(
            "the dense experts' input is not the tokens repeated once per expert times the router's "
            "(T, E) scores"
        )
    names = [dtypes.name(meta_val(n).dtype) for n in (scores, tokens)]
    if names[0] != names[1]:
        raise NoMatch(
            f"router scores of dtype {names[0]} scale tokens of dtype {names[1]}: the slot rows are "
            "taken in the tokens' dtype"
        )
    frontier, seen = [scores], set()
    for _ in range(8):  # the router's top-k: topk -> scatter into -inf -> sigmoid -> scores
        frontier = [i for n in frontier for i in n.all_input_nodes if i not in seen]
        seen.update(frontier)
        for n in frontier:
            if n.target == aten.topk.default and meta_val(n.args[0]).shape[-1] == experts:
                return DenseSlots(tokens, scores, int(n.args[1]), n)
    raise NoMatch("the router's top-k (experts per token) is not found upstream of the dense experts' scores")


def slot_rows(
    x: torch.Tensor, scores: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows (T*k, H), expert ids (T*k, 1), weights of 1 (T*k, 1)): each token's k top slots,
    row (t, j) x_t times its j-th top score, in the scores' dtype product as the model's."""
    values, ids = torch.topk(scores, k, dim=1)
    rows = (x.unsqueeze(1) * values.unsqueeze(2)).reshape(-1, x.shape[1])
    ids = ids.reshape(-1, 1)
    return rows, ids, torch.ones_like(ids, dtype=scores.dtype)


def verify(ctx: PassContext, m: MoeMatch, slots: DenseSlots, w_kn: bool) -> float:
    """calc_diff between the matched dense block, run on random tokens and top-k scores with the
    real weights, and moe_reference.moe_dense over their slots read with this interpretation."""
    symbols = small_symbols(ctx, VERIFY_TOKENS)
    param = {n: ctx.parameter(n)[0] for n in (m.w13, m.w3, m.w2) if n is not None}
    device = param[m.w13].device
    gen = torch.Generator(device).manual_seed(0)
    x_val, s_val = meta_val(slots.tokens), meta_val(slots.scores)
    t, e, k = concrete(x_val.shape[0], symbols), s_val.shape[1], slots.top_k
    with unset_fake_temporarily(), torch.no_grad():
        x = torch.randn(t, x_val.shape[1], generator=gen, device=device).to(x_val.dtype)
        chosen = torch.rand(t, e, generator=gen, device=device).argsort(dim=1)[:, :k]
        top = torch.rand(t, k, generator=gen, device=device) + 0.1
        scores = torch.zeros(t, e, device=device).scatter(1, chosen, top).to(s_val.dtype)
        try:
            # The scores the router makes from any logits are 0 off its top-k: else every expert counts.
            logits = torch.randn(t, e, generator=gen, device=device).to(
                meta_val(slots.router_topk.args[0]).dtype
            )
            made = run_subgraph(ctx, {slots.router_topk.args[0]: logits}, slots.scores, symbols, "the router")
            if ((made != 0).sum(1) > k).any():
                raise NoMatch(
                    f"the router's scores are not zero off its top-{k}: every expert of the dense bmm counts"
                )
            got = run_subgraph(ctx, {slots.tokens: x, slots.scores: scores}, m.output, symbols, "the experts")
        except ReplayError as err:
            raise NoMatch(str(err)) from None
        rows, ids, ones = slot_rows(x, scores, k)
        w13 = canonical_experts(param[m.w13], w_kn, m.gate_up, param.get(m.w3))
        w2 = canonical_experts(param[m.w2], w_kn)
        want = moe_reference.moe_dense(rows, ids, ones, w13, w2, **m.act)
        return calc_diff(got, want.view(t, k, -1).sum(1))


def emit_slots(ctx: PassContext, m: MoeMatch, slots: DenseSlots) -> MoeMatch:
    """slot_rows in the graph, before the block's output: m over the slots (hidden: the rows,
    top-1 ids and weights of 1)."""
    graph = ctx.gm.graph

    def call(target, *args, **kwargs):
        node = graph.call_function(target, args, kwargs)
        node.meta["val"] = ctx.fake(target, *args, **kwargs)
        return node

    with graph.inserting_before(m.output):
        topk = call(aten.topk.default, slots.scores, slots.top_k, 1)
        values, ids = (call(operator.getitem, topk, i) for i in (0, 1))
        rows = call(
            aten.mul.Tensor,
            call(aten.unsqueeze.default, slots.tokens, 1),
            call(aten.unsqueeze.default, values, 2),
        )
        rows = call(aten.view.default, rows, [-1, meta_val(slots.tokens).shape[1]])
        ids = call(aten.view.default, ids, [-1, 1])
        rows_n = meta_val(ids).shape[0]
        if isinstance(rows_n, torch.SymInt):
            rows_n = call(aten.sym_size.int, ids, 0)
        weights = call(
            aten.full.default,
            [rows_n, 1],
            1.0,
            dtype=meta_val(slots.scores).dtype,
            device=meta_val(ids).device,
        )
    return dataclasses.replace(m, hidden=rows, topk_ids=ids, topk_weights=weights)
