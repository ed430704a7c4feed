"""How Inductor lowers and emits the M dispatch's torch.conds, while our graphs compile.

The M dispatch (passes/dispatch.py) is a torch.cond per FP8 call site whose predicate is a
size (M <= 32), which the host knows before the graph runs. Inductor treats every cond as if
its predicate were a tensor read in the middle of the graph, and two things follow that these
context managers change for size predicates only (tensor predicates, and sizes read from a
tensor's data, keep Inductor's behaviour):

- keep_cuda_graphs: Inductor turns CUDA graphs off for a graph with a cond over GPU tensors.
  Its CUDA graphs record one graph per value of the graph's int inputs (M among them), and each
  recording takes the one branch that is right for its M, so a size cond leaves the decision
  as it was.
- inline_branches (Fp8Config.inline_conds; by default outside CUDA graphs, where the host's
  time per call site shows: on the GPU it gives the functions' bits):
  Inductor's Python wrapper emits each branch as a function of its own, and a call of it costs
  the host an argument list, a size assert per tensor operand, a device guard and
  torch.cuda.set_device, then asserts on its output: 15-23 us per call site a decode step
  (H100, `bench host --chain 8`, against the branch's kernel launch alone), in default mode
  where no CUDA graph hides the host. Emitted inline (the path Inductor takes for AOT
  compilation), a branch is its kernel launches under an `if`. Four things the function kept
  apart are kept apart by hand: an operand whose layout Inductor cannot prove equal to what the
  branch was compiled for still gets the branch's size assert (a strided gate half reaching a
  branch compiled for a contiguous input fails as loudly as before); a branch that call sites
  share is emitted at each with buffers of its own; the sizes Inductor computes on the host
  (ps0, ps1, ...) are named from one table for a graph and its branches, so that a name means
  one expression in the one function they share; and the buffer-reuse planner weighs a branch's
  buffers against its own graph's peak memory (Inductor 2.11 keeps one estimate for all lines).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch


@contextlib.contextmanager
def keep_cuda_graphs():
    """While our graphs lower: a cond whose predicate is not a tensor leaves Inductor's CUDA-graph
    decision as it found it."""
    from torch._inductor import ir, lowering
    from torch._inductor.virtualized import V
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    op = torch.ops.higher_order.cond
    lower_cond = lowering.lowerings.get(op)
    if lower_cond is None:  # an Inductor without a cond lowering: nothing to keep
        yield
        return

    def lower_size_cond(pred, true_fn, false_fn, operands):
        if isinstance(pred, ir.IRNode) or free_unbacked_symbols(pred):
            return lower_cond(pred, true_fn, false_fn, operands)
        reason = V.graph.disable_cudagraphs_reason
        try:
            return lower_cond(pred, true_fn, false_fn, operands)
        finally:
            V.graph.disable_cudagraphs_reason = reason

    lowering.lowerings[op] = lower_size_cond
    try:
        yield
    finally:
        lowering.lowerings[op] = lower_cond


@contextlib.contextmanager
def inline_branches():
    """While our graphs compile: Inductor's Python wrapper emits a size cond's branches inline."""
    try:
        from torch._inductor import ir
        from torch._inductor.codegen.wrapper import EnterSubgraphLine, ExitSubgraphLine, PythonWrapperCodegen
        from torch._inductor.graph import GraphLowering
        from torch._inductor.virtualized import V

        _peak_estimate_line()  # the buffer-reuse planner's estimate, which our branches swap
    except ImportError:  # another Inductor: its own codegen
        yield
        return
    emit_cond = PythonWrapperCodegen.__dict__.get("codegen_conditional")
    make_subgraph = GraphLowering.__dict__.get("make_subgraph")
    if None in (emit_cond, make_subgraph) or not hasattr(
        PythonWrapperCodegen, "codegen_subgraph_by_inlining"
    ):
        yield
        return

    def make_sharing_subgraph(self, *args, **kwargs):
        # Sizes Inductor computes on the host (ps0 = 1 + (s0 // 3)) are named per graph; a branch
        # emitted inline names its own in the enclosing function, so a graph and its branches
        # draw the names from one table: a name means one expression in all of them.
        subgraph = make_subgraph(self, *args, **kwargs)
        for table in ("precomputed_replacements", "inv_precomputed_replacements"):
            setattr(subgraph.sizevars, table, getattr(self.sizevars, table))
        return subgraph

    def codegen_conditional(self, conditional) -> None:
        if (
            type(self) is not PythonWrapperCodegen  # C++ and FX wrappers keep their own
            or V.graph.cpp_wrapper
            or V.graph.aot_mode
            or not isinstance(conditional.predicate, ir.ShapeAsConstantBuffer)
            or not all(hasattr(self, known) for known in ("allocated", "freed", "reuses"))
            or not all(_shares_size_names(V.graph, branch.graph) for branch in _branches(conditional))
        ):
            return emit_cond(self, conditional)
        name = conditional.get_name()
        operands = [operand.codegen_reference() for operand in conditional.operands]
        outputs = [f"{name}[{i}]" for i in range(len(conditional.outputs))]
        self.writeline(f"{name} = [None] * {len(conditional.outputs)}")
        heads = (f"if {conditional.predicate.codegen_reference()}:", "else:")
        for head, branch in zip(heads, _branches(conditional)):
            self.writeline(head)
            self.writeline(EnterSubgraphLine(self, branch.graph))
            self.writeline(_peak_estimate_line()(self, branch.graph))
            _forget_buffers(self, branch.graph.name)
            _assert_unproven_layouts(self, conditional.operands, operands, branch.graph)
            self.codegen_subgraph_by_inlining(branch, operands, outputs)
            self.writeline(_peak_estimate_line()(self, None))
            self.writeline(ExitSubgraphLine(self))

    PythonWrapperCodegen.codegen_conditional = codegen_conditional
    GraphLowering.make_subgraph = make_sharing_subgraph
    try:
        yield
    finally:
        PythonWrapperCodegen.codegen_conditional = emit_cond
        GraphLowering.make_subgraph = make_subgraph


def _branches(conditional) -> tuple:
    return conditional.true_subgraph, conditional.false_subgraph


def _shares_size_names(graph, branch_graph) -> bool:
    """Whether branch_graph names its host-computed sizes from graph's table (made while
    inline_branches was on: make_sharing_subgraph)."""
    return (
        branch_graph is not None
        and branch_graph.sizevars.precomputed_replacements is graph.sizevars.precomputed_replacements
    )


@functools.cache
def _peak_estimate_line() -> type:
    """A wrapper line that makes its branch's graph the one the buffer-reuse planner estimates
    peak memory for (graph), or gives the enclosing graph's estimate back (None).

    The planner asks, before it reuses a freed buffer, whether the peak between the free and the
    allocation would grow: it looks that up by the allocation's index among its graph's
    scheduler nodes. Inductors before 2.13 (2.11 on the GPU image) keep one estimate, the
    outermost graph's, for every line: an inline branch's indices then read another graph's
    table (past its end: "Start index 12 out of bounds" while compiling a Qwen3-MoE block; within
    it: a decision on the wrong numbers). Newer Inductors swap it at each subgraph themselves;
    there this line swaps it again, to an estimate of the same graph. It emits no code."""
    from torch._inductor import config
    from torch._inductor.codegen.wrapper import EfficientPeakEstimate, MemoryPlanningLine, NullLine
    from torch._inductor.virtualized import V

    @dataclasses.dataclass
    class BranchPeakEstimate(MemoryPlanningLine):
        graph: object = None

        def plan(self, state):
            enclosing = self.wrapper.__dict__.setdefault("_fp8_enclosing_peak_estimates", [])
            if self.graph is None:
                self.wrapper.estimate_peak = enclosing.pop()
            else:
                enclosing.append(getattr(self.wrapper, "estimate_peak", None))
                if config.allow_buffer_reuse:
                    with V.set_graph_handler(self.graph):
                        self.wrapper.estimate_peak = EfficientPeakEstimate()
            return NullLine(self.wrapper)

    return BranchPeakEstimate


def _forget_buffers(wrapper, graph_name: str) -> None:
    """Call sites of one signature share their branches (passes/dispatch.py), so one branch is
    emitted inline at each of them. The wrapper allocates and frees a buffer by name once (it
    expects a branch once, as a function): a branch's buffers, its nested branches' too (their
    names start with its own), are made new for each emission. Left known, the second site
    would use a buffer the first one freed."""
    prefix = graph_name + "_"
    for names in (wrapper.allocated, wrapper.freed):
        for name in [name for name in names if name.startswith(prefix)]:
            names.discard(name)
    for name in [name for name in wrapper.reuses if name.startswith(prefix)]:
        del wrapper.reuses[name]


def _assert_unproven_layouts(wrapper, operands, references, branch_graph) -> None:
    """The size asserts the branch's own function would make on its tensor operands, for those
    whose layout in the enclosing graph is not provably the branch's."""
    from torch._inductor.virtualized import V

    sizevars = V.graph.sizevars
    expected = [branch_graph.graph_inputs[name] for name in branch_graph.graph_input_names]
    for operand, reference, inner in zip(operands, references, expected):
        try:
            inner_size, inner_stride = inner.get_size(), inner.get_stride()
            outer_size, outer_stride = operand.get_size(), operand.get_stride()
        except (AttributeError, NotImplementedError):  # a SymInt operand, or no fixed layout
            continue
        if sizevars.statically_known_list_equals(
            outer_size, inner_size
        ) and sizevars.statically_known_list_equals(outer_stride, inner_stride):
            continue
        size, stride = wrapper.codegen_shape_tuple(inner_size), wrapper.codegen_shape_tuple(inner_stride)
        wrapper.writeline(f"assert_size_stride({reference}, {size}, {stride})")
