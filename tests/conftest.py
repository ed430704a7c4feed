"""Shared fixtures. Shape letters: M tokens, N output features, K input features."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os

import torch

# Without a GPU, Triton kernels run in Triton's CPU interpreter; it must be chosen before any
# kernel is defined (at import of fp8compile.ops.*/triton_*).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Inductor's C++ kernels without the vector ISA: on a 2-core machine its vectorized kernels
    # took 23% more of a cold test run's time (the ISA probe's compiles, the vectorization
    # checks, the heavier C++), and what the CPU tests check comes from our passes and the
    # reference ops, not from Inductor's SIMD code. Read when torch._inductor.config is first
    # imported (below, through fp8compile), and inherited by the processes the tests start.
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
    # The rewritten graphs run as the ops they hold, not through Inductor's C++ code generation
    # (Fp8Config.inductor): on the CPU the tests check our passes and the reference ops, and
    # Inductor's C++ kernels (hundreds of compiles, each a g++ run) were most of a cold run's
    # time: .ci/run's tests on 2 cores, 817 s through Inductor (082cccc), 535 s without (14b30d7,
    # 2026-11-27). Tests of what Inductor makes of our graphs carry @pytest.mark.inductor
    # (inductor_where_marked); the GPU runs everything through Inductor. Inherited by the
    # processes the tests start.
    os.environ.setdefault("FP8COMPILE_INDUCTOR", "0")

import pytest

import fp8compile
import fp8compile.passes
from fp8compile import registry
from fp8compile.debug import graph_diff, graph_listing

BF16 = torch.bfloat16

# Each xdist worker takes its share of the cores for torch's intra-op threads: two workers of two
# threads each on a 2-core machine spent more CPU time on the same tests (test_recipes.py and
# test_moe.py: 229 s against 212 s, 2026-11-27, one run each, the second on warm caches).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


@pytest.fixture(autouse=True)
def inductor_where_marked(request, monkeypatch):
    """A test marked `inductor` compiles through Inductor even where the others do not."""
    if request.node.get_closest_marker("inductor"):
        monkeypatch.setenv("FP8COMPILE_INDUCTOR", "1")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts with an empty Dynamo cache, so compile counts are the test's own."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


def _triton_language_owners() -> list:
    """The modules and classes of triton.language whose members Triton's interpreter patches."""
    try:
        import triton.language as tl
    except ImportError:
        return []
    return [tl, tl.core, tl.math, tl.core.tensor, tl.core.tensor_descriptor_base]


# Their members before any kernel ran (Triton is imported by fp8compile above).
_TRITON_LANGUAGE = [(owner, dict(vars(owner))) for owner in _triton_language_owners()]


@pytest.fixture(autouse=True)
def triton_language_restored():
    """Triton 3.9's interpreter patches triton.language again for every standard-library @jit
    function a kernel calls (tl.cdiv, tl.max, ...) and never undoes that (InterpretedFunction
    .__call__), so after an interpreted kernel triton.language.core's builtins stay the
    interpreter's. A real compile later in the process (tests/test_gluon_gemm.py builds the Gluon
    kernel for Hopper on any machine) then fails inside Triton's code generator, unless Triton's
    cache already holds the kernel. Each test leaves triton.language as it found it."""
    yield
    for owner, members in _TRITON_LANGUAGE:
        for name in set(vars(owner)) - set(members):
            if not inspect.ismodule(vars(owner)[name]):  # a submodule imported since stays
                delattr(owner, name)
        for name, member in members.items():
            if vars(owner).get(name, None) is not member:
                setattr(owner, name, member)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Accuracy bounds of compiled models against eager bf16, in calc_diff. Errors of FP8 GEMMs in
# series add up; one block-FP8 GEMM measures 6.5e-4..7.2e-4 against fp32 (test_ops, test_e8m0),
# so a bound is (GEMMs in series) x 7.2e-4. Measured over seeds 0-4 beside each.
ONE_GEMM = 7.2e-4
TWO_GEMMS = 2 * ONE_GEMM  # linear -> gelu -> linear, 256 -> 512 -> 256: 1.27e-3..1.34e-3
ATTENTION = 2.2 * ONE_GEMM  # v -> o in series, q/k through softmax: 1.26e-3..1.41e-3
GATED_MLP = 3 * ONE_GEMM  # gate, up, down: 1.83e-3..2.11e-3 (M = 8), 1.89e-3..2.01e-3 (M = 74)
SIX_IN_SERIES = 6 * ONE_GEMM  # tests.models.LinearForms: 3.90e-3..4.06e-3
GPU_REASON = "needs a CUDA GPU"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason=GPU_REASON)


