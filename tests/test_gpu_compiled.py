"""What Inductor's compiled graphs run on the GPU, against the op path and the references: one
graph serving every range of M (autotuned or not), reduce-overhead mode's CUDA graphs (one per
M, the op bodies not rerun on replays, kernel state kept out of the graphs' pool), the sides of
the M dispatch that Inductor launches itself in default mode (decode, cuBLAS, the MoE decode and
Gluon sides), and the inline emission of the dispatch's branches. Kernel against reference,
op by op, is tests/test_gpu.py. Run with `pytest -m gpu` on the device (skipped without CUDA)."""

import pytest
import torch

import fp8compile
from fp8compile import calc_diff, registry
from fp8compile.ops import activations
from fp8compile.ops.linear import reference as linear_reference
from fp8compile.ops.quant import reference as quant_reference
from tests.conftest import BF16, GATED_MLP, gpu, op_body_runs, randn
from tests.models import GatedMLP
from tests.test_gpu import weight

pytestmark = [pytest.mark.gpu, gpu]


def test_autotuned_linear_serves_every_m_in_one_graph_with_kernels_that_serve_their_ranges():
    model = torch.nn.Linear(7168, 4096, bias=False).to(BF16).cuda()
    fp8 = fp8compile.backend(autotune=True)
    compiled = torch.compile(model, backend=fp8)
    with torch.no_grad():
        for m in (2, 128, 1000, 3000):
            x = randn(m, 7168, device="cuda")
            torch._dynamo.mark_dynamic(x, 0)
            assert calc_diff(compiled(x), model(x)) < 1e-3
    (rewrite,) = fp8.report.rewrites
    # Labels read "M <= 8", "8 < M <= 64", ..., "M > 64".
    bounds = [1] + [int(label.rsplit(" ", 1)[1]) + 1 for label, _ in rewrite.kernels[:-1]]
    assert rewrite.kernels[-1][0].startswith("M > ")
    for (label, kernel), lo, hi in zip(rewrite.kernels, bounds, [*bounds[1:], None]):
        request = registry.Request(
            "linear", torch.device("cuda"), 4096, 7168, lo, None if hi is None else hi - 1
        )
        assert registry.why_not(kernel, request) is None, (label, kernel)
    assert fp8.report.graphs == 1


# --- mode="reduce-overhead": Inductor's CUDA graphs across the M dispatch ---------------------
@pytest.mark.parametrize("recipe", ["block", "rowwise"])
def test_a_gated_mlp_at_one_row_is_rewritten_under_torchaos_inductor_config(recipe):
    # torchao's quantize_ turns coordinate_descent_tuning on for the process; Inductor then
    # decomposes every one-row matmul on a GPU while the graph is traced (tests/test_backend.py
    # has the CPU's version of this test). Found as bench mlp's second MLP running bf16 at M = 1.
    from torch._inductor import config as inductor_config

    model = GatedMLP(1024, 2048).to(BF16).cuda()
    fp8 = fp8compile.backend(recipe=recipe)
    x = randn(1, 1024, device="cuda")
    with torch.no_grad(), inductor_config.patch(coordinate_descent_tuning=True):
        assert calc_diff(torch.compile(model, backend=fp8)(x), model(x)) < GATED_MLP
    assert fp8.report.counts()["linear"] == 2 and fp8.report.counts()["silu_mul"] == 1
    assert {kernel for rewrite in fp8.report.rewrites for _, kernel in rewrite.kernels} == {"triton_small_m"}


