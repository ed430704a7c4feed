"""Our Triton kernels against their pure-PyTorch twins: on the GPU at real sizes, on the CPU in
Triton's interpreter at small sizes (with interpreter-safe inputs, see fp8_exact_activation)."""

import pytest
import torch

pytest.importorskip("triton")

from fp8compile import calc_diff  # noqa: E402
from fp8compile.ops import activations  # noqa: E402
from fp8compile.ops.linear import reference as linear_reference  # noqa: E402
from fp8compile.ops.quant import reference as quant_reference  # noqa: E402
from fp8compile.ops.linear import triton_gemm  # noqa: E402
from fp8compile.ops.quant import triton_quant  # noqa: E402
from tests.conftest import DEVICE, fp8_exact_activation, randn  # noqa: E402

ON_GPU = DEVICE == "cuda"


def activation(m, k):
    return randn(m, k, device=DEVICE) if ON_GPU else fp8_exact_activation(m, k)


def to_bf16_as_the_device_does(ref: torch.Tensor) -> torch.Tensor:
    """Round the fp64 reference to bf16 the way the kernel's store does: round-to-nearest-even
    on the GPU; truncation in Triton 3.9's CPU interpreter (it converts fp32 -> bf16 by
    dropping the low 16 bits; tests/test_triton_kernels.py::test_interpreter_rounding pins it)."""
    if ON_GPU:
        return ref.to(torch.bfloat16)
    return (ref.float().view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)


def reference_linear(x, w_fp8, w_scale, bias, e8m0=False):
    x_fp8, x_scale = quant_reference.quant_act_block(x, e8m0)
    return reference_gemm(x_fp8, x_scale, w_fp8, w_scale, bias)


def reference_gemm(x_fp8, x_scale, w_fp8, w_scale, bias):
    exact = linear_reference.gemm_block(x_fp8, x_scale, w_fp8, w_scale, None, torch.float64)
    return to_bf16_as_the_device_does(exact + bias.double() if bias is not None else exact)


def assert_bf16_close(out, ref):
    """The same function up to accumulation order and the final bf16 rounding.

    The kernels accumulate in fp32 (on the GPU through FP8 tensor cores, whose accumulators
    keep fewer bits than fp32: ~14 per DeepSeek-V3's report), the reference sums exactly in
    fp64. So a few outputs near zero move by more than one bf16 ulp, while the whole stays
    within calc_diff 1.5e-7 (measured on an H200 by 9d201bf:scripts/gpu_diag.py, M 1..64, split-K 1/2,
    E8M0 on/off). A wrong scale, layout or group lands at 1e-3 or worse."""
    assert out.dtype == ref.dtype == torch.bfloat16 and out.shape == ref.shape
    assert calc_diff(out, ref) < 1e-6
    assert (out.float() - ref.float()).abs().max() <= 2**-6 * ref.float().abs().max()


