"""mqa_logits pass: a sparse-attention indexer's score, computed in FP8 by fp8compile::mqa_logits.

DeepSeek-V3.2's indexer (transformers' DeepseekV32Indexer, and the same math written by hand)
scores every key t for every query token:

    score[..., t] = c * sum_h w[..., h] * relu(q[..., h, :] . k[b, t, :])

q (*L, H, D) the query heads of each token (L = (B, S) or (M,)), k (B, T, D) or (T, D) one key head,
w (*L, H) per-head weights, c > 0 the constants on the way (softmax scale, H^-0.5); in the graph:
the q.k^T GEMM (bmm over broadcast views, fp32 or bf16), scalar multiplies, relu, then the
weighted sum over heads (a bmm with w, or a multiply and a sum). The rewrite quantizes q per
(token, head) and k per token (reference_mqa.quant_rows), folds q's scales and c into the weights
(each positive, so they pass through the relu), and scores with fp8compile::mqa_logits; what
follows the score (the mask, topk) stays as it was. Keys of sequence b are scored only by that
sequence's tokens: the op's windows [b * T, (b + 1) * T) in its compressed layout.

A match is read from the graph's structure, then checked by running the matched nodes on random
q, k and w at small sizes (passes/replay.py) against the formula above: the fit gives c and must
hold to FIT_BOUND, or the candidate stays as it was, with the reason in the report.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .. import registry
from ..numerics import calc_diff, size_hint
from ..ops.mqa_logits.reference import quant_rows
from .context import PassContext, qualified_name
from .replay import ReplayError, concrete, run_subgraph, small_symbols
from .trace import inline_traced

aten = torch.ops.aten
prims = torch.ops.prims

# Ops that move, broadcast or cast values without mixing them (and multiplies by a constant):
# what lies between the score's pieces in the ATen graph of `q.float() @ k.transpose(-1, -2)`,
# an einsum, or a hand-written broadcast.
_PASS_THROUGH = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.expand.default,
    aten.clone.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.permute.default,
    aten.transpose.int,
    aten.t.default,
    aten.alias.default,
    aten._to_copy.default,
    prims.convert_element_type.default,
}
_SCALAR_OPS = {aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar}
_GEMMS = {aten.bmm.default, aten.mm.default}
# Shape of the replayed check: dynamic sizes at most this.
VERIFY_SIZE = 8
# calc_diff between the matched nodes' output and c * the formula: rounding of a bf16 or fp32
# composition is far below it (bf16 products summed: about 1e-5), a different computation far above.
FIT_BOUND = 1e-4


class NoMatch(Exception):
    """A candidate indexer score that stays as it was; the message is the report's reason."""


@dataclasses.dataclass
class MqaMatch:
    q: fx.Node  # (*L, H, D)
    k: fx.Node  # (B, T, D) or (T, D)
    w: fx.Node  # (*L, H)
    output: fx.Node  # (*L, T)
    # The constants multiplied in on the way, (multiply?, value): a number, or a 0-d tensor node
    # (a module's float that Dynamo passes in as a graph input): read live, not frozen here.
    scalars: list[tuple[bool, object]]


def _is_scalar(arg) -> bool:
    """A Python number, or a 0-d tensor (a constant the graph made one)."""
    if not isinstance(arg, fx.Node):
        return isinstance(arg, (int, float))
    val = _val(arg)
    return isinstance(val, torch.Tensor) and val.dim() == 0


def _data(node: fx.Node) -> fx.Node | None:
    """The tensor whose values node passes on (moved, broadcast, cast or scaled by a constant),
    or None if node does more than that."""
    if node.op != "call_function":
        return None
    if node.target in _PASS_THROUGH:
        return node.args[0]
    if node.target in _SCALAR_OPS and len(node.args) == 2:
        x, y = node.args
        if _is_scalar(y) and isinstance(x, fx.Node):
            return x
        if node.target is aten.mul.Tensor and _is_scalar(x) and isinstance(y, fx.Node):
            return y
    return None


def _scalar_of(node: fx.Node) -> tuple[bool, object]:
    """(multiply?, the constant) of a node that scales its data by a constant."""
    x, y = node.args
    return node.target in (aten.mul.Tensor, aten.mul.Scalar), (x if y is _data(node) else y)


def _scalars(nodes) -> list[tuple[bool, object]]:
    return [_scalar_of(n) for n in nodes if n.op == "call_function" and n.target in _SCALAR_OPS]


def _chain(node: fx.Node) -> list[fx.Node]:
    """node and the nodes it passes values on from, source first."""
    chain = [node]
    while isinstance(_data(chain[-1]), fx.Node):
        chain.append(_data(chain[-1]))
    return chain[::-1]


def _source(node: fx.Node) -> fx.Node:
    """The first node before `node` (itself included) that does more than pass values through."""
    return _chain(node)[0]


def _single_user_chain(node: fx.Node) -> fx.Node:
    """Follow node's only user while it passes node's values on; the last such node."""
    while len(node.users) == 1:
        user = next(iter(node.users))
        if _data(user) is not node:
            break
        node = user
    return node