@pytest.mark.parametrize("model_name", ["linear", "gated_mlp", "qwen3_moe_block"])
def test_reduce_overhead_mode_replays_a_cuda_graph_per_m_with_the_bits_of_the_default_mode(
    model_name, monkeypatch
):
    from torch._dynamo.utils import counters

    from fp8compile.ops.linear import triton_gemm

    # The decode kernel's split-K counters, as in a fresh process: the compiler allocates them,
    # not the CUDA graphs' warm-up run, whose allocations all land in their memory pool.
    monkeypatch.setattr(triton_gemm, "_ARRIVALS", {})
    torch.manual_seed(0)
    if model_name == "qwen3_moe_block":
        from fp8compile.bench.moe import moe_block

        model, shape = moe_block(1024, 256, 16, 4), lambda m: (1, m, 1024)
    else:
        model = torch.nn.Linear(1024, 2048, bias=False) if model_name == "linear" else GatedMLP(1024, 2048)
        model, shape = model.to(BF16).cuda(), lambda m: (m, 1024)
    fp8 = fp8compile.backend()
    graphed = torch.compile(model, backend=fp8, dynamic=True, mode="reduce-overhead")
    # Default mode with the decode kernel behind the op too (not launched by Inductor), so that
    # the op bodies each M's graph runs can be counted.
    plain = torch.compile(model, backend=fp8compile.backend(inductor_launch=False), dynamic=True)
    counters.clear()
    held = None  # an output kept across calls of other Ms, as a caller may (Inductor checks its memory pool)
    with torch.no_grad():
        for m in (16, 300, 3000, 1):  # every range of the dispatch, and M = 1's own graph
            x = randn(*shape(m), device="cuda")
            with op_body_runs() as graphed_runs:
                got = [
                    graphed(x).clone() for _ in range(4)
                ]  # Inductor's: a warm-up run, a recording, replays
                held = graphed(x)
            with op_body_runs() as plain_runs:
                want = plain(x)
            assert all(torch.equal(g, want) for g in got), f"M={m}"
            assert plain_runs and len(graphed_runs) <= 2 * len(plain_runs), (
                f"M={m}: op bodies ran on replays ({len(graphed_runs)} runs for 5 calls)"
            )
    assert counters["inductor"]["cudagraph_skips"] == 0 and held is not None
    assert fp8.report.rewrites and all(
        state.startswith("on:") for state in fp8.report.cuda_graphs.values()
    ), fp8.report.cuda_graphs


def test_masked_moe_backend_serves_decode_under_cuda_graphs_with_the_numbers_of_the_triton_path():
    """backends=("deep_gemm_masked", ...): the decode side of a MoE block's dispatch is DeepGEMM's
    masked grouped GEMM, whose layout reads nothing back to the host, so reduce-overhead mode
    records and replays it; the sides past its token bound fall to the next backend."""
    from torch._dynamo.utils import counters

    from fp8compile.bench.moe import moe_block
    from fp8compile.ops import vendors

    if vendors.import_error("deep_gemm") is not None:
        pytest.skip(vendors.import_error("deep_gemm"))
    torch.manual_seed(0)
    model = moe_block(1024, 256, 16, 4)
    masked = fp8compile.backend(backends=("deep_gemm_masked", "triton", "reference"))
    graphed = torch.compile(model, backend=masked, dynamic=True, mode="reduce-overhead")
    plain = torch.compile(model, backend=fp8compile.backend(backends=("triton", "reference")), dynamic=True)
    counters.clear()
    with torch.no_grad():
        for m in (16, 300, 3, 1):  # a dynamic graph, then M = 1's own
            x = randn(1, m, 1024, device="cuda")
            got = [graphed(x).clone() for _ in range(4)]  # a warm-up run, a recording, replays
            want = plain(x)
            assert torch.equal(got[2], got[3]), f"M={m}: a replay differs from the recording"
            # Two FP8 paths, each within 1e-4 of the reference (test_moe_backend_matches_...), so
            # apart by up to about twice that (1.4e-4 measured at M = 1 on an H100: one flipped
            # FP8 rounding of the activation weighs more in a single token's 1024 outputs).
            assert calc_diff(got[3], want) < 3e-4, f"M={m}"
    assert counters["inductor"]["cudagraph_skips"] == 0
    sites = [r.kernels for r in masked.report.rewrites if r.kind == "moe"]
    assert len(sites) == 2 and all(kernels[0][1] == "deep_gemm_masked" for kernels in sites), sites
    assert any(kernels[-1][1] == "triton" for kernels in sites), sites  # past 256 tokens


def test_reduce_overhead_mode_in_a_fresh_process_keeps_kernel_state_out_of_the_graph_pool():
    # The first call of a kernel library in a process may allocate state it keeps (DeepGEMM's
    # device runtime, our split-K counters). In a fresh process that first call would be the
    # CUDA graphs' warm-up run, whose allocations land in their memory pool, and Inductor then
    # refuses every later warm-up. The backends' prepare hooks allocate it at compile time.
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import torch, fp8compile
        model = torch.nn.Linear(1024, 2048, bias=False).to(torch.bfloat16).cuda()
        graphed = torch.compile(model, backend=fp8compile.backend(), dynamic=True, mode="reduce-overhead")
        with torch.no_grad():
            for m in (16, 300, 3000, 1):
                x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
                for _ in range(4):
                    y = graphed(x)  # held into the next call, as a caller may
        print("ran every M")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "ran every M" in done.stdout, done.stderr[-3000:]