@pytest.mark.parametrize("m", [1, 7, 33, 130])
@pytest.mark.parametrize("layout", ["row", "mn_major", "col"])
@pytest.mark.parametrize("e8m0", [False, True])
def test_quant_act_is_bit_exact_with_the_reference(m, layout, e8m0):
    x = activation(m, 384)
    x_fp8, scale = triton_quant.quant_act(x, e8m0, layout)
    ref_fp8, ref_scale = quant_reference.quant_act_block(x, e8m0)
    assert torch.equal(x_fp8.view(torch.uint8), ref_fp8.view(torch.uint8))
    assert torch.equal(scale, ref_scale)
    if layout == "mn_major":  # column-major, columns padded to 16 bytes, as DeepGEMM reads it
        assert scale.stride() == (1, (m + 3) // 4 * 4)
    if layout == "col":  # column-major, unpadded, as torch._scaled_mm wants it
        assert scale.stride() == (1, m)


@pytest.mark.parametrize("m", [1, 5, 8])
def test_quant_act_pads_rows_to_a_multiple_with_quantized_zeros_in_column_major_scales(m):
    # cuBLAS's block scaling wants each scale column 16-byte aligned: the kernel writes the rows
    # past M as quantized zeros (what a zero-padded copy of x would give) instead of a padded copy.
    from fp8compile.numerics import AMAX_EPS, FP8_MAX

    x = activation(m, 256)
    x_fp8, scale = triton_quant.quant_act(x, False, "col", rows_multiple=4)
    padded = (m + 3) // 4 * 4
    ref_fp8, ref_scale = quant_reference.quant_act_block(torch.nn.functional.pad(x, (0, 0, 0, padded - m)))
    assert x_fp8.shape == (padded, 256) and scale.stride() == (1, padded)
    assert torch.equal(x_fp8.view(torch.uint8), ref_fp8.view(torch.uint8)) and torch.equal(scale, ref_scale)
    assert not x_fp8[m:].view(torch.uint8).any() and torch.all(scale[m:] == AMAX_EPS / FP8_MAX)


@pytest.mark.parametrize("rows, num_warps", [(16, 4), (32, 8), (64, 4)])  # bench tune's QUANT_SWEEP
def test_the_quantization_tuned_by_rows_per_program_keeps_the_references_bits(rows, num_warps):
    """`bench tune --kernels quant` times the kernel at other rows per program; each must quantize
    as the reference does, also where the last program's rows run past M (70 rows)."""
    from fp8compile.bench.tune import QUANT_SWEEP, quant_launch

    assert (rows, num_warps) in QUANT_SWEEP
    x = activation(70, 384)
    launch, (x_fp8, scale) = quant_launch(x, None, rows, num_warps)
    launch()
    ref_fp8, ref_scale = quant_reference.quant_act_block(x)
    assert torch.equal(x_fp8.view(torch.uint8), ref_fp8.view(torch.uint8)) and torch.equal(scale, ref_scale)
    assert scale.stride() == (1, 70)  # the cuBLAS side's column-major scales


def test_the_depth_sweep_times_each_decode_tiling_that_gives_the_defaults_output(tmp_path, monkeypatch):
    """`bench tune --kernels small_m_depth` runs each candidate tiling (rows a program, programs an
    SM, stages) plain and gated at M = 1 and 16, times the ones whose output is the default's, and
    keeps a tiling the compiler refuses as a row without a time."""
    import json

    from fp8compile.bench import tune_depth

    run = triton_gemm.linear_small_m

    def refuses_16_rows(*args, block_n=None, **kwargs):
        if block_n == 16:
            raise RuntimeError("out of resource: shared memory")
        return run(*args, block_n=block_n, **kwargs)

    monkeypatch.setattr(triton_gemm, "linear_small_m", refuses_16_rows)
    timed = []
    candidates = ((64, 1, 3), (32, 2, 4), (16, 1, 3))
    rows = tune_depth.sweep(
        tmp_path,
        [(128, 256)],
        [(64, 256)],
        plain=candidates,
        gated_sweep=candidates,
        device=torch.device(DEVICE),
        time_us=lambda fns: timed.append(len(fns)) or 7.0,
    )
    assert [(r["gated"], r["m"], r["block_n"]) for r in rows] == [
        (gated, m, block_n) for gated in (False, True) for m in (1, 16) for block_n in (64, 32, 16)
    ]
    works = [r for r in rows if r["block_n"] != 16]
    assert all(r["calc_diff"] < tune_depth.DIFF_BOUND and r["us"] == 7.0 for r in works)
    assert all(r["calc_diff"] is None and r["us"] is None for r in rows if r["block_n"] == 16)
    assert len(timed) == len(works) + (2 if ON_GPU else 0)  # and the plain read of each weight, on a GPU
    assert json.loads((tmp_path / "tune_depth.json").read_text()) == rows


LARGE_M_LOADS = {
    "pointer_loads": dict(tma=False),
    "tma_loads": dict(tma=True),
    "persistent_tma": dict(tma=True, persistent=2),  # 2 programs walk every tile
}


@pytest.mark.parametrize("m, n", [(1, 128), (20, 200), (70, 384)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("loads", LARGE_M_LOADS)
def test_large_m_gemm_matches_the_reference(m, n, bias, loads):
    """N = 200: TMA must fill the rows past N with zeros, M = 20 and 70 the rows past M."""
    x_fp8, x_scale = quant_reference.quant_act_block(activation(m, 256))
    w_fp8, w_scale = quant_reference.quant_weight_block(randn(n, 256, scale=0.02, device=DEVICE))
    b = randn(n, device=DEVICE) if bias else None
    tile = triton_gemm.INTERPRETER_CONFIG if DEVICE == "cpu" else triton_gemm.LARGE_M_CONFIG
    config = {**tile, **LARGE_M_LOADS[loads]}
    out = triton_gemm.gemm_large_m(x_fp8, x_scale, w_fp8, w_scale, b, config=config)
    assert_bf16_close(out, reference_gemm(x_fp8, x_scale, w_fp8, w_scale, b))


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_tma_loads_only_while_capturing_a_cuda_graph_with_the_same_bits_as_eager_pointer_loads(monkeypatch):
    """Outside a graph Triton encodes the TMA descriptor on every launch (host time a decode step
    waits on); inside one, once. Either way the kernels compute the same bits."""
    monkeypatch.setattr(triton_gemm, "USE_GLUON", False)  # this file's kernel above 512 rows too
    x, b = randn(3, 256, device=DEVICE), randn(3, 256, device=DEVICE)
    x_fp8, x_scale = triton_quant.quant_act(
        randn(600, 256, device=DEVICE)
    )  # past TILE_SWITCH_M: 128-row tiles
    w_fp8, w_scale = quant_reference.quant_weight_block(randn(384, 256, scale=0.02, device=DEVICE))

    def kernels():
        return (
            triton_gemm.linear_small_m(x, w_fp8, w_scale),
            triton_gemm.gated_linear_small_m(x, b, w_fp8, w_scale),
            triton_gemm.gemm_large_m(x_fp8[:3], x_scale[:3], w_fp8, w_scale),
            triton_gemm.gemm_large_m(x_fp8, x_scale, w_fp8, w_scale),
        )

    assert not triton_gemm.tma_pays_off(x.device)
    eager = kernels()
    torch.cuda.synchronize()
    graph, seen = torch.cuda.CUDAGraph(), []
    with torch.cuda.graph(graph):
        seen.append(triton_gemm.tma_pays_off(x.device))
        replayed = kernels()
    graph.replay()
    torch.cuda.synchronize()
    assert seen == [True]
    for a, b in zip(eager, replayed):
        assert torch.equal(a, b)


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_large_m_gemm_rows_keep_their_bits_across_the_tile_switch(monkeypatch):
    """64-row tiles up to TILE_SWITCH_M, 128-row tiles above: a row's result must not move
    (batch invariance), so both tilings must run the same instruction sequence per element.
    (The switch to the Gluon kernel: tests/test_gluon_gemm.py.)"""
    monkeypatch.setattr(triton_gemm, "USE_GLUON", False)
    m = triton_gemm.TILE_SWITCH_M
    x_fp8, x_scale = triton_quant.quant_act(randn(m + 1, 1024, device=DEVICE))
    w_fp8, w_scale = quant_reference.quant_weight_block(randn(640, 1024, scale=0.02, device=DEVICE))
    below = triton_gemm.gemm_large_m(x_fp8[:m], x_scale[:m], w_fp8, w_scale)
    above = triton_gemm.gemm_large_m(x_fp8, x_scale, w_fp8, w_scale)
    assert torch.equal(below, above[:m])


def test_large_m_gemm_refuses_a_tile_that_spans_two_weight_scale_blocks():
    x_fp8, x_scale = quant_reference.quant_act_block(activation(4, 256))
    w_fp8, w_scale = quant_reference.quant_weight_block(randn(256, 256, scale=0.02, device=DEVICE))
    with pytest.raises(ValueError, match="must divide the 128-row weight scale block"):
        triton_gemm.gemm_large_m(
            x_fp8, x_scale, w_fp8, w_scale, config=dict(BLOCK_M=16, BLOCK_N=256, GROUP_M=1)
        )


@pytest.mark.parametrize("m", [1, 5, 16, 17, 33, 64])
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("e8m0", [False, True])
@pytest.mark.parametrize("tma", [True, False], ids=["tma_loads", "pointer_loads"])
def test_small_m_kernel_with_fused_quantization_matches_the_reference(m, split_k, e8m0, tma):
    """N = 200 is not a multiple of the weight tile: TMA must fill the rows past N with zeros."""
    x = activation(m, 256)
    w_fp8, w_scale = quant_reference.quant_weight_block(randn(200, 256, scale=0.02, device=DEVICE), e8m0)
    b = randn(200, device=DEVICE)
    out = triton_gemm.linear_small_m(x, w_fp8, w_scale, b, e8m0, split_k=split_k, tma=tma)
    assert_bf16_close(out, reference_linear(x, w_fp8, w_scale, b, e8m0))


@pytest.mark.parametrize("block_n", [32, 128, 256])
@pytest.mark.parametrize("n", [100, 200, 384])
def test_small_m_kernel_scales_each_row_of_a_tile_by_its_own_weight_scale_block(block_n, n):
    """A tile of 32 or 128 rows lies inside one 128-row weight-scale block, one of 256 spans two
    (the second partial, or past N, where N = 100 or 200 ends inside the tile). The scales differ
    block by block and group by group; split-K into two."""
    x = activation(17, 256)
    w_fp8, w_scale = quant_reference.quant_weight_block(randn(n, 256, scale=0.02, device=DEVICE))
    w_scale = w_scale * torch.arange(1, w_scale.numel() + 1, device=DEVICE).view_as(w_scale)
    out = triton_gemm.linear_small_m(x, w_fp8, w_scale, block_n=block_n, split_k=2)
    assert_bf16_close(out, reference_linear(x, w_fp8, w_scale, None))


def test_the_decode_kernels_shared_memory_bound_covers_what_triton_compiles_for_sm_89_and_sm_90():
    # Pointer loads (TMA off), as the traced ops launch the kernels; the bound less its 8 KiB of
    # room is what Triton 3.7.1 asks at the block-scaled kernel's tiles, and the gated 32- and
    # 64-row tiles' three stages do not fit an Ada GPU's 101376 bytes.
    from tests import sm_compile

    pytest.importorskip("triton.backends.nvidia")
    tiles = [
        (16, 128, False, 3),
        (64, 128, False, 3),
        (32, 256, True, 3),
        (64, 256, True, 3),
        (64, 256, True, 2),
    ]
    pointers = dict(
        x_ptr="*bf16",
        x_desc="*bf16",
        b_ptr="*bf16",
        w_ptr="*fp8e4nv",
        w_desc="*fp8e4nv",
        w_s_ptr="*fp32",
        bias_ptr="*fp32",
        out_ptr="*bf16",
        partial_ptr="*fp32",
        arrivals_hi="*i32",
        arrivals_lo="*i32",
        eps="fp32",
        fp8_max="fp32",
        alpha="fp32",
        limit="fp32",
    )

    def launch(block_m, block_n, gated, stages, major):
        constexprs = dict(
            E8M0=False,
            ACT=int(gated),
            HAS_BIAS=False,
            TMA=False,
            ACT_TMA=False,
            PDL=False,
            TRIGGER=False,
            PREFETCH=1,
            SPLIT_K=2,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            GROUP=128,
        )
        return dict(
            kernel="fp8compile.ops.linear.triton_gemm:_linear_small_m_kernel",
            capability={8: 89, 9: 90}[major],
            pointers=pointers,
            constexprs=constexprs,
            ones=["stride_xk", "stride_bk"],
            num_warps=4,
            num_stages=stages,
        )

    def scaled_launch(block_m, block_n, gated, stages, major):
        """The rowwise and per-tensor decode kernel (triton_scaled.py), which small_m_stages also
        fits: 128 weight rows a program, gated or not."""
        scaled_pointers = dict(pointers, x_s_ptr="*fp32", amax_ub="fp32")
        for unused in ("x_desc", "w_desc"):
            scaled_pointers.pop(unused)
        constexprs = dict(
            ACT=int(gated),
            W_ROWWISE=True,
            X_QUANTIZED=False,
            ACT_SCALE=1,
            CAP=False,
            E8M0=False,
            HAS_BIAS=False,
            EVEN_K=True,
            SPLIT_K=2,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=128,
        )
        return dict(
            launch(block_m, block_n, gated, stages, major),
            kernel="fp8compile.ops.linear.triton_scaled:_scaled_small_m_kernel",
            pointers=scaled_pointers,
            constexprs=constexprs,
        )

    cases = [(*tile, major) for major in (8, 9) for tile in tiles]
    scaled = [
        (block_m, 128, gated, 3, major) for major in (8, 9) for block_m, gated in ((16, False), (64, True))
    ]
    launches = [launch(*case) for case in cases] + [scaled_launch(*case) for case in scaled]
    got = sm_compile.shared_bytes(launches)
    bounds = [triton_gemm.small_m_shared_bytes(*case) for case in cases + scaled]
    assert all(g <= b for g, b in zip(got, bounds)), list(zip(cases + scaled, got, bounds))
    ada = 101376
    assert [g > ada for g in got[:5]] == [False, False, True, True, False]
    assert got[len(cases) + 1] > ada  # the scaled kernel, gated, 64 rows, sm_89


@pytest.fixture
def stages_forgotten():
    """small_m_stages's cache emptied before and after: its answers for a pretended GPU must not
    reach the tests that run on a real one."""
    triton_gemm.small_m_stages.cache_clear()
    yield
    triton_gemm.small_m_stages.cache_clear()


def test_the_decode_kernel_drops_stages_on_a_gpu_whose_shared_memory_cannot_hold_three(
    monkeypatch, stages_forgotten
):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(triton_gemm, "capability", lambda index: (8, 9))
    monkeypatch.setattr(triton_gemm, "shared_memory", lambda index: 101376)  # an Ada GPU
    assert triton_gemm.small_m_stages(16, 128, False, cuda) == 3
    assert triton_gemm.small_m_stages(64, 256, True, cuda) == 2
    triton_gemm.small_m_stages.cache_clear()
    monkeypatch.setattr(triton_gemm, "capability", lambda index: (9, 0))
    monkeypatch.setattr(triton_gemm, "shared_memory", lambda index: 232448)  # an H100 or H200
    assert all(
        triton_gemm.small_m_stages(block_m, block_n, gated, cuda) == triton_gemm.SMALL_M_NUM_STAGES
        for block_m in (16, 32, 64)
        for block_n, gated in ((128, False), (256, True))
    )


@pytest.mark.parametrize("m, max_m", [(1, 16), (5, 16), (17, 32), (64, 64)])
@pytest.mark.parametrize("e8m0", [False, True])
def test_linear_decode_op_is_the_decode_kernel_on_prequantized_weights(m, max_m, e8m0):
    """fp8compile::linear_decode (the op Inductor launches itself) against the reference; its
    tile height comes from max_m, the top of the M range a call site serves."""
    from fp8compile.ops.linear import decode_op  # noqa: F401  (registers the op)

    x = activation(m, 256)
    w_fp8, w_scale = quant_reference.quant_weight_block(randn(200, 256, scale=0.02, device=DEVICE), e8m0)
    b = randn(200, device=DEVICE)
    out = torch.ops.fp8compile.linear_decode(x, w_fp8, w_scale, b, e8m0, max_m)
    assert_bf16_close(out, reference_linear(x, w_fp8, w_scale, b, e8m0))


@pytest.mark.parametrize("activation_name", activations.GATED_ACTIVATIONS)
def test_linear_decode_op_with_b_is_the_gated_down_projection(activation_name):
    from fp8compile.ops.linear import decode_op  # noqa: F401  (registers the op)

    # The same kernel as the eager gated decode path, at the tiles of the same M: the same bits.
    a, b, _ = gated_inputs(16, 256)
    w_fp8, w_scale = quant_reference.quant_weight_block(randn(384, 256, scale=0.02, device=DEVICE))
    out = torch.ops.fp8compile.linear_decode(a, w_fp8, w_scale, None, False, 16, b, activation_name)
    assert torch.equal(
        out, triton_gemm.gated_linear_small_m(a, b, w_fp8, w_scale, activation=activation_name)
    )


def test_linear_decode_op_refuses_more_rows_than_the_decode_kernel_serves():
    from fp8compile.ops.linear import decode_op  # noqa: F401  (registers the op)

    x = activation(20, 256)
    w_fp8, w_scale = quant_reference.quant_weight_block(randn(128, 256, scale=0.02, device=DEVICE))
    with pytest.raises(ValueError, match="M <= 64"):
        torch.ops.fp8compile.linear_decode(x, w_fp8, w_scale, max_m=65)
    with pytest.raises(ValueError, match="built for M <= 16"):
        torch.ops.fp8compile.linear_decode(x, w_fp8, w_scale, max_m=16)


def test_small_m_kernel_uses_tma_only_where_a_descriptor_can_address_the_weight():
    w = torch.zeros(256, 256, dtype=torch.uint8, device=DEVICE)
    assert triton_gemm.use_tma(w)
    assert not triton_gemm.use_tma(w.t())  # column-major
    assert not triton_gemm.use_tma(w[:, 8:])  # base not 16-byte aligned
    rows_of_200 = torch.zeros(256, 200, dtype=torch.uint8, device=DEVICE)
    assert not triton_gemm.use_tma(rows_of_200[:, :128])  # row stride 200 bytes


@pytest.mark.skipif(ON_GPU, reason="pins a CPU-interpreter artifact")
def test_interpreter_rounding():
    """Triton 3.9's interpreter rounds fp32 -> bf16 by truncation; if it starts rounding to
    nearest, to_bf16_as_the_device_does must follow."""
    import triton
    import triton.language as tl

    @triton.jit
    def store_bf16(x_ptr, y_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs).to(tl.bfloat16))

    x = torch.randn(1024)
    y = torch.empty(1024, dtype=torch.bfloat16)
    store_bf16[(1,)](x, y, BLOCK=1024)
    assert torch.equal(y, to_bf16_as_the_device_does(x.double()))
    assert not torch.equal(y, x.to(torch.bfloat16))


def test_split_k_reduction_is_deterministic_and_leaves_its_counters_at_zero():
    x = activation(9, 512)
    w_fp8, w_scale = quant_reference.quant_weight_block(randn(256, 512, scale=0.02, device=DEVICE))
    runs = [triton_gemm.linear_small_m(x, w_fp8, w_scale, split_k=4) for _ in range(3)]
    assert all(torch.equal(r, runs[0]) for r in runs)
    assert_bf16_close(runs[0], reference_linear(x, w_fp8, w_scale, None))
    assert int(triton_gemm._ARRIVALS[x.device][-1].abs().sum()) == 0


@pytest.mark.parametrize("m", [1, 17])
def test_split_k_with_a_short_and_an_empty_split_matches_the_reference(m):
    """Split-K 3 over 4 groups: splits of 2, 2 and 0 groups; the empty one publishes zeros.
    A lost or garbage split lands at calc_diff 1e-1 or worse. The bound is looser than
    assert_bf16_close's: with one row of 200 outputs, a single bf16 rounding flip (the tensor
    cores' short FP8 accumulators against an exact fp64 sum) weighs 1e-6 (measured 1.4e-6)."""
    x = activation(m, 512)
    w_fp8, w_scale = quant_reference.quant_weight_block(randn(200, 512, scale=0.02, device=DEVICE))
    out = triton_gemm.linear_small_m(x, w_fp8, w_scale, split_k=3)
    assert calc_diff(out, reference_linear(x, w_fp8, w_scale, None)) < 1e-5


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 16, 32])
def test_dependent_launches_see_their_predecessors_output(m, monkeypatch):
    """With PDL a decode kernel starts while the previous one drains and may only touch the
    weight before gdc_wait. A chain of gated MLPs, each kernel reading what the one before
    wrote, must give the bits of plain launches, eagerly and replayed from a CUDA graph."""
    if not triton_gemm.pdl_supported(torch.device(DEVICE)):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    monkeypatch.setattr(triton_gemm, "USE_PDL", True)  # the default; a test must not depend on it
    layers = [
        (
            quant_reference.quant_weight_block(randn(2 * 1536, 512, scale=0.02, device=DEVICE)),
            quant_reference.quant_weight_block(randn(512, 1536, scale=0.02, device=DEVICE)),
        )
        for _ in range(6)
    ]

    def chain(x, pdl, prefetch=triton_gemm.SMALL_M_PDL_PREFETCH):
        for w13, w2 in layers:
            a, b = triton_gemm.linear_small_m(x, *w13, pdl=pdl, prefetch=prefetch).chunk(2, dim=-1)
            x = triton_gemm.linear_small_m(a, *w2, b=b, pdl=pdl, prefetch=prefetch)
        return x

    x = randn(m, 512, device=DEVICE)
    want = chain(x, pdl=False)
    assert torch.equal(chain(x, pdl=True), want)
    assert torch.equal(chain(x, pdl=True, prefetch=4), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = chain(x, pdl=True)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, want)


