"""How our graphs' size conds reach Inductor's generated code (fp8compile/size_conds.py): the M
dispatch's branches are emitted inline, with the numbers of Inductor's own branch functions;
an operand whose layout is not provably the branch's keeps the branch's size assert; a cond on
a tensor keeps Inductor's emission."""

import re
import types

import pytest
import sympy
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

import fp8compile
from fp8compile import size_conds
from tests.conftest import BF16, GATED_MLP, RANGES, randn

pytestmark = pytest.mark.inductor  # what Inductor emits for the M dispatch

BRANCH_FUNCTION = re.compile(r"^def (\w+)\(args\):", re.M)


def two_linears():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256, bias=False), nn.SiLU(), nn.Linear(256, 256, bias=False)).to(BF16)


def compile_and_run(model, xs, **options) -> tuple[list[torch.Tensor], str]:
    """model compiled with dynamic M, run on each x; the outputs and the generated code of the
    first call."""
    compiled = torch.compile(model, backend=fp8compile.backend(**options), dynamic=True)
    with torch.no_grad():
        first, (code, *_) = run_and_get_code(compiled, xs[0])
        return [first] + [compiled(x) for x in xs[1:]], code


def test_the_m_dispatchs_branches_are_emitted_inline_with_the_numbers_of_branch_functions(ranged_references):
    torch.manual_seed(1)
    xs = [randn(m, 256) for m in (4, 40, 100)]  # each range of M: ref_small, ref_medium, reference
    model = two_linears()
    options = dict(backends=ranged_references, **RANGES)
    inline_outs, inline_code = compile_and_run(model, xs, inline_conds=True, **options)
    torch._dynamo.reset()
    function_outs, function_code = compile_and_run(model, xs, inline_conds=False, **options)

    # Inductor's own emission: each branch a function the graph calls.
    assert {"_fp8_0_m_le_32", "_fp8_0_m_gt_32"} <= set(BRANCH_FUNCTION.findall(function_code))
    # inline_conds: the graph's `call` is the only function; the branches are blocks under an
    # `if` on M, at each of the two call sites (which share their branches).
    assert BRANCH_FUNCTION.findall(inline_code) == [], BRANCH_FUNCTION.findall(inline_code)
    assert len(re.findall(r"^ +# subgraph: _fp8_0_m_le_32$", inline_code, re.M)) == 2
    assert len(re.findall(r"^ +if s\d+ <= 32:$", inline_code, re.M)) == 2
    assert len(re.findall(r"^ +if s\d+ <= 64:$", inline_code, re.M)) == 2
    for backend in ranged_references:
        assert inline_code.count(f"backend='{backend}'") == 2, backend
    # The same kernels on the same operands: the same bits, and each range of M was taken.
    for x, got, want in zip(xs, inline_outs, function_outs):
        assert torch.equal(got, want)
        assert fp8compile.calc_diff(got, model(x)) < GATED_MLP


def test_the_branches_are_inline_by_default_outside_cuda_graphs_and_functions_under_them(ranged_references):
    # Outside CUDA graphs every call of a branch function costs the host its checks; a replayed
    # CUDA graph pays none, and there the branches stay as Inductor emits them.
    fp8 = fp8compile.backend(backends=ranged_references, **RANGES)
    codes = {}
    for mode in (None, "reduce-overhead"):
        torch._dynamo.reset()
        compiled = torch.compile(two_linears(), backend=fp8, mode=mode, dynamic=True)
        with torch.no_grad():
            _, (codes[mode], *_) = run_and_get_code(compiled, randn(4, 256))
    assert BRANCH_FUNCTION.findall(codes[None]) == []
    assert len(re.findall(r"^ +if s\d+ <= 32:$", codes[None], re.M)) == 2
    assert {"_fp8_0_m_le_32", "_fp8_0_m_gt_32"} <= set(BRANCH_FUNCTION.findall(codes["reduce-overhead"]))
    assert fp8compile.Fp8Config().inline_conds is None
    with pytest.raises(TypeError, match="inline_conds"):
        fp8compile.Fp8Config(inline_conds="yes")


class RecordingWrapper:
    def __init__(self):
        self.lines = []

    def writeline(self, line):
        self.lines.append(line)

    @staticmethod
    def codegen_shape_tuple(shape):
        return "(" + ", ".join(str(s) for s in shape) + ",)"


class Layout:
    def __init__(self, size, stride):
        self.size, self.stride = size, stride

    def get_size(self):
        return self.size

    def get_stride(self):
        return self.stride