# The files whose tests take longest on a 2-core CPU machine, longest first (--durations of
# README's test command, summed by file, 2026-11-27; test_architectures.py's every-architecture
# matrix, about 10 minutes alone, 2026-11-28): they run first, so that the two xdist
# workers share them and finish together, not one idle while the other runs a long file handed
# out last. README's command keeps this order (--no-loadscope-reorder: xdist would otherwise hand
# out the files with the most tests first).
LONGEST_FIRST = (
    "test_architectures.py",
    "test_whole_model.py",
    "test_tensor_parallel.py",  # its tests share one spawn (a module fixture)
    "test_recipes.py",
    "test_backend.py",
    "test_moe_kernels.py",
    "test_moe.py",
    "test_mqa_logits.py",
    "test_trace.py",
    "test_dtypes.py",
    "test_llama.py",
)


def pytest_collection_modifyitems(items):
    """A test skipped without CUDA (`gpu`) also carries the `gpu` marker, so that `pytest -m gpu`
    selects every GPU test, in whichever file. The LONGEST_FIRST files' tests go first, each
    file's in its own order."""
    for item in items:
        if any(mark.kwargs.get("reason") == GPU_REASON for mark in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.gpu)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # a stable sort


@contextlib.contextmanager
def op_body_runs():
    """Records the Python runs of our ops' bodies: each looks its kernel up in the table of
    fp8compile/ops/kernels.py, so a call replayed from a CUDA graph records none."""
    from fp8compile.ops import kernels

    runs = []
    implementation = kernels.implementation
    kernels.implementation = lambda *a: runs.append(a) or implementation(*a)
    try:
        yield runs
    finally:
        kernels.implementation = implementation


def randn(*shape, scale: float = 1.0, dtype=BF16, device="cpu") -> torch.Tensor:
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def golden_text(path, diff: str) -> str:
    """The golden file at path, for `assert diff == golden_text(path, diff)`. With
    FP8COMPILE_UPDATE_GOLDEN=1 it is written with diff first: after an intended change, and the
    change to the file read before it is committed."""
    if os.environ.get("FP8COMPILE_UPDATE_GOLDEN"):
        with open(path, "w") as f:
            f.write(diff)
    with open(path) as f:
        return f.read()