def test_dependent_launch_is_refused_where_there_is_no_grid_dependency_control():
    if triton_gemm.pdl_supported(torch.device(DEVICE)):
        pytest.skip("this device has griddepcontrol")
    w_fp8, w_scale = quant_reference.quant_weight_block(randn(128, 128, device=DEVICE))
    assert not triton_gemm.pdl_supported(torch.device("cpu"))
    with pytest.raises(ValueError, match="compute capability 9.0"):
        triton_gemm.linear_small_m(randn(1, 128, device=DEVICE), w_fp8, w_scale, pdl=True)


def test_dependent_launch_refuses_a_prefetch_depth_that_is_not_a_power_of_two():
    w_fp8, w_scale = quant_reference.quant_weight_block(randn(128, 128, device=DEVICE))
    with pytest.raises(ValueError, match="power of two"):
        triton_gemm.linear_small_m(randn(1, 128, device=DEVICE), w_fp8, w_scale, pdl=True, prefetch=3)


def test_small_m_kernel_refuses_large_m():
    w_fp8, w_scale = quant_reference.quant_weight_block(randn(128, 128, device=DEVICE))
    with pytest.raises(ValueError, match="serves M <= 64"):
        triton_gemm.linear_small_m(randn(65, 128, device=DEVICE), w_fp8, w_scale)