def test_inductor_launches_the_linear_decode_op_from_its_own_wrapper():
    """fp8compile::linear_decode is a triton_op: compiled, Inductor's generated code launches the
    decode kernel itself (no call back into our op) and nothing else (its split-K counters are
    the eager path's, no fill per call), with the same bits as the eager op, for every M of a
    dynamic graph, call after call (each launch leaves the counters as it found them)."""
    from torch._inductor.utils import run_and_get_code

    from fp8compile.ops.linear import decode_op, triton_gemm  # noqa: F401  (registers the op)

    w_fp8, w_scale = quant_reference.quant_weight_block(weight(4096, 4096))

    def two_linears(x):
        h = torch.ops.fp8compile.linear_decode(x, w_fp8, w_scale, max_m=32)
        return torch.ops.fp8compile.linear_decode(h, w_fp8, w_scale, max_m=32)

    assert (
        triton_gemm._small_m_tiles(32, 4096, 4096, False, torch.device("cuda"), None, None)[2] > 1
    )  # split-K
    compiled = torch.compile(two_linears, dynamic=True)
    for i, m in enumerate((1, 7, 32, 7, 1)):
        x = randn(m, 4096, device="cuda")
        # compiled at M = 1 (a static graph) and M = 7 (the dynamic one)
        out, code = run_and_get_code(compiled, x) if i < 2 else (compiled(x), None)
        assert torch.equal(out, two_linears(x))
        if code is not None:
            wrapper = "\n".join(code)
            assert "_linear_small_m_kernel" in wrapper and "fp8compile.linear_decode" not in wrapper
            launches = [line for line in wrapper.splitlines() if ".run(" in line]
            assert len(launches) == 2 and all("_linear_small_m_kernel" in line for line in launches), launches
    # Not test_schema: its mode reruns the op's FP8 inputs through ATen math that has no e4m3 kernels.
    torch.library.opcheck(
        torch.ops.fp8compile.linear_decode,
        (randn(3, 4096, device="cuda"), w_fp8, w_scale, None, False, 16),
        test_utils=("test_faketensor", "test_aot_dispatch_dynamic"),
    )


def test_inductors_kernel_analysis_runs_once_for_launches_of_one_specialization():
    """In a graph of static M every linear's decode launch is Inductor's own, and Inductor asks
    for each which tensors the kernel writes (a TTIR build: 13.8 s of lowering for a 32-layer
    Llama, against bf16's 3.0, H200): four same-shape linears ask once, and the numbers are the
    op path's."""
    from fp8compile import kernel_analysis

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(4096, 4096, bias=False) for _ in range(4))).to(BF16).cuda()
    x = randn(1, 4096, device="cuda")
    torch._dynamo.reset()
    with torch.no_grad():
        want = torch.compile(model, backend=fp8compile.backend(inductor_launch=False))(x)
        torch._dynamo.reset()
        before = dict(kernel_analysis.stats)
        out = torch.compile(model, backend=fp8compile.backend(inductor_launch=True))(x)
    asked, answered = (kernel_analysis.stats[key] - before[key] for key in ("asked", "answered"))
    assert asked >= 4 and answered >= 3, (asked, answered)
    assert torch.equal(out, want)


def _launched_and_op_path(model, xs):
    """(x, out, out of the op path) per x: model compiled with dynamic M in default mode (the
    traced launches) and with inductor_launch=False (our ops)."""
    torch._dynamo.reset()
    op_path = torch.compile(model, backend=fp8compile.backend(inductor_launch=False), dynamic=True)
    expected = [op_path(x) for x in xs]
    torch._dynamo.reset()
    launched = torch.compile(model, backend=fp8compile.backend(), dynamic=True)
    return [(x, launched(x), want) for x, want in zip(xs, expected)]


