"""gqa_attention pass: grouped-query attention over a KV cache, without the copy of the cache.

transformers runs sdpa with grouped-query attention (fewer K/V heads than query heads) through
repeat_kv whenever it passes a mask, which its static cache always does: every K/V head is
copied once per query head that reads it (in ATen, unsqueeze -> expand -> clone -> view), and
the attention then reads the copy. At decode that is the most expensive part of a step at
larger batches: on an H100, Llama-3-8B widths, 32 layers, prompt 1024, batch 16, the copy takes
3.9 ms and the attention 3.5 ms of an 18.6 ms bf16 step (14.2 ms in FP8), where reading the cache
once would take 0.7 ms at 3.35 TB/s (BENCHMARKS.md, "2026-11-24 (25f23a7)"). The same kernels run
in bf16 and FP8, so this caps what FP8 linears can give a whole model there.

For a few query tokens the copy is not needed: the rep query heads that share a K/V head become
rep x S query rows of that head. q (B, H, S, D) -> (B, KV, rep * S, D); the mask's rows follow
(a view at S = 1); the output comes back as (B, H, S, D) in the layout the attention gave
before. On the CPU the attention kernel sdpa chooses reads each K/V head once. On a GPU that
kernel (cuDNN's) splits the work over sequences and K/V heads only, each block walking the whole
cache: 27 us a layer for Llama-3-8B at batch 1, context 1152, on an H200. There fp8compile's split-KV kernel
(ops/attention/triton_attention.py, Fp8Config.split_kv) spreads the keys over the SMs instead: 7.5 us
(BENCHMARKS.md, "2026-11-26 (01816bf)").

Matched: an sdpa op of the ATen graph (cuDNN, efficient, CPU flash) whose key and value are
repeat_kv copies of the same group layout, no dropout, not is_causal, a static query length of
at most MAX_QUERY_ROWS (decode), and only its first output read. Pure re-indexing of the same
attention: numbers within bf16 rounding of the unrewritten graph (the same softmax, tiled
differently).
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..numerics import size_hint
from ..report import Rewrite, Skip
from .context import PassContext, qualified_name
from .trace import inline_traced

aten = torch.ops.aten
# The sdpa kernels AOTAutograd leaves in an inference graph, and the name of their mask argument.
SDPA_OPS = {
    op: mask
    for name, mask in (
        ("_scaled_dot_product_cudnn_attention", "attn_bias"),
        ("_scaled_dot_product_efficient_attention", "attn_bias"),
        ("_scaled_dot_product_flash_attention_for_cpu", "attn_mask"),
    )
    if (op := getattr(getattr(aten, name, None), "default", None)) is not None
}
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
# The longest query rewritten. Decode (S = 1, and a few tokens for speculative steps) is what was
# measured; the mask copy grows with S (B * rep * S * L elements, a view at S = 1) while the
# K/V copy it saves does not, and at prefill the attention's S x L work dwarfs that copy.
MAX_QUERY_ROWS = 64


@dataclass
class GqaMatch:
    sdpa: fx.Node
    out: fx.Node  # getitem(sdpa, 0), the only output read
    query: fx.Node
    key: fx.Node  # the K/V heads before repeat_kv, (B, KV, L, D)
    value: fx.Node
    mask: fx.Node | None
    scale: float | None
    rep: int


def _arguments(node: fx.Node) -> dict:
    """The op's arguments by schema name, defaults filled in."""
    bound = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            bound[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            bound[arg.name] = node.kwargs[arg.name]
        else:
            bound[arg.name] = arg.default_value if arg.has_default_value() else None
    return bound


def repeated_kv(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(the grouped (B, KV, L, D) tensor, rep) if node is repeat_kv's copy of it:
    view(clone(expand(unsqueeze(x, 2), [B, KV, rep, L, D])), [B, KV * rep, L, D])."""
    chain = []
    for targets in (_VIEWS, (aten.clone.default,), (aten.expand.default,), (aten.unsqueeze.default,)):
        if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets):
            return None
        chain.append(node)
        node = node.args[0]
    unsqueeze, grouped = chain[-1], node
    if unsqueeze.args[1] not in (2, -3) or not isinstance(grouped, fx.Node):
        return None
    expanded = chain[2].meta["val"]
    if expanded.dim() != 5 or not isinstance(expanded.shape[2], int) or expanded.shape[2] < 2:
        return None
    return grouped, expanded.shape[2]


def gqa_pattern(node: fx.Node) -> GqaMatch | str | None:
    """A match, a reason it is left as it is (a candidate: K/V are repeat_kv copies), or None."""
    if node.op != "call_function" or node.target not in SDPA_OPS:
        return None
    args = _arguments(node)
    key, value = repeated_kv(args["key"]), repeated_kv(args["value"])
    if key is None or value is None:
        return None
    if key[1] != value[1] or key[0].meta["val"].shape != value[0].meta["val"].shape:
        return "key and value repeated differently"
    if args.get("dropout_p") or args.get("is_causal"):
        return "dropout or is_causal (a mask is expected: its rows are regrouped)"
    rows = args["query"].meta["val"].shape[2]
    if not isinstance(rows, int) or rows > MAX_QUERY_ROWS:
        return (
            f"query length {rows} is not a constant <= {MAX_QUERY_ROWS} "
            "(prefill: the K/V copy is small next to it)"
        )
    outs = list(node.users)
    if len(outs) != 1 or outs[0].target is not operator.getitem or outs[0].args[1] != 0:
        return "an output other than the attention's is read"
    return GqaMatch(
        node, outs[0], args["query"], key[0], value[0], args[SDPA_OPS[node.target]], args.get("scale"), key[1]
    )


def grouped_sdpa(query, key, value, mask, scale, rep, heads_outer, split_keys=False, chunk=0):
    """sdpa(query, repeat_kv(key), repeat_kv(value), mask) reading each K/V head once: the rep
    query heads of a K/V head are its rows. Returns (B, H, S, D), laid out as (B, H, S, D) if
    heads_outer, else as (B, S, H, D) (the layouts sdpa kernels give). split_keys: through
    fp8compile::gqa_decode_attention (ops/attention/triton_attention.py, CUDA), the keys split over programs,
    chunk keys each (0: the op's choice for this batch)."""
    b, h, s, d = query.shape
    kv = key.shape[1]
    q = query.reshape(b, kv, rep * s, d)
    if split_keys:
        from ..ops.attention import op as attention_op  # noqa: F401  (registers fp8compile::gqa_decode_attention)

        scale = scale if scale is not None else d**-0.5
        out = torch.ops.fp8compile.gqa_decode_attention(q, key, value, mask, scale, rep, chunk)
        out = out.reshape(b, kv, rep, s, d)
        if heads_outer:
            return out.view(b, h, s, d)
        return out.permute(0, 3, 1, 2, 4).contiguous().view(b, s, h, d).transpose(1, 2)
    if mask is not None:  # broadcastable to (B, H, S, L); rows regrouped like the queries'
        if mask.dim() < 4:
            mask = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))
        n, heads, length = mask.shape[0], kv if mask.shape[1] != 1 else 1, mask.shape[-1]
        mask = mask.expand(n, mask.shape[1], s, length).reshape(n, heads, -1, s, length)
        mask = mask.expand(n, heads, rep, s, length).reshape(n, heads, rep * s, length)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scale)
    out = out.reshape(b, kv, rep, s, d)
    if heads_outer:
        return out.contiguous().view(b, h, s, d)
    return out.permute(0, 3, 1, 2, 4).contiguous().view(b, s, h, d).transpose(1, 2)