def test_compiled_model_can_run_on_triton_kernels_when_asked():
    import fp8compile

    from fp8compile.weights import fp8_weight

    model = torch.nn.Linear(256, 384).to(torch.bfloat16).to(DEVICE)
    fp8 = fp8compile.backend(backends=["triton_small_m", "triton"])
    compiled = torch.compile(model, backend=fp8)
    with torch.no_grad():
        for m in (40, 5):
            x = activation(m, 256)
            torch._dynamo.mark_dynamic(x, 0)
            expected = reference_linear(x, *fp8_weight(model.weight), model.bias)
            assert_bf16_close(compiled(x), expected)
    assert fp8.report.rewrites[0].kernels == (("M <= 32", "triton_small_m"), ("M > 32", "triton"))


def gated_inputs(m, k):
    a, b = randn(m, k, scale=2.0, device=DEVICE), randn(m, k, device=DEVICE)
    return a, b, activations.gated(a, b)  # the fp32 product the fused kernels must quantize


@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize("e8m0", [False, True])
def test_fused_silu_mul_quantization_equals_quantizing_the_fp32_product(m, e8m0):
    # Compared with the same Triton quantization of the fp32 product (computed by torch), so
    # both sides share the device's float -> e4m3 conversion, the interpreter's included.
    a, b, h = gated_inputs(m, 384)
    fused_fp8, fused_scale = triton_quant.quant_act(a, e8m0, "row", b=b)
    plain_fp8, plain_scale = triton_quant.quant_act(h, e8m0, "row")
    torch.testing.assert_close(fused_scale, plain_scale, rtol=1e-6, atol=0)
    assert (
        calc_diff(
            quant_reference.dequant_act_block(fused_fp8, fused_scale),
            quant_reference.dequant_act_block(plain_fp8, plain_scale),
        )
        < 1e-6
    )