def test_default_mode_cublas_side_is_launched_by_inductor_with_the_bits_of_the_op():
    """Outside CUDA graphs the cuBLAS side of every (gated) linear is traced too
    (ops/linear/scaled_mm_op.py): a static M = 300 graph calls no fp8compile op, only our quantization
    kernel and aten._scaled_mm, and a dynamic graph gives the op path's bits through the medium
    range of M, M not a multiple of 4 included (padded rows)."""
    from torch._inductor.utils import run_and_get_code

    from fp8compile.ops.linear import scaled_mm_op  # noqa: F401  (registers the op)

    model = GatedMLP(512, 1024).to(BF16).cuda()
    with torch.no_grad():
        out, code = run_and_get_code(
            torch.compile(model, backend=fp8compile.backend()), randn(300, 512, device="cuda")
        )
        wrapper = "\n".join(code)
        assert (
            "_quant_act_kernel" in wrapper
            and "_scaled_mm" in wrapper
            and "torch.ops.fp8compile" not in wrapper
        )
        xs = [randn(m, 512, device="cuda") for m in (33, 66, 300, 1001)]
        for x, got, want in _launched_and_op_path(model, xs):
            assert torch.equal(got, want), x.shape  # the same quantization kernel and the same cuBLAS call
            assert calc_diff(got, model(x)) < GATED_MLP
    w_fp8, w_scale = quant_reference.quant_weight_block(weight(256, 512))
    torch.library.opcheck(
        torch.ops.fp8compile.linear_scaled_mm,
        (randn(13, 512, device="cuda"), w_fp8, w_scale),
        test_utils=("test_faketensor", "test_aot_dispatch_dynamic"),
    )


@pytest.mark.parametrize("gated", [False, True], ids=["linear", "gated"])
@pytest.mark.parametrize("m", [8, 33, 300])
def test_linear_scaled_mm_op_is_the_reference_block_linear(m, gated):
    """fp8compile::linear_scaled_mm called as an op (its eager body: our quantization kernel
    writing the padding rows, then cuBLAS) against the pure-PyTorch definition, M not a multiple
    of 4 included, with and without the gated MLP's second operand b and a bias."""
    from fp8compile.ops.linear import scaled_mm_op  # noqa: F401  (registers the op)

    w = weight(384, 512)
    w_fp8, w_scale = quant_reference.quant_weight_block(w)
    x, b = randn(m, 512, device="cuda"), randn(m, 512, device="cuda") if gated else None
    bias = randn(384, device="cuda")
    got = torch.ops.fp8compile.linear_scaled_mm(x, w_fp8, w_scale, bias, False, b)
    want = (
        linear_reference.gated_linear_block(x, b, w_fp8, w_scale, bias)
        if gated
        else linear_reference.linear_block(x, w_fp8, w_scale, bias)
    )
    assert got.shape == (m, 384) and got.dtype == BF16
    # The same quantized operands; cuBLAS accumulates in fp32 where the reference sums in fp64.
    assert calc_diff(got, want) < 1e-5
    assert (
        calc_diff(got, (activations.gated(x, b) if gated else x.float()) @ w.float().t() + bias.float())
        < 1e-3
    )


def test_default_mode_decode_side_is_launched_by_inductor_with_the_numbers_of_the_op():
    """Outside CUDA graphs the decode kernel's side of every (gated) linear is the traced launch
    (passes/inline.py): a static M = 1 graph calls no fp8compile op at all, and a dynamic graph
    gives the numbers of the op path (inductor_launch=False) at every M of the decode range and
    above it."""
    from torch._inductor.utils import run_and_get_code

    model = GatedMLP(512, 1024).to(BF16).cuda()
    x1 = randn(1, 512, device="cuda")
    with torch.no_grad():
        out, code = run_and_get_code(torch.compile(model, backend=fp8compile.backend()), x1)
        wrapper = "\n".join(code)
        assert wrapper.count("_linear_small_m_kernel") >= 2 and "torch.ops.fp8compile" not in wrapper
        xs = [randn(m, 512, device="cuda") for m in (1, 5, 16, 32, 33, 300)]
        for x, got, want in _launched_and_op_path(model, xs):
            assert calc_diff(got, want) < 1e-5, x.shape  # the same kernel; tiles may split K another way
            assert calc_diff(got, model(x)) < GATED_MLP