def fp8_exact_activation(m: int, k: int, device="cpu") -> torch.Tensor:
    """bf16 activations whose 1x128 quantization involves no rounding: each group is a power
    of two times FP8 values with one element at +-448. Triton 3.9's CPU interpreter rounds
    float -> e4m3 wrongly where rounding carries into the next power of two (124.8 -> 64), so
    interpreter tests use inputs where no conversion rounds; on the GPU any input works."""
    values = torch.randn(m, k, device=device).to(torch.float8_e4m3fn).float()
    values[:, ::128] = 448.0 * torch.sign(torch.randn(m, k // 128, device=device))
    exponent = torch.randint(-8, 8, (m, k // 128), device=device).repeat_interleave(128, dim=1)
    return (values * torch.exp2(exponent.float())).to(BF16)


@dataclasses.dataclass
class Captured:
    before: list[str]  # graph_listing of the ATen graph before our passes
    after: torch.fx.GraphModule

    def count(self, target) -> int:
        return len(self.ops(target))

    def ops(self, target) -> list[torch.fx.Node]:
        """Nodes calling target, in the graph and inside torch.cond branches (nested ones too)."""
        return [
            node
            for _, sub in self.after.named_modules()
            if isinstance(sub, torch.fx.GraphModule)
            for node in sub.graph.find_nodes(op="call_function", target=target)
        ]


@pytest.fixture
def captured(monkeypatch) -> list[Captured]:
    """The ATen graphs our passes see (before) and produce (after), one per compiled graph."""
    graphs: list[Captured] = []
    real = fp8compile.passes.run_passes

    def spy(ctx):
        before = graph_listing(ctx.gm)
        real(ctx)
        graphs.append(Captured(before, ctx.gm))

    monkeypatch.setattr(fp8compile.passes, "run_passes", spy)
    return graphs


@pytest.fixture
def pass_diffs(monkeypatch) -> list[str]:
    """The diff our passes make to each compiled graph, taken right after them (Inductor rewrites
    the graph in place afterwards, or not: a hit in its FX graph cache), for golden files."""
    diffs: list[str] = []
    real = fp8compile.passes.run_passes

    def spy(ctx):
        before = graph_listing(ctx.gm)
        real(ctx)
        diffs.append(graph_diff(before, graph_listing(ctx.gm)) + "\n")

    monkeypatch.setattr(fp8compile.passes, "run_passes", spy)
    return diffs


@pytest.fixture
def weight_quantizations(monkeypatch) -> list:
    """The shape of every weight quantized, in order, with "compiled" appended each time the
    passes finish on a graph: shows whether FP8 weights are made while compiling."""
    from fp8compile import weights

    calls = []
    real = weights._quantize
    monkeypatch.setattr(weights, "_quantize", lambda w, e8m0: calls.append(tuple(w.shape)) or real(w, e8m0))
    passes = fp8compile.passes.run_passes
    monkeypatch.setattr(fp8compile.passes, "run_passes", lambda ctx: passes(ctx) or calls.append("compiled"))
    return calls


@pytest.fixture
def probe_backend(monkeypatch):
    """Registry backends that record (op, M) per call, then run the reference: they show which
    range of the M dispatch ran. "probe" serves M <= 32 only; "mid" serves bounded ranges above
    32 only (a medium-M kernel), recording ("mid:linear", M)."""
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
    monkeypatch.setattr(registry, "DEFAULT_ORDERS", dict(registry.DEFAULT_ORDERS))

    def recording(tag):
        def linear(x, w_fp8, w_scale, bias, e8m0):
            calls.append((tag, x.reshape(-1, x.shape[-1]).shape[0]))
            return registry.implementation("linear", "reference")(x, w_fp8, w_scale, bias, e8m0)

        return linear

    def probe_why_not(request):
        if request.m_max is None or request.m_max > 32:
            return "probe serves M <= 32 only"
        return None

    def mid_why_not(request):
        if request.m_min <= 32 or request.m_max is None:
            return "mid serves bounded ranges above M = 32 only"
        return None

    registry.register(registry.Backend("probe", {"linear": recording("linear")}, probe_why_not), first=True)
    registry.register(registry.Backend("mid", {"linear": recording("mid:linear")}, mid_why_not))
    return calls


class CountingBackend:
    """Wraps an fp8 backend and counts the graphs it compiles for Dynamo (`compiles`) and the calls
    (`calls`): a compile that Dynamo restarts, e.g. for a float it must specialise, is a call and
    not a graph."""

    def __init__(self, **options):
        self.fp8 = fp8compile.backend(**options)
        self.compiles = 0
        self.calls = 0

    def __deepcopy__(self, memo):  # as Fp8Backend: transformers' CompileConfig deep-copies its backend
        return self

    def __call__(self, gm, example_inputs, **kwargs):
        self.calls += 1
        compiled = self.fp8(gm, example_inputs, **kwargs)
        self.compiles += 1
        return compiled

    @property
    def report(self):
        return self.fp8.report


@pytest.fixture
def ranged_references(monkeypatch) -> tuple[str, ...]:
    """Three registry backends that run the reference kernels for linear, gated_linear, moe,
    scaled_linear and gated_scaled_linear, each serving one range of M (with small_m=32,
    large_m=64): configured with these backends, a CPU compile builds the full nested M dispatch
    (two torch.conds per call site) that the GPU's default order builds, so the stride contract
    between each branch and the tensors that reach it is tested on the CPU too. Returns the
    backends option."""
    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
    monkeypatch.setattr(registry, "DEFAULT_ORDERS", dict(registry.DEFAULT_ORDERS))
    return register_ranged_references()


def register_ranged_references() -> tuple[str, ...]:
    """ranged_references' backends, registered for the rest of this process (a test's own
    worker processes)."""
    reference = registry._BACKENDS["reference"]

    def serving(lo, hi):
        def why_not(request):
            if request.m_min < lo or (hi is not None and (request.m_max is None or request.m_max > hi)):
                return f"serves {lo} <= M <= {hi} only"
            return None

        return why_not

    ops = {
        op: reference.ops[op]
        for op in ("linear", "gated_linear", "moe", "scaled_linear", "gated_scaled_linear")
    }
    registry.register(registry.Backend("ref_small", ops, serving(1, 32)))
    registry.register(registry.Backend("ref_medium", ops, serving(33, 64)))
    return ("ref_small", "ref_medium", "reference")


RANGES = dict(small_m=32, large_m=64)  # the ranges ranged_references serves
# bench model's plumbing on the CPU: the tiny Llama cut to one layer (every layer compiles the
# same way; a second doubled each compile), one decode batch of a few steps, and a prefill of the
# accuracy call's 64 tokens: a prefill of another length recompiles every variant at dynamic
# shapes (the two bench_model tests of test_whole_model.py: 128 s, 92 s at 64 tokens, 2026-11-28)
TINY_BENCH = dict(models=["tiny-llama"], layers=1, batches=[2], context=4, steps=2, prefill=64, device="cpu")


@pytest.fixture
def one_rank_group():
    """The default group as one gloo rank, its name (a functional collective over it returns its input)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()