def _val(node: fx.Node):
    return node.meta.get("val")


def _eq(a, b) -> bool:
    return statically_known_true(a == b)


def match(relu: fx.Node) -> MqaMatch | str | None:
    """The indexer score around this relu, a reason it is left as it is, or None (no candidate)."""
    gemm = _source(relu.args[0])
    if gemm.op != "call_function" or gemm.target not in _GEMMS:
        return None
    after = _single_user_chain(relu)
    reduce_ = next(iter(after.users)) if len(after.users) == 1 else None
    if reduce_ is None or reduce_.op != "call_function":
        return None
    if reduce_.target is aten.bmm.default:
        other, out = reduce_.args[0] if reduce_.args[1] is after else reduce_.args[1], reduce_
    elif reduce_.target is aten.mul.Tensor and isinstance(reduce_.args[1], fx.Node):
        other = reduce_.args[1] if reduce_.args[0] is after else reduce_.args[0]
        summed = next(iter(reduce_.users)) if len(reduce_.users) == 1 else None
        if summed is None or summed.target not in (aten.sum.dim_IntList, aten.sum.default):
            return None
        out = summed
    else:
        return None
    output = _single_user_chain(out)
    # Each piece is the node nearest its source, on its chain of views and casts, whose shape
    # fits the formula's (transformers' k is (B, S, 1, D) at its source, (B, S, D) a squeeze on).
    chains = [_chain(x) for x in gemm.args[:2]]
    reason = "no candidate"
    for qs, ks in (chains, chains[::-1]):
        ws = _chain(other)
        for (i, q), (j, k), (v, w) in itertools.product(enumerate(qs), enumerate(ks), enumerate(ws)):
            reason = _shapes(q, k, w, output)
            if reason is None:
                on_the_way = [*qs[i + 1 :], *ks[j + 1 :], *ws[v + 1 :], *_chain(relu.args[0])[1:]]
                on_the_way += _path(relu, after) + _path(out, output)
                return MqaMatch(q, k, w, output, _scalars(on_the_way))
    return f"the score's pieces are not laid out as q (*L, H, D), k (B, T, D), w (*L, H): {reason}"


def _path(first: fx.Node, last: fx.Node) -> list[fx.Node]:
    """The nodes after first up to last along single-user links."""
    nodes = []
    while first is not last:
        first = next(iter(first.users))
        nodes.append(first)
    return nodes


def _shapes(q: fx.Node, k: fx.Node, w: fx.Node, output: fx.Node) -> str | None:
    vals = [_val(n) for n in (q, k, w, output)]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return "a piece has no tensor value"
    qv, kv, wv, ov = vals
    if qv.dim() not in (3, 4) or kv.dim() not in (2, 3):
        return f"q has {qv.dim()} dims, k {kv.dim()}"
    lead = qv.shape[:-2]
    if not _eq(qv.shape[-1], kv.shape[-1]):
        return "q and k differ in head size"
    if wv.dim() != qv.dim() - 1 or not all(_eq(x, y) for x, y in zip(wv.shape, qv.shape[:-1])):
        return "w is not (*L, H)"
    if ov.dim() != len(lead) + 1 or not all(_eq(x, y) for x, y in zip(ov.shape, (*lead, kv.shape[-2]))):
        return "the output is not (*L, T)"
    if kv.dim() == 3 and (len(lead) != 2 or not _eq(kv.shape[0], lead[0])):
        return "k (B, T, D) with q not (B, S, H, D)"
    if not (qv.dtype.is_floating_point and kv.dtype.is_floating_point and wv.dtype.is_floating_point):
        return "a piece is not floating point"
    return None


