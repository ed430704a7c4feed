"""gate_up pass: gate(x) and up(x) of a gated MLP, two linears over one x -> one fp8compile::linear.

down(act(gate(x), up(x))) quantizes x twice and runs two GEMMs whose N is half the MLP's width.
With the two FP8 weights stacked along N (gate rows, then up rows; made once, at compile time,
in the weight memo) it is one GEMM: x quantized once, one launch, twice the N to spread over the
SMs (passes/merge.py). Its (M, 2I) output is sliced back into gate and up, which the silu_mul
pass then reads as the strided halves it already takes from a fused gate_up linear.

Merged: two bf16 linears over the same x whose outputs are the a and b of a silu, swigluoai,
silu_limit or gelu_tanh product (silu_mul_pattern), with parameter weights stored the same way, both with a
bias or neither (the biases are stacked like the weights), each of which the linear pass would
rewrite. Runs before silu_mul, which then fuses the down projection.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from .context import PassContext
from ..numerics import BLOCK
from .linear import MATMULS, LinearMatch, linear_extra_check, linear_pattern, module_name
from .merge import group_name, merge_linears
from .silu_mul import _CASTS, _VIEWS, _strip, silu_mul_pattern

aten = torch.ops.aten
log = logging.getLogger("fp8compile")


def _linear_under(node) -> LinearMatch | None:
    """The linear whose output node is, through views and casts."""
    mm = _strip(node, _VIEWS + _CASTS)
    match = linear_pattern(mm) if isinstance(mm, fx.Node) and mm.target in MATMULS else None
    return match if isinstance(match, LinearMatch) else None


def gate_up_pattern(down: fx.Node) -> tuple[LinearMatch, LinearMatch] | None:
    """(gate, up): two linears whose outputs meet in act(gate, up) feeding the matmul `down`.
    None for the two halves of one fused gate_up linear: that is one GEMM already."""
    match = linear_pattern(down)
    found = silu_mul_pattern(match.x) if isinstance(match, LinearMatch) else None
    if not isinstance(found, tuple):
        return None
    gate, up = _linear_under(found[0]), _linear_under(found[1])
    return (gate, up) if gate is not None and up is not None else None


def gate_up_extra_check(ctx: PassContext, gate: LinearMatch, up: LinearMatch) -> str | None:
    """Why the pair stays two GEMMs, or None. Each must be a linear the linear pass would rewrite
    (else the merge would move a bf16 linear into FP8), over the same x, both with a bias or
    neither, with distinct weights stored the same way, gate's in whole 128-row blocks."""
    params = [ctx.parameter(m.weight) for m in (gate, up)]
    if None in params or params[0][0] is params[1][0]:
        return "weights are not two distinct parameters"
    if any(linear_extra_check(ctx, m, module_name(p[1])) is not None for m, p in zip((gate, up), params)):
        return "a linear that stays bf16"
    if (gate.bias is None) != (up.bias is None):
        return "one linear has a bias and the other not"
    if gate.transposed != up.transposed or _strip(gate.x, _VIEWS) is not _strip(up.x, _VIEWS):
        return "different inputs or weight layouts"
    if gate.x.meta["val"].shape != up.x.meta["val"].shape:
        return "different input shapes"
    n = gate.weight.meta["val"].shape[1 if gate.transposed else 0]
    if n % BLOCK:  # stacked first, a partial last block of gate would span gate and up
        return f"intermediate size {n} is not a multiple of {BLOCK}: a block would hold gate and up rows"
    return None


def gate_up_replacement(ctx: PassContext, gate: LinearMatch, up: LinearMatch) -> None:
    merge_linears(ctx, [gate, up])


def gate_up_pass(ctx: PassContext) -> None:
    for node in [n for n in ctx.gm.graph.nodes if n.op == "call_function" and n.target in MATMULS]:
        # gate and up precede their down projection, so the nodes a merge erases were seen already
        pair = gate_up_pattern(node)
        if pair is not None:
            ctx.at_site(group_name(ctx, list(pair)), lambda pair=pair: _gate_up_site(ctx, *pair))


def _gate_up_site(ctx: PassContext, gate: LinearMatch, up: LinearMatch) -> None:
    if (reason := gate_up_extra_check(ctx, gate, up)) is None:
        gate_up_replacement(ctx, gate, up)
    else:
        log.info("fp8compile: %s and %s stay two GEMMs: %s", gate.weight.name, up.weight.name, reason)