def _moe_block(block: str):
    """An MoE block of 8 experts, top-2, hidden 256, on the GPU: transformers' Qwen3-MoE block,
    GPT-OSS's MLP (biases, interleaved gate/up rows), gpt-fast's (separate gate and up weights)
    or Nemotron-H's (non-gated relu(up)^2 experts)."""
    from tests.models import GptFastMoE
    from tests.test_moe import gpt_oss_mlp, nemotron_h_moe, qwen3_moe_block

    return {
        "qwen3_moe": lambda: qwen3_moe_block("grouped_mm"),
        "gpt_oss": lambda: gpt_oss_mlp("grouped_mm"),
        "gpt_fast": lambda: GptFastMoE().to(BF16),
        "nemotron_h": lambda: nemotron_h_moe("grouped_mm"),
    }[block]().cuda()


def _first(y):
    return y[0] if isinstance(y, tuple) else y  # GptOssMLP also returns router scores


def _subgraph(code: list[str], suffix: str) -> str:
    """The code of the one cond branch in Inductor's generated code whose name ends in suffix:
    its function (Inductor's emission) or, with Fp8Config(inline_conds=True), its block from the
    `# subgraph:` line to the end of its indentation."""
    import re

    text = "\n".join(code)
    bodies = [
        body for _, body in re.findall(rf"^def (\w+{suffix})\(args\):\n(.*?)(?=^\S)", text, re.M | re.S)
    ]
    if not bodies:
        bodies = [
            body for _, _, body in re.findall(rf"^( +)# subgraph: (\w+{suffix})\n((?:\1.*\n)*)", text, re.M)
        ]
    assert len(bodies) == 1, len(bodies)
    return bodies[0]


@pytest.mark.parametrize("model_name", ["gated_mlp", "qwen3_moe", "gpt_oss", "gpt_fast", "nemotron_h"])
def test_inline_conds_give_the_bits_of_inductors_branch_functions(model_name):
    """Fp8Config(inline_conds=True) (size_conds.inline_branches) changes only how Inductor's
    wrapper calls the M dispatch's branches: a dynamic-M graph in default mode, run through every
    range of M (the decode launch, cuBLAS or the MoE op, the Gluon or DeepGEMM side), gives the
    bits of the same graph with a function per branch, and its code has no branch function."""
    import re

    from torch._inductor.utils import run_and_get_code

    if model_name == "gated_mlp":
        model = GatedMLP(512, 1024).to(BF16).cuda()
        xs = [randn(m, 512, device="cuda") for m in (3, 16, 32, 33, 300, 2049)]
    else:
        model = _moe_block(model_name)
        xs = [randn(1, m, 256, device="cuda") for m in (3, 16, 32, 33, 127, 128, 300, 1000)]
    outs = {}
    with torch.no_grad():
        for inline in (False, True):
            torch._dynamo.reset()
            compiled = torch.compile(model, backend=fp8compile.backend(inline_conds=inline), dynamic=True)
            first, code = run_and_get_code(compiled, xs[0])
            functions = re.findall(r"^def (\w+)\(args\):", "\n".join(code), re.M)
            assert bool(functions) != inline, functions
            outs[inline] = [first] + [compiled(x) for x in xs[1:]]
    for x, got, want in zip(xs, outs[True], outs[False]):
        assert torch.equal(_first(got), _first(want)), x.shape


def _default_mode_code(model, tokens: int) -> str:
    """Inductor's generated code for model compiled in default mode on `tokens` tokens (static),
    its one MoE block rewritten."""
    from torch._inductor.utils import run_and_get_code

    backend = fp8compile.backend()
    _, code = run_and_get_code(torch.compile(model, backend=backend), randn(1, tokens, 256, device="cuda"))
    assert backend.report.counts().get("moe") == 1, backend.report
    return "\n".join(code)