def gqa_attention_pass(ctx: PassContext) -> None:
    for node in list(ctx.gm.graph.nodes):
        match = gqa_pattern(node)
        if match is None:
            continue
        name = _module_name(node)
        if isinstance(match, str):
            skip = Skip("attention", name, match, ctx.graph_index, _shape(node), ctx.model_dtype)
            ctx.report.skips.append(skip)
            continue
        ctx.at_site(name, lambda node=node, match=match, name=name: gqa_replacement(ctx, node, match, name))


def gqa_replacement(ctx: PassContext, node: fx.Node, match: GqaMatch, name: str) -> None:
    """The attention at node (match) as grouped_sdpa over the un-repeated keys and values."""
    graph = ctx.gm.graph
    inputs = [match.query, match.key, match.value] + ([match.mask] if match.mask is not None else [])
    vals = [n.meta["val"] for n in inputs]
    why_not = _split_kv_why_not(vals, match) if ctx.config.split_kv else "Fp8Config(split_kv=False)"
    split = why_not is None
    chunk = _batch_invariant_chunk(vals[1]) if split and ctx.config.batch_invariant else 0

    def call(q, k, v, mask=None, *, match=match, heads_outer=True, split=split, chunk=chunk):
        return grouped_sdpa(q, k, v, mask, match.scale, match.rep, heads_outer, split, chunk)

    # The output as laid out before: the nodes reading it may be views that need that layout.
    layouts = [
        outer
        for outer in (True, False)
        if _same_element_layout(ctx.fake(call, *inputs, heads_outer=outer), match.out.meta["val"])
    ]
    if not layouts:
        ctx.report.skips.append(
            Skip(
                "attention",
                name,
                "its output is laid out neither as (B, H, S, D) nor as (B, S, H, D)",
                ctx.graph_index,
                _shape(node),
                ctx.model_dtype,
            )
        )
        return
    call = functools.partial(call, heads_outer=layouts[0])
    before = node.prev
    with graph.inserting_before(node):
        out = inline_traced(
            graph,
            call,
            inputs,
            ctx.traces,
            ("grouped_sdpa", match.scale, match.rep, layouts[0], split, chunk),
        )
    kernel = (
        "split-KV (fp8compile)"
        if split
        else next(
            (
                n.target.__name__.split(".")[0].removeprefix("_scaled_dot_product_")
                for n in _between(before, node)
                if n.target in SDPA_OPS
            ),
            "sdpa",
        )
    )
    ctx.replace_uses(match.out, out)
    graph.erase_node(match.out)
    graph.erase_node(node)
    b, h, s, _ = match.query.meta["val"].shape
    kv = match.key.meta["val"].shape[1]
    # The report's columns for an attention: M = query tokens, K -> N = query heads -> K/V heads.
    ctx.report.rewrites.append(
        Rewrite(
            "attention",
            name,
            str(s),
            kv,
            h,
            ((f"S = {s}", f"sdpa {kernel}"),),
            ctx.graph_index,
            detail=f"gqa {h}/{kv} heads"
            # on a GPU, why sdpa's kernel runs instead of the split-KV one
            + (f"; not split-KV: {why_not}" if not split and vals[0].device.type == "cuda" else ""),
        )
    )