@pytest.mark.parametrize("m", [1, 16, 40])
@pytest.mark.parametrize("split_k", [1, 2])
def test_fused_silu_mul_decode_kernel_equals_the_plain_kernel_on_the_fp32_product(m, split_k):
    a, b, h = gated_inputs(m, 256)
    w_fp8, w_scale = quant_reference.quant_weight_block(randn(200, 256, scale=0.02, device=DEVICE))
    bias = randn(200, device=DEVICE)
    fused = triton_gemm.linear_small_m(a, w_fp8, w_scale, bias, split_k=split_k, b=b)
    plain = triton_gemm.linear_small_m(h, w_fp8, w_scale, bias, split_k=split_k)  # fp32 in, fp32 out
    assert_bf16_close(fused, to_bf16_as_the_device_does(plain))
    assert (
        calc_diff(fused, (h @ quant_reference.dequant_weight_block(w_fp8, w_scale).T + bias.float())) < 1e-3
    )


def test_fused_silu_mul_large_m_path_equals_the_plain_gemm_on_the_fp32_product():
    a, b, h = gated_inputs(70, 256)
    w_fp8, w_scale = quant_reference.quant_weight_block(randn(384, 256, scale=0.02, device=DEVICE))
    fused = triton_gemm.gated_linear_large_m(a, b, w_fp8, w_scale)
    h_fp8, h_scale = triton_quant.quant_act(h)
    plain = triton_gemm.gemm_large_m(h_fp8, h_scale, w_fp8, w_scale, out_dtype=torch.float32)
    assert_bf16_close(fused, to_bf16_as_the_device_does(plain))


