"""gate_up pass: gate(x) and up(x) of a gated MLP, two linears over one x -> one fp8compile::linear.

down(act(gate(x), up(x))) quantizes x twice and runs two GEMMs whose N is half the MLP's width.
With the two FP8 weights stacked along N (gate rows, then up rows; made once, at compile time,
in the weight memo) it is one GEMM: x quantized once, one launch, twice the N to spread over the
SMs. Its (M, 2I) output is sliced back into gate and up, which the silu_mul pass then reads as
the strided halves it already takes from a fused gate_up linear.

Merged: two bias-free bf16 linears over the same x whose outputs are the a and b of a silu or
swigluoai product (silu_mul_pattern), with parameter weights stored the same way, each of which
the linear pass would rewrite. Linears with biases stay two GEMMs (not handled yet: the stacked
op would need the two biases concatenated too). Runs before silu_mul, which then fuses the down
projection.
"""
from __future__ import annotations

import logging

import torch
import torch.fx as fx

from .context import PassContext
from .linear import MATMULS, LinearMatch, emit_fp8, linear_extra_check, linear_pattern, module_name
from .silu_mul import _CASTS, _VIEWS, _strip, silu_mul_pattern
from .weights import fp8_weight

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
    (else the merge would move a bf16 linear into FP8), over the same x, without biases, with
    distinct weights stored the same way."""
    params = [ctx.parameter(m.weight) for m in (gate, up)]
    if None in params or params[0][0] is params[1][0]:
        return "weights are not two distinct parameters"
    if any(linear_extra_check(ctx, m, module_name(p[1])) is not None for m, p in zip((gate, up), params)):
        return "a linear that stays bf16"
    if gate.bias is not None or up.bias is not None:
        return "linears with biases"
    if gate.transposed != up.transposed or _strip(gate.x, _VIEWS) is not _strip(up.x, _VIEWS):
        return "different inputs or weight layouts"
    if gate.x.meta["val"].shape != up.x.meta["val"].shape:
        return "different input shapes"
    return None


def gate_up_replacement(ctx: PassContext, gate: LinearMatch, up: LinearMatch) -> None:
    (w_gate, gate_name), (w_up, up_name) = ctx.parameter(gate.weight), ctx.parameter(up.weight)
    gate_name, up_name = module_name(gate_name), module_name(up_name)
    w_fp8, _ = fp8_weight(w_gate, gate.transposed, ctx.config.e8m0, w_next=w_up)  # into the memo, now
    n, k = w_fp8.shape
    order = {node: i for i, node in enumerate(ctx.gm.graph.nodes)}
    first = min(gate, up, key=lambda match: order[match.node])  # its x is defined before both
    emitted = emit_fp8(ctx, gate, gate_name, "linear", torch.ops.fp8compile.linear.default, (first.x,),
                       {"w_next": up.weight}, n, k, before=first.node, record_skip=False)
    if emitted is None:
        return  # no M dispatch here: the linear pass meets both linears and reports why
    out, sides = emitted
    half = n // 2
    with ctx.gm.graph.inserting_before(first.node):
        parts = [ctx.gm.graph.call_function(aten.slice.Tensor, (out, 1, lo, lo + half)) for lo in (0, half)]
    for match, part in zip((gate, up), parts):  # erased after the inserts: first.node is their anchor
        part.meta["val"] = ctx.fake(aten.slice.Tensor, *part.args)
        match.node.replace_all_uses_with(part)
        ctx.gm.graph.erase_node(match.node)
    kernels = [(s.label, s.kernel) for s in sides]
    m = gate.x.meta["val"].shape[0]
    for name, other in ((gate_name, up_name), (up_name, gate_name)):
        ctx.rewrote("linear", name, m, half, k, kernels, detail=f"one GEMM with {other.rsplit('.', 1)[-1]}")


def gate_up_pass(ctx: PassContext) -> None:
    for node in [n for n in ctx.gm.graph.nodes if n.op == "call_function" and n.target in MATMULS]:
        # gate and up precede their down projection, so the nodes a merge erases were seen already
        pair = gate_up_pattern(node)
        if pair is None:
            continue
        if (reason := gate_up_extra_check(ctx, *pair)) is None:
            gate_up_replacement(ctx, *pair)
        else:
            log.info("fp8compile: %s and %s stay two GEMMs: %s", *(m.weight.name for m in pair), reason)
