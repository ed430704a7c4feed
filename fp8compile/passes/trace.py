"""A function traced as AOTAutograd traces for Inductor, copied into a graph after AOTAutograd.

Our passes run on the ATen graph AOTAutograd made, so a call whose body Inductor should see
(a torch.library.triton_op's kernel launches, sdpa over regrouped heads) is traced here the same
way (functionalized, Inductor's decompositions, the graph's fake mode and symbolic sizes) and
its nodes copied in (passes/inline.py, passes/gqa_attention.py).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp


class TraceCache:
    """Traces of inline_traced's functions, one per (key, input signature), for one compiled graph.

    Tracing a triton_op's body as AOTAutograd does costs functionalization over symbolic sizes
    plus the launcher's Python, per call site: in the 2026-11-24 (1022e31) cProfile of a 4-layer
    default-mode compile, 4.8 s in the bodies and 10 s in functionalization, where the whole
    bf16 compile took 13.5 s (BENCHMARKS.md). A model repeats one layer: its 32 decode-side
    launches of one projection have the same
    signature (the inputs' dtypes, sizes, strides and offsets as the graph's symbolic
    expressions, and the call's constants in `key`), so the second and later are a copy of the
    first with fresh fake values (a node's meta["val"] is never shared between nodes: Inductor
    reads storage identity from it)."""

    def __init__(self):
        self._traces: dict[tuple, fx.GraphModule] = {}
        self.traced = 0  # how many distinct signatures were traced
        self.copied = 0  # how many calls reused one

    def get(self, fn, inputs: list[fx.Node], key) -> fx.GraphModule:
        vals = [node.meta["val"] for node in inputs]
        memo = (key, *map(signature, vals)) if key is not None else None
        traced = self._traces.get(memo) if memo is not None else None
        if traced is None:
            traced = _trace(fn, vals)
            self.traced += 1
            if memo is not None:
                self._traces[memo] = traced
        else:
            # The copy's fake values, made afresh from this call site's inputs.
            fake_mode = next(val.fake_mode for val in vals if isinstance(val, torch.Tensor))
            FakeTensorProp(traced, fake_mode).propagate_dont_convert_inputs(*vals)
            self.copied += 1
        return traced


def signature(val) -> tuple:
    """What a traced graph depends on in one input: for a tensor its dtype, device, and sizes,
    strides and offset as (symbolic) expressions; a scalar's value or expression."""
    if isinstance(val, torch.Tensor):
        return (
            val.dtype,
            val.device,
            tuple(map(str, val.shape)),
            tuple(map(str, val.stride())),
            str(val.storage_offset()),
        )
    return (type(val).__name__, str(val))


def _trace(fn, vals: list):
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.functional_tensor import FunctionalTensorMode, dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(
        dispatch_functionalize(fn, FunctionalTensorMode()),
        decomposition_table=select_decomp_table(),
        tracing_mode="symbolic",
    )(*vals)


def inline_traced(
    graph: fx.Graph, fn, inputs: list[fx.Node], cache: TraceCache | None = None, key=None
) -> fx.Node:
    """fn(*inputs) traced as AOTAutograd traces for Inductor (functionalized, with Inductor's
    decompositions, over the inputs' fake values: the graph's fake mode and shape environment),
    its nodes copied into `graph` at the current insertion point; returns the node of fn's (one
    tensor) result. With a cache and a key (hashable: every constant fn's trace depends on that
    its inputs do not say), a signature traced before is copied rather than traced again."""
    traced = (cache or TraceCache()).get(fn, inputs, key)
    placeholders = list(traced.graph.find_nodes(op="placeholder"))
    out = graph.graph_copy(traced.graph, dict(zip(placeholders, inputs)))
    if not isinstance(out, fx.Node):
        raise AssertionError(f"expected one tensor from the traced call, got {out!r}")
    return out