@pytest.mark.parametrize("activation", ["swigluoai", "silu_limit", "gelu_tanh"])
@pytest.mark.parametrize("m", [1, 20])
def test_each_activation_on_interleaved_halves_equals_the_plain_kernels_on_the_fp32_product(m, activation):
    gate_up = randn(m, 512, scale=5.0, device=DEVICE)  # clamps at +-7 engage
    a, b = gate_up[:, ::2], gate_up[:, 1::2]  # strided views: no copy on the way into the kernels
    h = activations.gated(a, b, activation, 1.702, 7.0)
    fused_fp8, fused_scale = triton_quant.quant_act(a, b=b, activation=activation)
    plain_fp8, plain_scale = triton_quant.quant_act(h)
    torch.testing.assert_close(fused_scale, plain_scale, rtol=1e-6, atol=0)
    assert (
        calc_diff(
            quant_reference.dequant_act_block(fused_fp8, fused_scale),
            quant_reference.dequant_act_block(plain_fp8, plain_scale),
        )
        < 1e-6
    )
    w_fp8, w_scale = quant_reference.quant_weight_block(randn(128, 256, scale=0.02, device=DEVICE))
    fused = triton_gemm.gated_linear_small_m(a, b, w_fp8, w_scale, activation=activation)
    plain = triton_gemm.linear_small_m(h, w_fp8, w_scale)
    assert_bf16_close(fused, to_bf16_as_the_device_does(plain))


