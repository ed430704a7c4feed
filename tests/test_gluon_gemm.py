"""The warp-specialized Gluon GEMM (fp8compile/ops/gluon_gemm.py): compiled for Hopper on any
machine (Gluon has no interpreter), run against the reference and the Triton kernel on a GPU."""

import re

import pytest
import torch

pytest.importorskip("triton")

from fp8compile.ops.linear import gluon_gemm, triton_gemm  # noqa: E402
from fp8compile.ops.quant import reference as quant_reference  # noqa: E402
from fp8compile.ops.quant import triton_quant  # noqa: E402
from tests.conftest import DEVICE, randn  # noqa: E402
from tests.test_triton_kernels import assert_bf16_close, reference_gemm  # noqa: E402

ON_HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] == 9
needs_gluon = pytest.mark.skipif(gluon_gemm.IMPORT_ERROR is not None, reason=str(gluon_gemm.IMPORT_ERROR))
needs_hopper = pytest.mark.skipif(
    not ON_HOPPER or gluon_gemm.IMPORT_ERROR is not None, reason="needs an sm_90 GPU and Gluon"
)
CONFIGS = {
    "two_groups_per_buffer_128_rows": gluon_gemm.CONFIG,
    "two_groups_per_buffer_192_rows": gluon_gemm.TALL_CONFIG,
    # each consumer keeps one wgmma in flight while it promotes the buffer's other group
    "overlapped_128_rows": {**gluon_gemm.CONFIG, "OVERLAP": True, "STAGES": 3},
    "one_group_per_buffer_128_rows": {**gluon_gemm.CONFIG, "STAGE_GROUPS": 1, "STAGES": 4},
}


@needs_gluon
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_kernel_compiles_for_hopper_without_spills_or_serialized_wgmma(config):
    """ptxas keeps the kernel in registers and lets the wgmmas run asynchronously. It serializes
    them (warning C7514/C7515) when anything but a wgmma touches a wgmma's registers while it is
    in flight, which is what a loop-carried in-flight wgmma produced (LLVM's copies at the back
    edge); the overlapped loop is written so none crosses it."""
    kernel = gluon_gemm.compile_sm90(m=4096, n=2112, k=7168, bias=True, config=config)
    report = gluon_gemm.ptxas_report(kernel.asm["ptx"])
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    assert not re.search(r"serialized|C751[4-9]", report), report
    assert kernel.metadata.shared <= 227 * 1024  # what an sm_90 block may use