def _split_kv_why_not(vals: list, match: GqaMatch) -> str | None:
    """Why fp8compile's split-KV kernel does not serve this attention (sdpa's kernel does), or None."""
    if vals[0].device.type != "cuda":  # Triton may be absent without a GPU: nothing imported
        return "not on a CUDA device"
    from ..ops.attention import triton_attention

    return triton_attention.supports(*vals[:3], vals[3] if match.mask is not None else None, match.rep)


def _batch_invariant_chunk(key: torch.Tensor) -> int:
    """The split-KV kernel's keys per chunk for any batch: the choice for one sequence (the
    default choice follows the batch, and a row's sum order with it)."""
    from ..ops.attention import triton_attention

    launch = triton_attention.launch_for(key.shape[3])
    return triton_attention.chunk_keys(size_hint(key.shape[2]), 1, key.shape[1], key.device, launch)


def _same_element_layout(new: torch.Tensor, old: torch.Tensor) -> bool:
    """Same shape, and the same strides wherever a dimension has more than one element: every
    view of one is a view of the other (a size-1 dimension's stride is arbitrary)."""
    if new.dim() != old.dim():
        return False
    for size, a, b, c in zip(new.shape, old.shape, new.stride(), old.stride()):
        if not statically_known_true(size == a):
            return False
        if not statically_known_true(size == 1) and not statically_known_true(b == c):
            return False
    return True


def _between(first: fx.Node, last: fx.Node):
    """The nodes after first and before last, in graph order."""
    node = first.next
    while node is not last:
        yield node
        node = node.next


def _module_name(node: fx.Node) -> str:
    """The attention module's name ("model.layers.0.self_attn"), from Dynamo's module stack."""
    stack = node.meta.get("nn_module_stack") or {}
    return qualified_name(list(stack.values())[-1][0]) if stack else node.name


def _shape(node: fx.Node) -> str:
    q = node.args[0].meta["val"]
    return "x".join(str(size) for size in q.shape)