@pytest.mark.parametrize("m", [1, 20])
def test_non_gated_relu2_quantization_equals_quantizing_the_fp32_activation(m):
    """Non-gated experts' activation (Nemotron-H's relu(up)^2) fused into the quantization, read
    from a strided view as the MoE kernels pass it: the scales and values of quantizing
    activations.unary's fp32 result, which is never rounded to bf16 on the way."""
    up = randn(m, 512, scale=3.0, device=DEVICE)[:, ::2]  # negatives (zeroed) and squares past bf16's ulps
    fused_fp8, fused_scale = triton_quant.quant_act(up, activation="relu2")
    h = activations.unary(up, "relu2")
    torch.testing.assert_close(fused_scale, quant_reference.quant_act_block(h)[1], rtol=1e-6, atol=0)
    # values against the same kernel on the fp32 product (the interpreter's float -> e4m3 is not torch's)
    got, want = (
        quant_reference.dequant_act_block(*q) for q in ((fused_fp8, fused_scale), triton_quant.quant_act(h))
    )
    assert calc_diff(got, want) < 1e-6 and torch.equal(got == 0, want == 0)
    # Without b and without a non-gated activation, x itself is quantized (a block's own input).
    plain_fp8, plain_scale = triton_quant.quant_act(up, activation="silu")
    torch.testing.assert_close(plain_scale, quant_reference.quant_act_block(up)[1], rtol=1e-6, atol=0)


