"""passes/trace.py: a function traced as AOTAutograd traces for Inductor and copied into a graph
after it, once per call signature."""

import os
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.multiprocessing.reductions import StorageWeakRef

from fp8compile.passes import trace
from fp8compile.passes.trace import TraceCache, inline_traced

pytestmark = pytest.mark.inductor  # launches Inductor makes itself


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
    """Here one over a dynamic M, with an aten.zeros that Inductor only accepts decomposed."""
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


def _traced_op_guards(op_call, hint: int, fixed: dict):
    """The guards that tracing op_call(*inputs) adds to the shape environment, its inputs fake
    tensors whose first dimension is a symbolic M (traced at M = hint), as a compiled graph
    traces our triton_ops; returns (guards, the symbols of M: one per input that has it)."""
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())

    def fake(shape, dtype, dynamic):
        dims = [DimDynamic.DYNAMIC if dynamic and i == 0 else DimDynamic.STATIC for i in range(len(shape))]
        return mode.from_tensor(
            torch.empty(shape, dtype=dtype), symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims)
        )

    inputs = [
        fake((hint, *shape[1:]) if shape[0] == "M" else shape, dtype, shape[0] == "M")
        for shape, dtype in fixed.values()
    ]
    symbols = {t.shape[0].node.expr for t in inputs if isinstance(t.shape[0], torch.SymInt)}
    trace._trace(op_call, inputs)
    return [guard.expr for guard in mode.shape_env.guards], symbols