@needs_gluon
@pytest.mark.parametrize(
    "config", [gluon_gemm.CONFIG, gluon_gemm.WIDE_CONFIG], ids=["128_rows", "64_rows_256_columns"]
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("device_descriptors", [True, False], ids=["device_descriptors", "host_descriptors"])
def test_grouped_kernel_compiles_for_hopper_without_spills_or_serialized_wgmma(
    config, bias, device_descriptors
):
    """The grouped variant (the routed experts' GEMMs) skips row blocks of no expert in both the
    producer and the consumers; the branch around a tile must not cost spills or wgmma
    serialization, with the consumers splitting a tile's rows or its columns, and with its TMA
    descriptors built by the kernel or encoded by the host."""
    kernel = gluon_gemm.compile_sm90(
        m=32768, n=1536, k=2048, bias=bias, experts=128, config=config, device_descriptors=device_descriptors
    )
    report = gluon_gemm.ptxas_report(kernel.asm["ptx"])
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    assert not re.search(r"serialized|C751[4-9]", report), report
    assert kernel.metadata.shared <= 227 * 1024


@needs_gluon
def test_outside_cuda_graphs_the_kernel_builds_its_three_tma_descriptors_itself():
    """A launch outside CUDA graph capture passes pointers, and each program builds the
    activation's, the weights' and the output's descriptors in 128 bytes of global scratch
    apiece (the host's encoding cost about 20-30 us a call); the host-encoded variant (taken under
    capture, where it is encoded once) asks for no scratch."""
    on_device = gluon_gemm.compile_sm90(m=2048, n=2048, k=768, experts=128)
    on_host = gluon_gemm.compile_sm90(m=2048, n=2048, k=768, experts=128, device_descriptors=False)
    assert on_device.metadata.global_scratch_size == 3 * 128
    assert on_host.metadata.global_scratch_size == 0
    x, w = torch.empty(256, 512, dtype=torch.float8_e4m3fn), torch.empty(256, 512, dtype=torch.float8_e4m3fn)
    scales, out = (torch.empty(256, 4), torch.empty(2, 4)), torch.empty(256, 256, dtype=torch.bfloat16)
    _, args, meta = gluon_gemm.launch_args(x, scales[0], w, scales[1], None, out)
    assert meta["DEVICE_DESCRIPTORS"]
    assert args[0] is x and args[1].data_ptr() == w.data_ptr() and args[2] is out  # tensors: pointers


def test_grouped_gemms_take_64_row_blocks_where_256_column_tiles_divide_every_experts_n():
    """Qwen3-30B-A3B's 1536 and 2048 (and DeepSeek-V3's 4096 and 7168) take the 64-row tiles that
    pad each expert's rows half as much; GPT-OSS's 5760 does not divide, so both of its GEMMs
    (one routing) take 128-row ones."""
    assert gluon_gemm.grouped_config(1536, 2048) is gluon_gemm.WIDE_CONFIG
    assert gluon_gemm.grouped_config(4096, 7168) is gluon_gemm.WIDE_CONFIG
    assert gluon_gemm.grouped_config(5760, 2880) is gluon_gemm.CONFIG


@needs_gluon
def test_two_groups_per_buffer_wait_and_sync_once_per_pair_in_the_main_loop():
    """The point of STAGE_GROUPS = 2, read from the SASS: the consumers' main loop covers two K
    groups (8 wgmma of 64 x 128 x 32) with one mbarrier wait, and the warpgroup bar.sync that
    Triton puts before each mbarrier wait and release comes twice, not four times."""
    report = gluon_gemm.main_loop_report(gluon_gemm.compile_sm90(m=4096, n=4096, k=14336).asm["cubin"])
    counts = {name: int(n) for n, name in re.findall(r"(\d+) (wgmma|FFMA|bar\.sync|mbarrier waits)", report)}
    assert counts["wgmma"] == 8 and counts["FFMA"] == 128, report
    assert counts["mbarrier waits"] == 1 and counts["bar.sync"] <= 2, report


def test_tall_tiles_are_chosen_where_their_waves_cost_less():
    """pick_config compares whole waves of persistent programs (132 SMs): 192-row tiles on
    24576 x 1536 at M = 4096 (32 full waves against 47), 128-row ones on N = 4096 at M = 4096
    (704 tall tiles are 6 waves, 5.3 of them used, against 8 waves of 1024 tiles)."""
    assert gluon_gemm.pick_config(4096, 24576, 132) is gluon_gemm.TALL_CONFIG
    assert gluon_gemm.pick_config(4096, 4096, 132) is gluon_gemm.CONFIG
    assert gluon_gemm.pick_config(1024, 7168, 132) is gluon_gemm.CONFIG


@needs_gluon
def test_configs_outside_the_kernels_design_are_refused():
    x = torch.empty(256, 256, dtype=torch.float8_e4m3fn)
    w = torch.empty(256, 256, dtype=torch.float8_e4m3fn)
    scales = torch.empty(256, 2), torch.empty(2, 2)
    out = torch.empty(256, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="128 or 192 rows"):
        gluon_gemm.launch_args(x, scales[0], w, scales[1], None, out, dict(BLOCK_M=256))
    with pytest.raises(ValueError, match="two consumers only"):
        gluon_gemm.launch_args(x, scales[0], w, scales[1], None, out, dict(BLOCK_M=192, OVERLAP=True))
    with pytest.raises(ValueError, match="STAGE_GROUPS=2 only"):
        gluon_gemm.launch_args(x, scales[0], w, scales[1], None, out, dict(OVERLAP=True, STAGE_GROUPS=1))
    with pytest.raises(ValueError, match="one or two K groups"):
        gluon_gemm.launch_args(x, scales[0], w, scales[1], None, out, dict(STAGE_GROUPS=4))


@needs_gluon
def test_a_launch_of_known_sizes_reuses_its_constexprs_whatever_m_and_the_tensors():
    """What a launch's sizes decide (config checks, constexprs, layouts) is made once per sizes
    and kept (host time outside CUDA graphs): a grouped GEMM of other M and other tensors gets
    the same object, another N or descriptor mode another one; launch_args hands out a copy."""
    w = torch.empty(4, 256, 256, dtype=torch.float8_e4m3fn)
    w_scale = torch.empty(4, 2, 2)

    def static(m, n=256, descriptors=True):
        x = torch.empty(m, 256, dtype=torch.float8_e4m3fn)
        out = torch.empty(m, n, dtype=torch.bfloat16)
        weights = w if n == 256 else torch.empty(4, n, 256, dtype=torch.float8_e4m3fn)
        scales = w_scale if n == 256 else torch.empty(4, n // 128, 2)
        experts = torch.zeros(m // 64, dtype=torch.int32)
        return gluon_gemm._prepare(
            x, torch.empty(m, 2), weights, scales, None, out, None, experts, descriptors
        )[2]

    assert static(128) is static(1024)
    assert static(128) is not static(128, n=512)
    assert static(128) is not static(128, descriptors=False)
    x, out = torch.empty(128, 256, dtype=torch.float8_e4m3fn), torch.empty(128, 256, dtype=torch.bfloat16)
    meta = gluon_gemm.launch_args(
        x, torch.empty(128, 2), w[0], w_scale[0], None, out, device_descriptors=True
    )[2]
    meta.pop("num_warps")
    again = gluon_gemm.launch_args(
        x, torch.empty(128, 2), w[0], w_scale[0], None, out, device_descriptors=True
    )[2]
    assert again["num_warps"] == 4


@needs_gluon
@pytest.mark.parametrize("config", [gluon_gemm.CONFIG, {**gluon_gemm.CONFIG, "OVERLAP": True}])
def test_an_odd_number_of_k_groups_takes_one_group_per_buffer_in_as_many_buffers(config):
    """Two groups per buffer need an even count of 128-wide K groups; otherwise the launch falls
    back to one per buffer, with twice the buffers (the same shared memory) and no overlap."""

    def meta(k):
        x, w = torch.empty(256, k, dtype=torch.float8_e4m3fn), torch.empty(256, k, dtype=torch.float8_e4m3fn)
        scales = torch.empty(256, k // 128), torch.empty(2, k // 128)
        return gluon_gemm.launch_args(x, scales[0], w, scales[1], None, torch.empty(256, 256), config)[2]

    even, odd = meta(1024), meta(640)
    assert (even["STAGE_GROUPS"], even["STAGES"], even["OVERLAP"]) == (2, config["STAGES"], config["OVERLAP"])
    assert (odd["STAGE_GROUPS"], odd["STAGES"], odd["OVERLAP"]) == (1, 2 * config["STAGES"], False)


def test_why_not_names_what_the_kernel_cannot_do():
    x = torch.empty(8, 200, dtype=torch.float8_e4m3fn)
    w = torch.empty(12, 200, dtype=torch.float8_e4m3fn)
    why = gluon_gemm.why_not(x, w)
    assert why is not None
    if gluon_gemm.IMPORT_ERROR is None:
        assert "CUDA" in why
    if ON_HOPPER:
        assert "K=200" in gluon_gemm.why_not(x.cuda(), w.cuda())
        empty = torch.empty(8, 0, dtype=torch.float8_e4m3fn, device="cuda")
        assert "K=0" in gluon_gemm.why_not(empty, empty)
        x, w = (
            torch.empty(8, 256, dtype=torch.float8_e4m3fn, device="cuda"),
            torch.empty(12, 256, device="cuda"),
        )
        assert "N=12" in gluon_gemm.why_not(x, w.to(torch.float8_e4m3fn))
    with pytest.raises(RuntimeError, match="the Gluon GEMM cannot run here"):
        gluon_gemm.gemm(x, torch.empty(8, 2), w, torch.empty(1, 2))


def test_why_not_grouped_names_operands_the_grouped_kernel_cannot_read():
    """The grouped kernel reads the experts' weights as one (E * N, K) matrix, so they must lie
    one after another (a slice of each expert's rows does not), with x's K."""
    x = torch.empty(64, 256, dtype=torch.float8_e4m3fn)
    w = torch.empty(4, 256, 256, dtype=torch.float8_e4m3fn)
    assert "same K" in gluon_gemm.why_not_grouped(x[:, :128], w)
    assert "same K" in gluon_gemm.why_not_grouped(x, w[0])
    assert "one after another" in gluon_gemm.why_not_grouped(x, w[:, :128])
    if ON_HOPPER:
        assert gluon_gemm.why_not_grouped(x.cuda(), w.cuda()) is None
        assert "one after another" in gluon_gemm.why_not_grouped(x.cuda(), w.cuda()[:, 128:])
        shifted = torch.empty(64 * 256 + 8, dtype=torch.float8_e4m3fn, device="cuda")[8:].view(64, 256)
        assert "16-byte aligned" in gluon_gemm.why_not_grouped(shifted, w.cuda())


@needs_hopper
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("m, n, k", [(1, 256, 128), (7, 2112, 768), (600, 384, 640), (1000, 4096, 1024)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_reference_and_the_triton_kernel_bit_for_bit(config, m, n, k, bias):
    """K = 128, 640 (1 and 5 groups: one group per buffer, see below), 768 and 1024 (6 and 8: two
    per buffer), N = 2112 (past the last weight-scale block), M = 1, 7, 600, 1000 (rows past M,
    past the tile). Same bits as triton_gemm's kernel: every output element is the same sequence
    of 128-wide fp32 products, each scaled and added in K order, so the two large-M kernels are
    interchangeable."""
    x_fp8, x_scale = triton_quant.quant_act(randn(m, k, device=DEVICE))
    w_fp8, w_scale = quant_reference.quant_weight_block(randn(n, k, scale=0.02, device=DEVICE))
    b = randn(n, device=DEVICE) if bias else None
    out = gluon_gemm.gemm(x_fp8, x_scale, w_fp8, w_scale, b, config=config)
    assert_bf16_close(out, reference_gemm(x_fp8, x_scale, w_fp8, w_scale, b))
    triton = triton_gemm.gemm_large_m(x_fp8, x_scale, w_fp8, w_scale, b, config=triton_gemm.LARGE_M_CONFIG)
    assert torch.equal(out, triton)


@needs_hopper
@pytest.mark.parametrize(
    "config", [gluon_gemm.CONFIG, gluon_gemm.WIDE_CONFIG], ids=["128_rows", "64_rows_256_columns"]
)
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_gemm_gives_each_row_block_its_experts_gemm_bit_for_bit(config, bias):
    """Row block i of the grouped GEMM is gemm() of those rows with expert block_expert[i]'s
    weights (scales, bias), to the bit; blocks of expert -1 are skipped (their rows keep what
    was there). N = 512 is two 256-column or four 128-column tiles per expert, K = 640 an odd
    count of groups."""
    experts, n, k, bm = 5, 512, 640, config["BLOCK_M"]
    block_expert = torch.tensor([3, 0, 0, -1, 4, 1, -1, 3], dtype=torch.int32, device=DEVICE)
    m = block_expert.numel() * bm
    x_fp8, x_scale = triton_quant.quant_act(randn(m, k, device=DEVICE))
    w_fp8, w_scale = quant_reference.quant_weight_block(randn(experts * n, k, scale=0.02, device=DEVICE))
    w_fp8, w_scale = w_fp8.reshape(experts, n, k), w_scale.reshape(experts, n // 128, k // 128)
    b = randn(experts, n, device=DEVICE) if bias else None
    out = gluon_gemm.grouped_gemm(x_fp8, x_scale, w_fp8, w_scale, block_expert, b, config=config)
    for i, e in enumerate(block_expert.tolist()):
        if e >= 0:
            rows = slice(bm * i, bm * (i + 1))
            want = gluon_gemm.gemm(
                x_fp8[rows], x_scale[rows], w_fp8[e], w_scale[e], None if b is None else b[e]
            )
            assert torch.equal(out[rows], want), (i, e)
    with pytest.raises(ValueError, match=f"one expert per {bm}-row block"):
        gluon_gemm.grouped_gemm(x_fp8, x_scale, w_fp8, w_scale, block_expert[:-1], config=config)


@needs_hopper
def test_large_m_gemm_hands_large_m_to_gluon_and_replays_in_a_cuda_graph(monkeypatch):
    """Above TILE_SWITCH_M rows gemm_large_m runs the Gluon kernel (USE_GLUON), below it its own.
    Eager, the kernel builds its TMA descriptors; captured, the host encodes them once as kernel
    parameters: the replay gives the same bits."""
    calls = []
    real = gluon_gemm.gemm
    monkeypatch.setattr(gluon_gemm, "gemm", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    m = triton_gemm.TILE_SWITCH_M + 1
    x_fp8, x_scale = triton_quant.quant_act(randn(m, 512, device=DEVICE))
    w_fp8, w_scale = quant_reference.quant_weight_block(randn(640, 512, scale=0.02, device=DEVICE))
    eager = triton_gemm.gemm_large_m(x_fp8, x_scale, w_fp8, w_scale)
    below = triton_gemm.gemm_large_m(x_fp8[: m - 1], x_scale[: m - 1], w_fp8, w_scale)
    assert calls == [m]
    assert torch.equal(eager[: m - 1], below)  # batch-invariant across the switch
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = triton_gemm.gemm_large_m(x_fp8, x_scale, w_fp8, w_scale)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(eager, replayed)
    monkeypatch.setattr(triton_gemm, "USE_GLUON", False)
    assert torch.equal(triton_gemm.gemm_large_m(x_fp8, x_scale, w_fp8, w_scale), eager)
    assert calls == [m, m]  # the capture's call; none with USE_GLUON off


def test_backends_table_names_the_large_m_kernel_that_runs():
    """`python -m fp8compile backends` says which of the two large-M kernels the triton backend
    runs: the Gluon one above TILE_SWITCH_M rows on sm_90, the Triton one elsewhere."""
    small = triton_gemm.TILE_SWITCH_M
    assert triton_gemm.large_m_kernel(small, 4096, torch.device("cpu")) == "Triton GEMM, 64x128 tiles"
    assert triton_gemm.large_m_kernel(4096, 4096, torch.device("cpu")) == "Triton GEMM, 128x128 tiles"
    if ON_HOPPER:
        device = torch.device("cuda")
        assert triton_gemm.large_m_kernel(4096, 4096, device) == "Gluon warp-specialized GEMM, 128x128 tiles"
        assert triton_gemm.large_m_kernel(4096, 24576, device).endswith("192x128 tiles")