@pytest.mark.parametrize("block", ["qwen3_moe", "gpt_oss", "gpt_fast", "nemotron_h"])
def test_default_mode_moe_decode_side_is_launched_by_inductor_with_the_bits_of_the_op(block):
    """Outside CUDA graphs the routed experts' decode side is fp8compile::moe_decode traced
    (passes/inline.py): a static two-token graph calls no fp8compile op, only our routing,
    quantization, grouped GEMM and top-k sum kernels; a dynamic graph gives the op path's bits
    (the same kernels with the same choices) through the decode range and the op's above it.
    GPT-OSS: biases and interleaved gate/up rows (its FP8 rows reordered); gpt-fast: separate
    gate and up weights; Nemotron-H: non-gated experts (the up projection alone, relu^2)."""
    from fp8compile.ops.moe import decode_op as moe_decode_op

    model = _moe_block(block)
    with torch.no_grad():
        wrapper = _default_mode_code(model, 2)
        assert "_route_kernel" in wrapper and "_moe_gemm_kernel" in wrapper and "_topk_sum_kernel" in wrapper
        assert "torch.ops.fp8compile" not in wrapper
        xs = [randn(1, m, 256, device="cuda") for m in (3, 5, 16, 32, 33, 300)]
        for x, got, want in _launched_and_op_path(model, xs):
            assert torch.equal(_first(got), _first(want)), x.shape
        # A graph of dynamic M (a second batch size) has the decode range as its own side, the
        # launch: not the op behind the dispatcher (moe_decode_cut).
        from torch._inductor.utils import run_and_get_code

        torch._dynamo.reset()
        compiled = torch.compile(model, backend=fp8compile.backend(), dynamic=True)
        _, code = run_and_get_code(compiled, randn(1, 5, 256, device="cuda"))
        # (Nemotron-H's shared expert is two linears, each with its own M dispatch)
        decode_side = _subgraph(code, "experts_m_le_32" if block == "nemotron_h" else "_m_le_32")
        assert "_moe_gemm_kernel" in decode_side and "torch.ops.fp8compile" not in decode_side
    from tests.test_moe_kernels import quant_experts

    args = (
        randn(3, 256, device="cuda"),
        torch.randint(0, 8, (3, 2), device="cuda"),
        torch.rand(3, 2, device="cuda"),
        *quant_experts(weight(8 * 512, 256).view(8, 512, 256)),
        *quant_experts(weight(8 * 256, 256).view(8, 256, 256)),
    )
    assert moe_decode_op.decode_fits(8, 2, 16)
    torch.library.opcheck(
        torch.ops.fp8compile.moe_decode,
        (*args, None, None, False, 16),
        test_utils=("test_faketensor", "test_aot_dispatch_dynamic"),
    )


@pytest.mark.parametrize("block", ["qwen3_moe", "gpt_oss", "gpt_fast", "nemotron_h"])
def test_default_mode_moe_gluon_side_is_launched_by_inductor_with_the_numbers_of_the_op(block):
    """Outside CUDA graphs the routed experts from the Gluon GEMMs' first token count up are
    fp8compile::moe_gluon traced (passes/inline.py): a static 300-token graph calls no
    fp8compile::moe, only our routing, quantization and top-k sum kernels and the two Gluon
    GEMM calls; a dynamic graph (its triton side cut at that count) gives the op path's numbers
    below it, at it and above it. Eight experts, top-2: the Gluon path starts at 128 tokens.
    Within one bf16 ulp in a few rows, not bit for bit: the bf16 router, which both graphs keep,
    is fused differently by Inductor around the traced launches (at 300 tokens one row of 300
    differed by one ulp on an H100); on the same routing the op is the op path's to the bit
    (test_moe_gluon_op_gives_the_bits_of_the_op_path)."""
    from fp8compile.ops.linear import gluon_gemm
    from fp8compile.ops.moe import gluon_op as moe_gluon_op

    if gluon_gemm.why_not_shape(256, 512, torch.device("cuda")) is not None:
        pytest.skip(gluon_gemm.why_not_shape(256, 512, torch.device("cuda")))
    model = _moe_block(block)
    assert moe_gluon_op.min_tokens(8, 2) == 128
    with torch.no_grad():
        wrapper = _default_mode_code(model, 300)
        for kernel in (
            "_route_count_kernel",
            "_gather_quant_kernel",
            "_quant_act_kernel",
            "_topk_sum_kernel",
            "fp8compile.gluon_grouped_gemm",
        ):
            assert kernel in wrapper, kernel
        assert "fp8compile.moe." not in wrapper
        xs = [randn(1, m, 256, device="cuda") for m in (100, 127, 128, 300, 1000)]
        for x, got, want in _launched_and_op_path(model, xs):
            assert calc_diff(_first(got), _first(want)) < 1e-6, x.shape