E, TOP_K, H, INTER = 16, 4, 512, 256
FP8 = torch.float8_e4m3fn
MOE_INPUTS = {
    "x": (("M", H), torch.bfloat16),
    "topk_ids": (("M", TOP_K), torch.int32),
    "topk_weights": (("M", TOP_K), torch.float32),
    "w13": ((E, 2 * INTER, H), FP8),
    "s13": ((E, 2 * INTER // 128, H // 128), torch.float32),
    "w2": ((E, H, INTER), FP8),
    "s2": ((E, H // 128, INTER // 128), torch.float32),
}
LINEAR_INPUTS = {"x": (("M", H), torch.bfloat16), "w": ((384, H), FP8), "s": ((3, H // 128), torch.float32)}


def _traced_ops():
    """(name, the op's call, its inputs, the token counts its side of the M dispatch serves)."""
    pytest.importorskip("triton")
    from fp8compile.ops.linear import decode_op, scaled_mm_op  # noqa: F401  (registers them)
    from fp8compile.ops.moe import decode_op as moe_decode_op, gluon_op as moe_gluon_op  # noqa: F401  (registers them)

    ops = torch.ops.fp8compile
    least = moe_gluon_op.min_tokens(E, TOP_K)
    return [
        (
            "moe_gluon",
            lambda *v: ops.moe_gluon(*v, None, None, False, tokens_from=least),
            MOE_INPUTS,
            range(least, 8 * least),
        ),
        (
            "moe_decode",
            lambda *v: ops.moe_decode(*v, None, None, False, max_tokens=16),
            MOE_INPUTS,
            range(2, 17),
        ),
        (
            "linear_decode",
            lambda *v: ops.linear_decode(*v, None, False, max_m=16),
            LINEAR_INPUTS,
            range(2, 17),
        ),
        ("linear_scaled_mm", lambda *v: ops.linear_scaled_mm(*v), LINEAR_INPUTS, range(17, 5000)),
    ]


def failing_guards() -> dict[str, list[str]]:
    """Per traced op, traced at M = 3, at both ends of its side's range and far above it (a graph
    compiled for a prefill traces its decode side there): the guards it added that a token count
    of its side fails (with the first such count)."""
    failing = {}
    for name, call, inputs, served in _traced_ops():
        failing[name] = []
        for hint in (3, served.start, served.stop - 1, 4 * served.stop):
            guards, symbols = _traced_op_guards(call, hint, inputs)
            for guard in guards:
                holds = _as_function_of_m(guard, symbols)
                first = next((v for v in served if not holds(v)), None)
                if first is not None:
                    failing[name].append(f"traced at M={hint}: {guard} fails at M={first}")
    return failing


def _as_function_of_m(guard, symbols):
    """The guard as Python code of M (every symbol in `symbols` is M), as Dynamo runs its guards:
    thousands of token counts checked in microseconds each, where sympy's subs took milliseconds."""
    from torch.utils._sympy.printers import PythonPrinter

    names = sorted(str(symbol) for symbol in symbols)
    check = eval(f"lambda {', '.join(names)}: {PythonPrinter().doprint(guard)}")  # noqa: S307
    return lambda m: bool(check(*[m] * len(names)))


def _in_a_process_without_the_interpreter(call: str):
    """The JSON that tests.test_trace.<call> prints, run in a process of its own: wrap_triton does
    not trace the interpreter's kernels (TRITON_INTERPRET=1 in this one)."""
    import json
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    script = f"import json; from tests.test_trace import {call.split('(')[0]}; print(json.dumps({call}))"
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_traced_op_adds_no_guard_that_a_token_count_of_its_side_fails():
    """A default-mode graph over a dynamic M traces each side's op with the graph's M at compile
    time, which may lie outside that side's range (the cond picks the side per call). A guard the
    body adds is a guard on the whole graph: one that fails inside the side's range recompiles the
    model there (moe_gluon's (chunks, BLOCK_E) scratch guarded chunks == 1 when traced at M = 3:
    the Qwen3-MoE test model recompiled at 33 tokens on the GPU)."""
    pytest.importorskip("triton")
    failing = _in_a_process_without_the_interpreter("failing_guards()")
    assert set(failing) == {"moe_gluon", "moe_decode", "linear_decode", "linear_scaled_mm"}
    assert failing == {name: [] for name in failing}


def traced_decode_launch(op: str) -> dict:
    """The decode op `op` traced at M = 3 (split-K 2 under the CPU's tile choice): the ops of its
    graph, its launch's split and counters argument, and the addresses of the live counters."""
    from fp8compile.ops.linear import decode_op, triton_gemm, triton_scaled  # noqa: F401  (registers the ops)

    mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = [
        mode.from_tensor(torch.empty([3 if size == "M" else size for size in shape], dtype=dtype))
        for shape, dtype in LINEAR_INPUTS.values()
    ]
    if op == "linear_decode":
        call = lambda x, w, s: torch.ops.fp8compile.linear_decode(x, w, s, None, False, 16)  # noqa: E731
    else:  # rowwise: a scale per output channel
        fakes[2] = mode.from_tensor(torch.empty(LINEAR_INPUTS["w"][0][0]))
        call = lambda x, w, s: torch.ops.fp8compile.linear_scaled_decode(x, w, s, max_m=16)  # noqa: E731
    graph = trace._trace(call, fakes).graph
    (launch,) = [
        node for node in graph.nodes if node.target is torch.ops.higher_order.triton_kernel_wrapper_functional
    ]
    kwargs = launch.kwargs["kwargs"]
    return dict(
        targets=[str(node.target) for node in graph.nodes if node.op == "call_function"],
        split=kwargs["SPLIT_K"],
        arrivals=[kwargs.get("arrivals_hi"), kwargs.get("arrivals_lo")],
        counters=[buffer.data_ptr() for buffer in triton_gemm._ARRIVALS[torch.device("cpu")]],
    )


@pytest.mark.parametrize("op", ["linear_decode", "linear_scaled_decode"])
def test_a_traced_decode_launch_reads_the_split_k_counters_by_address_with_no_fill_per_call(op):
    """Outside CUDA graphs each launch is host time: the decode ops Inductor launches must not zero
    a counter buffer of their own per call (a second launch per linear). The split-K programs meet
    on the eager path's counters, which every launch leaves at zero, passed as their address (ints
    below 2**31: a tensor the kernel writes would be cloned per call by functionalization)."""
    pytest.importorskip("triton")
    traced = _in_a_process_without_the_interpreter(f"traced_decode_launch({op!r})")
    assert traced["split"] == 2
    assert not [
        target for target in traced["targets"] if "zero" in target or "full" in target or "fill" in target
    ]
    high, low = traced["arrivals"]
    assert high * 2**31 + low == traced["counters"][-1] and 0 <= low < 2**31 and 0 <= high < 2**31