def verify(ctx: PassContext, m: MqaMatch) -> None:
    """Replay the matched nodes on random q, k, w (small sizes) against c * the formula, c the
    product of the constants on the way; NoMatch if they compute something else."""
    symbols = small_symbols(ctx, VERIFY_SIZE)
    vals = {n: _val(n) for n in (m.q, m.k, m.w)}
    device = vals[m.q].device
    gen = torch.Generator(device).manual_seed(0)
    with unset_fake_temporarily(), torch.no_grad():
        env = {
            n: torch.randn([concrete(s, symbols) for s in v.shape], generator=gen, device=device).to(v.dtype)
            for n, v in vals.items()
        }
        env[m.w] = env[m.w].abs()  # weights of either sign work; positive ones keep the fit well-posed
        try:
            got = run_subgraph(ctx, env, m.output, symbols, "the indexer score").double()
        except ReplayError as e:
            raise NoMatch(str(e)) from None
        except torch.OutOfMemoryError:
            # A graph of static sizes is replayed at them: a long prefill's fp32 scores do not fit.
            raise NoMatch(
                "could not check the match: replayed at this graph's static sizes, its intermediates "
                "do not fit in memory; compiled with dynamic=True (or the sequence dimension marked "
                f"dynamic) it is checked at {VERIFY_SIZE} tokens"
            ) from None
        except Exception as e:  # a replay the sizes chosen here do not suit
            raise NoMatch(f"could not check the match ({type(e).__name__}: {str(e)[:120]})") from None
        c = 1.0
        for multiply, value in m.scalars:
            if isinstance(value, fx.Node):
                value = run_subgraph(ctx, {}, value, symbols, "the indexer score's constant")
            c = c * float(value) if multiply else c / float(value)
        q, k, w = (env[n].double() for n in (m.q, m.k, m.w))
        if k.dim() == 2:
            scores = torch.einsum("...hd,td->...ht", q, k)
        else:
            scores = torch.einsum("bshd,btd->bsht", q, k)
        want = (scores.relu() * w.unsqueeze(-1)).sum(-2)
        if got.shape != want.shape:
            raise NoMatch(f"replayed, the score is {tuple(got.shape)}, the formula gives {tuple(want.shape)}")
        fit = calc_diff(got, c * want)
        if not c > 0 or not fit < FIT_BOUND:
            raise NoMatch(
                f"computes something other than c * sum_h w * relu(q . k) with c > 0 "
                f"(calc_diff {fit:.2e} at c = {c:.3g})"
            )


def indexer_logits(q, k, w, *tensor_scalars, scalars, e8m0: bool, backend: str, out_dtype: torch.dtype):
    """c * sum_h w * relu(q . k) in FP8 (module docstring): q (*L, H, D), k (B, T, D) or (T, D);
    c from `scalars` ((multiply?, number or None)), None taking the next of tensor_scalars."""
    *lead, h, d = q.shape
    t = k.shape[-2]
    q_fp8, q_scale = quant_rows(q.reshape(-1, h, d), e8m0)
    k_fp8, k_scale = quant_rows(k.reshape(-1, d), e8m0)
    weights = w.reshape(-1, h).float() * q_scale
    live = iter(tensor_scalars)
    for multiply, value in scalars:
        value = next(live) if value is None else value
        weights = weights * value if multiply else weights / value
    rows = torch.arange(q_fp8.shape[0], device=q.device)
    # Sequence b's tokens score keys [b * T, (b + 1) * T): compressed columns. Shared keys: all.
    ks = (rows // lead[1] * t if k.dim() == 3 else rows * 0).to(torch.int32)
    logits = torch.ops.fp8compile.mqa_logits(
        q_fp8, k_fp8, k_scale, weights, ks, ks + t, True, t if k.dim() == 3 else 0, backend
    )
    return logits.view(*lead, t).to(out_dtype)


def _name(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return qualified_name(list(stack.values())[-1][0]) if stack else node.name


def mqa_logits_pass(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    for relu in list(graph.find_nodes(op="call_function", target=aten.relu.default)):
        if relu.graph is not graph or not relu.users:  # consumed by an earlier rewrite
            continue
        found = match(relu)
        if found is None:
            continue
        name = _name(relu)
        if isinstance(found, str):
            ctx.skipped("mqa_logits", name, found)
            continue
        ctx.at_site(name, lambda relu=relu, found=found, name=name: _mqa_logits_site(ctx, relu, found, name))


def _mqa_logits_site(ctx: PassContext, relu: fx.Node, found, name: str) -> None:
    """The indexer logits found (the match ending in relu) as fp8compile's op, or kept with the reason."""
    graph = ctx.gm.graph
    qv, kv = _val(found.q), _val(found.k)
    # The kernels specialize on H and D when they run; the choice here is for these sizes.
    h, d = (size_hint(size) for size in qv.shape[-2:])
    shape = "x".join(map(str, qv.shape))
    try:
        verify(ctx, found)
        request = registry.Request("mqa_logits", qv.device, n=h, k=d)
        backend = registry.choose(request, ctx.config.backends, tier="large")
    except (NoMatch, RuntimeError) as e:
        ctx.skipped("mqa_logits", name, str(e), shape)
        return
    scalars = tuple((mul, None if isinstance(v, fx.Node) else v) for mul, v in found.scalars)
    live = [v for _, v in found.scalars if isinstance(v, fx.Node)]
    call = dict(scalars=scalars, e8m0=ctx.config.e8m0, backend=backend, out_dtype=_val(found.output).dtype)
    with graph.inserting_before(found.output):
        new = inline_traced(
            graph,
            lambda q, k, w, *live: indexer_logits(q, k, w, *live, **call),
            [found.q, found.k, found.w, *live],
            ctx.traces,
            ("indexer_logits", *sorted(call.items())),
        )
    ctx.replace_uses(found.output, new)
    tokens = qv.shape[-3] if qv.dim() == 4 else qv.shape[0]
    ctx.rewrote(
        "mqa_logits",
        name,
        tokens,
        h,
        d,
        (("all M", backend),),
        detail=f"H={h}, D={d}, {'batched' if kv.dim() == 3 else 'shared'} keys",
    )