def test_an_operand_whose_layout_is_not_provably_the_branchs_keeps_the_branchs_size_assert():
    """The branch was compiled for its operands' recorded layouts; where the enclosing graph's
    buffer is provably the same (size and stride), the assert the branch function would make
    cannot fail and is left out; otherwise it is made, so a strided gate half reaching a branch
    compiled for a contiguous input fails there, as it did with Inductor's branch functions."""
    from torch._inductor.sizevars import SizeVarAllocator
    from torch._inductor.virtualized import V
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    m = sympy.Symbol("s7", integer=True, positive=True)
    branch = types.SimpleNamespace(
        graph_input_names=["arg0", "arg1", "arg2"],
        graph_inputs={
            "arg0": m,  # M itself: no layout
            "arg1": Layout([m, 512], [512, 1]),
            "arg2": Layout([m, 512], [512, 1]),
        },
    )
    operands = [
        types.SimpleNamespace(),  # a SymInt operand has no get_size
        Layout([m, 512], [512, 1]),  # provably the branch's layout
        Layout([m, 512], [1024, 1]),  # a gate half of a merged gate_up: row stride 1024
    ]
    wrapper = RecordingWrapper()
    with V.set_graph_handler(types.SimpleNamespace(sizevars=SizeVarAllocator(ShapeEnv()))):
        size_conds._assert_unproven_layouts(wrapper, operands, ["s7", "buf1", "buf2"], branch)
    assert wrapper.lines == ["assert_size_stride(buf2, (s7, 512,), (512, 1,))"]


def test_a_cond_on_a_tensor_keeps_inductors_branch_functions():
    def fn(x):
        return torch.cond(x.sum() > 0, lambda t: t + 1, lambda t: t - 1, (x,))

    with size_conds.inline_branches():
        _, (code, *_) = run_and_get_code(torch.compile(fn), torch.randn(8))
    assert {"true_graph_0", "false_graph_0"} <= set(BRANCH_FUNCTION.findall(code))


def test_inductors_emission_is_restored_after_our_graphs_compile():
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen
    from torch._inductor.graph import GraphLowering

    before = PythonWrapperCodegen.codegen_conditional, GraphLowering.make_subgraph
    with pytest.raises(RuntimeError), size_conds.inline_branches():
        assert (PythonWrapperCodegen.codegen_conditional, GraphLowering.make_subgraph) != before
        raise RuntimeError("a compile that fails")
    assert (PythonWrapperCodegen.codegen_conditional, GraphLowering.make_subgraph) == before


