"""qkv pass: linears that read one x (an attention's q, k and v projections, or any such group)
-> one fp8compile::linear over their weights stacked along N (passes/merge.py).

A transformers attention runs q_proj, k_proj and v_proj over the same hidden states: three
GEMMs, x quantized three times, and with grouped-query attention k and v are narrow (N = 1024
on a Llama-3-8B) and leave most SMs idle at decode. Merged they are one GEMM (N = 6144 there),
and outside a CUDA graph one op's host cost instead of three.

Merged: two or more bf16 linears over the same x (through views), parameter weights stored the
same way, all with a bias or none, each of which the linear pass would rewrite (so whole 128-row
weight blocks: no block spans two linears). Runs after gate_up, which takes an MLP's gate and up
first, and before silu_mul.
"""

from __future__ import annotations

from ..numerics import BLOCK
from .context import PassContext
from .linear import MATMULS, LinearMatch, linear_extra_check, linear_pattern, module_name
from .merge import group_name, merge_linears
from .silu_mul import _VIEWS, _strip


def qkv_pattern(ctx: PassContext) -> list[list[LinearMatch]]:
    """Groups of two or more rewritable linears over one x, in graph order."""
    groups: dict[tuple, list[LinearMatch]] = {}
    for node in [n for n in ctx.gm.graph.nodes if n.op == "call_function" and n.target in MATMULS]:
        match = linear_pattern(node)
        if not isinstance(match, LinearMatch) or (param := ctx.parameter(match.weight)) is None:
            continue
        if linear_extra_check(ctx, match, module_name(param[1])) is not None:
            continue  # stays bf16 (the linear pass says why) or is claimed by a fusion
        x = _strip(match.x, _VIEWS)
        key = (x, match.transposed, match.bias is None, str(match.x.meta["val"].shape))
        groups.setdefault(key, []).append(match)
    return [g for g in groups.values() if len(g) > 1]


def qkv_extra_check(ctx: PassContext, group: list[LinearMatch]) -> list[LinearMatch]:
    """The part of a group that can share one GEMM: one linear per parameter (a weight used twice
    over the same x is one GEMM already), those of whole 128-row weight blocks, and at most one
    with a partial last block, stacked last (no weight block may span two linears)."""
    seen, whole, partial = set(), [], []
    for match in group:
        param = ctx.parameter(match.weight)[0]
        if id(param) not in seen:
            seen.add(id(param))
            n = match.weight.meta["val"].shape[1 if match.transposed else 0]
            (partial if n % BLOCK else whole).append(match)
    distinct = whole + partial[:1]
    return distinct if len(distinct) > 1 else []


def qkv_pass(ctx: PassContext) -> None:
    for group in qkv_pattern(ctx):
        ctx.at_site(group_name(ctx, group), lambda group=group: _qkv_site(ctx, group))


def _qkv_site(ctx: PassContext, group: list[LinearMatch]) -> None:
    group = qkv_extra_check(ctx, group)
    if group:
        merge_linears(ctx, group)