def test_linear_scaled_mm_traces_to_one_quantization_launch_and_one_scaled_mm():
    # What passes/inline.py copies into a default-mode graph for the cuBLAS side: the op's body
    # traced as AOTAutograd traces it (functionalized, symbolic M). It must be our quantization
    # kernel and aten._scaled_mm and nothing that copies (a written view would come back as a
    # slice_scatter). Traced in a process without Triton's interpreter, which wrap_triton cannot
    # trace through; on the CPU, as nothing runs.
    import json
    import os
    import subprocess
    import sys
    import textwrap

    pytest.importorskip("triton")
    script = textwrap.dedent("""
        import json
        import torch
        from torch._inductor.decomposition import select_decomp_table
        from torch._subclasses.functional_tensor import FunctionalTensorMode, dispatch_functionalize
        from torch.fx.experimental.proxy_tensor import make_fx
        from fp8compile.ops.linear import scaled_mm_op  # noqa: F401
        x = torch.empty(300, 512, dtype=torch.bfloat16)
        w, s = torch.empty(256, 512, dtype=torch.float8_e4m3fn), torch.empty(2, 4)
        bias = torch.empty(256, dtype=torch.bfloat16)
        for b in (None, x):
            call = lambda x, w, s, bias, b: torch.ops.fp8compile.linear_scaled_mm(x, w, s, bias, False, b)
            traced = make_fx(dispatch_functionalize(call, FunctionalTensorMode()),
                             decomposition_table=select_decomp_table(),
                             tracing_mode="symbolic")(x, w, s, bias, b)
            print(json.dumps(sorted(str(n.target) for n in traced.graph.nodes if n.op == "call_function"
                         and isinstance(n.target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)))))
    """)
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for line in done.stdout.strip().splitlines():
        targets = json.loads(line)
        assert targets.count("triton_kernel_wrapper_functional") == 1, targets
        assert targets.count("aten._scaled_mm.default") == 1, targets
        assert not [t for t in targets if "scatter" in t or "copy" in t or "clone" in t], targets
