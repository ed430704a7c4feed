"""passes/trace.py: a function traced as AOTAutograd traces for Inductor and copied into a graph
after it, once per call signature."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.multiprocessing.reductions import StorageWeakRef

from fp8compile.passes import trace
from fp8compile.passes.trace import TraceCache, inline_traced


def _graph_over_a_dynamic_m(rows=5, cols=8):
    """A graph with x (M, cols) and x * 2 as inputs to inline into, M symbolic."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = mode.from_tensor(torch.randn(rows, cols), static_shapes=False)
    y = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2))
    with mode:
        y.meta["val"] = x.meta["val"] * 2
    return graph, x, y


_real_trace = trace._trace


def _run(graph, *args):
    return torch.fx.GraphModule(torch.nn.Module(), graph)(*args)


def test_a_traced_call_is_inlined_with_inductors_decompositions_over_the_graphs_symbolic_sizes():
    """Here one over a dynamic M, with an aten.zeros that Inductor only accepts decomposed (the
    decode kernel's split-K counters are one)."""
    graph, x, _ = _graph_over_a_dynamic_m()
    fn = lambda t: torch.zeros(t.shape[0], 4, dtype=torch.int32) + t[:, :4].to(torch.int32)  # noqa: E731
    graph.output(inline_traced(graph, fn, [x]))
    targets = {node.target for node in graph.nodes if node.op == "call_function"}
    assert torch.ops.aten.zeros.default not in targets and torch.ops.aten.sym_size.int in targets
    assert isinstance(x.meta["val"].shape[0], torch.SymInt)
    x_real = torch.randn(5, 8)
    assert torch.equal(_run(graph, x_real), fn(x_real))


def test_call_sites_of_one_signature_are_traced_once_and_copied_with_their_own_fake_values(monkeypatch):
    traced = []
    monkeypatch.setattr(trace, "_trace", lambda fn, vals: traced.append(vals) or _real_trace(fn, vals))
    graph, x, y = _graph_over_a_dynamic_m()
    cache = TraceCache()
    fn = lambda t: torch.relu(t) + 1  # noqa: E731
    first = inline_traced(graph, fn, [x], cache, key="relu")
    second = inline_traced(graph, fn, [y], cache, key="relu")  # y: the same (M, 8), contiguous
    graph.output((first, second))
    assert len(traced) == 1 and (cache.traced, cache.copied) == (1, 1)
    # Inductor's reinplacing reads storage identity from meta["val"]: no two nodes may share it.
    vals = [node.meta["val"] for node in graph.nodes if node.op == "call_function"]
    storages = [StorageWeakRef(val.untyped_storage()) for val in vals if isinstance(val, torch.Tensor)]
    assert len(set(storages)) == len(storages)
    assert second.meta["val"].shape == y.meta["val"].shape
    x_real = torch.randn(5, 8)
    a, b = _run(graph, x_real)
    assert torch.equal(a, fn(x_real)) and torch.equal(b, fn(x_real * 2))



@pytest.mark.parametrize("change", ["key", "strides", "dtype"])
def test_a_call_site_that_differs_in_a_constant_or_its_inputs_layout_is_traced_again(change):
    graph, x, y = _graph_over_a_dynamic_m()
    cache = TraceCache()
    fn = lambda t: t.float().sum(-1)  # noqa: E731
    inline_traced(graph, fn, [x], cache, key="sum")
    other, key = y, "sum"
    fake = y.meta["val"]
    if change == "key":
        key = "sum of another call"
    elif change == "strides":  # the same (M, 8), with rows 16 apart: the left half of (M, 16)
        wide = graph.call_function(torch.ops.aten.cat.default, ([y, y], 1))
        other = graph.call_function(torch.ops.aten.slice.Tensor, (wide, 1, 0, 8))
        with fake.fake_mode:
            wide.meta["val"] = torch.cat([fake, fake], 1)
            other.meta["val"] = wide.meta["val"][:, :8]
        assert other.meta["val"].shape == fake.shape and other.meta["val"].stride() != fake.stride()
    else:
        other = graph.call_function(torch.ops.aten._to_copy.default, (y,), {"dtype": torch.bfloat16})
        with fake.fake_mode:
            other.meta["val"] = fake.to(torch.bfloat16)
    inline_traced(graph, fn, [other], cache, key=key)
    assert (cache.traced, cache.copied) == (2, 0)


def test_without_a_key_nothing_is_reused():
    graph, x, y = _graph_over_a_dynamic_m()
    cache = TraceCache()
    for node in (x, y):
        inline_traced(graph, torch.relu, [node], cache)
    assert (cache.traced, cache.copied) == (2, 0)