def test_sizes_computed_on_the_host_keep_one_meaning_in_a_graph_and_its_inline_branches():
    """Inductor names a size it computes on the host (ps0 = 1 + (s0 // 3), here for a padding)
    per graph. A branch emitted inline shares the enclosing function: its ps0 for another
    expression would overwrite the graph's, and the graph's kernels after the cond would read the
    branch's value (wrong numbers, no error). The graph and its branches name them from one table."""
    import torch.nn.functional as F

    def branch(t):
        m = t.shape[0]
        padded = F.pad(t, (0, 0, 3 * m // 5, 0))  # rows in front: a host-computed size
        return padded[:m] * 2 + padded[-m:]

    def fn(x):
        m = x.shape[0]
        y = F.pad(x, (0, 0, m // 3 + 1, 0))  # the graph's own host-computed size, before the cond
        y = y[:m] + y[-m:]
        z = torch.cond(m <= 32, branch, lambda t: t * 3, (y,))
        w = F.pad(z, (0, 0, m // 3 + 1, 0))  # and after it
        return w[:m] + w[-m:]

    x = torch.randn(20, 64)
    with size_conds.inline_branches():
        out, (code, *_) = run_and_get_code(torch.compile(fn, dynamic=True), x)
    assert "# subgraph: true_graph_0" in code and BRANCH_FUNCTION.findall(code) == []
    definitions = re.findall(r"\b(ps\d+) = (.*)", code)
    assert len(definitions) == 2 and len({name for name, _ in definitions}) == 2, definitions
    assert torch.allclose(out, fn(x), atol=1e-5)


def test_a_branch_that_call_sites_share_is_emitted_at_each_with_buffers_of_its_own():
    """Call sites of one signature share one branch graph (passes/dispatch.py); emitted inline at
    each, its intermediate buffers are allocated and freed at each (Inductor's wrapper knows a
    buffer by name: unforgotten, the second site would read one the first site freed)."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def branch(x):  # an intermediate (the row sums) allocated, used and freed inside the branch
        return (x.float().softmax(-1) * x.float().sum(1, keepdim=True).sigmoid() + 1).to(x.dtype)

    def three_conds(x):
        for _ in range(3):
            x = torch.cond(x.shape[0] <= 32, branch, lambda t: t * 3, (x,))
        return x

    def sharing(gm, example_inputs):
        def inner(aten_gm, inputs, **kwargs):
            # the second and third conds take the same operands: they share the second's branches
            _, second, third = aten_gm.graph.find_nodes(
                op="call_function", target=torch.ops.higher_order.cond
            )
            third.args = (third.args[0], second.args[1], second.args[2], *third.args[3:])
            aten_gm.graph.eliminate_dead_code()
            aten_gm.recompile()
            return compile_fx_inner(aten_gm, inputs, **kwargs)

        with size_conds.inline_branches():
            return compile_fx(gm, example_inputs, inner_compile=inner)

    x = randn(8, 64)
    out, (code, *_) = run_and_get_code(torch.compile(three_conds, backend=sharing, dynamic=True), x)
    branches = re.findall(r"# subgraph: (\w+)", code)
    assert branches.count("true_graph_1") == 2 and "true_graph_2" not in branches, branches
    assert BRANCH_FUNCTION.findall(code) == []
    assert torch.allclose(out.float(), three_conds(x).float(), atol=1e-2)


def plan_with_one_peak_estimate(wrapper):
    """Inductor 2.11's buffer-reuse planner (the GPU image's): a planning state per subgraph, but
    one peak-memory estimate, the outermost graph's, for every line."""
    from torch._inductor.codegen.wrapper import (
        EnterSubgraphLine,
        ExitSubgraphLine,
        MemoryPlanningLine,
        MemoryPlanningState,
    )

    states = [MemoryPlanningState()]
    for i, line in enumerate(wrapper.lines):
        if isinstance(line, MemoryPlanningLine):
            wrapper.lines[i] = line.plan(states[-1])
        elif isinstance(line, EnterSubgraphLine):
            states.append(MemoryPlanningState())
        elif isinstance(line, ExitSubgraphLine):
            states.pop()


@pytest.mark.parametrize("planner", ["inductors", "one_peak_estimate"])
def test_a_branchs_buffer_reuse_is_planned_against_its_own_graphs_peak_memory(planner, monkeypatch):
    """Before Inductor reuses a freed buffer it looks up the peak memory between the free and the
    allocation by their indices among their graph's scheduler nodes. An inline branch's buffers
    are looked up in the branch's own table, also under a planner that keeps one table for every
    line (Inductor 2.11's): there the branch's indices ran past the end of the enclosing graph's
    ("Start index 3 out of bounds [0, 2]"; a Qwen3-MoE block's decode side on the GPU)."""
    from torch._inductor.codegen import wrapper

    if planner == "one_peak_estimate":
        monkeypatch.setattr(wrapper.PythonWrapperCodegen, "memory_plan_reuse", plan_with_one_peak_estimate)
    allocate_lines = []
    decide = wrapper.AllocateLine.should_reuse_buffer

    def recording(line, free_line, size):
        allocate_lines.append((line.scheduler_node_index, line.wrapper.estimate_peak.segmented_tree.n))
        return decide(line, free_line, size)

    monkeypatch.setattr(wrapper.AllocateLine, "should_reuse_buffer", recording)

    def branch(t, w):  # six matmuls (extern kernels) between Inductor kernels: buffers to reuse
        for _ in range(6):
            t = torch.mm(t.softmax(-1) + 1, w)
        return t

    def fn(x, w):
        return torch.cond(x.shape[0] <= 32, branch, lambda t, w: t * 3, (x, w))

    x, w = torch.randn(8, 64), torch.randn(64, 64) / 8
    with size_conds.inline_branches():
        out, (code, *_) = run_and_get_code(torch.compile(fn, dynamic=True), x, w)
    assert "# subgraph: true_graph_0" in code and BRANCH_FUNCTION.findall(code) == []
    # reuse was decided in the branch, each time within the table it looked up
    assert allocate_lines and all(index < nodes for index, nodes in allocate_lines), allocate_lines
    assert "# reuse" in code
    assert torch.allclose(out, fn(x, w), atol=1e-4)
