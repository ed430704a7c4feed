"""FP8 MQA logits of sparse-attention indexers: the definitions (reference_mqa), the ops and their
kernels (Triton under the CPU interpreter here, on the GPU at real sizes; DeepGEMM where it
imports), the paged index cache and its schedule, and the mqa_logits pass on transformers'
DeepSeek-V3.2 indexer and on indexers written by hand."""

from pathlib import Path

import pytest
import torch
from torch import nn

import fp8compile
from fp8compile import registry
from fp8compile.config import FUSIONS
from fp8compile.numerics import calc_diff, is_power_of_two
from fp8compile.ops.mqa_logits import reference as rm
from tests.conftest import BF16, DEVICE, ONE_GEMM, golden_text, gpu

MQA = torch.ops.fp8compile.mqa_logits
PAGED = torch.ops.fp8compile.paged_mqa_logits
METADATA = torch.ops.fp8compile.paged_mqa_logits_metadata
INF = float("-inf")
# The FP8 logits against the exact score of the bf16 inputs: q and k rounded to e4m3 per row,
# the same rounding as one block-FP8 GEMM (ONE_GEMM). Measured 6.6e-4..7.2e-4 over seeds 0-3 at
# M = 64, N = 512, H = 64, D = 128 (7.1e-4..7.7e-4 with E8M0 scales, one more bit lost per row).
LOGITS_BOUND = 1.1 * ONE_GEMM
LOGITS_BOUND_E8M0 = 1.2 * ONE_GEMM
# Recall of the exact top-64 of 512 keys by the FP8 logits' top-64, same inputs: 0.969-0.972
# (0.970-0.972 with E8M0). Random scores crowd the top-k boundary; trained indexers' are spread.
RECALL_BOUND = 0.96
# DeepSeek-V3.2 at the matrix's small sizes (2 layers), top-16 of 64 keys: logits against eager
# bf16 measured 0.048-0.071 over seeds 0-2, against 0.046-0.066 for the same model compiled
# without this pass (FP8 linears only): 1.03-1.09x; the bound is 1.15x the worst of those.
DEEPSEEK_V32_BOUND = 1.15 * 0.066


def exact_score(q, k, w):
    """sum_h w * relu(q . k) in fp64: q (M, H, D), k (N, D), w (M, H) -> (M, N)."""
    return torch.einsum("mhd,nd->mhn", q.double(), k.double()).relu().mul(w.double()[..., None]).sum(1)


def fp8_inputs(m, n, h, d, device="cpu", seed=0, e8m0=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(m, h, d, generator=gen).to(BF16).to(device)
    k = torch.randn(n, d, generator=gen).to(BF16).to(device)
    w = torch.randn(m, h, generator=gen).to(BF16).to(device)
    q_fp8, q_scale = rm.quant_rows(q, e8m0)
    k_fp8, k_scale = rm.quant_rows(k, e8m0)
    return (q, k, w), (q_fp8, k_fp8, k_scale, w.float() * q_scale)


def recall(want: torch.Tensor, got: torch.Tensor, top: int) -> float:
    a, b = want.topk(top, -1).indices, got.topk(top, -1).indices
    return sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a, b)) / a.numel()


def windows(m, n):
    """Ragged windows: full, causal-like, empty (ks == ke), one key, the tail."""
    ks = torch.tensor([0, 3, 10, 0, n - 5, 7, 0][:m] + [1] * max(0, m - 7), dtype=torch.int32)
    ke = torch.tensor([n, 40, 10, 1, n, 7, 64][:m] + [n - 1] * max(0, m - 7), dtype=torch.int32)
    return ks, ke


def backends_here():
    found = [
        b
        for b in ("triton", "deep_gemm")
        if registry.why_not(b, registry.Request("mqa_logits", torch.device(DEVICE), 64, 128)) is None
    ]
    return found


# --- definitions ----------------------------------------------------------------------------


def test_reference_scores_the_dequantized_inputs_exactly():
    # The weights carry q's scales; k's scale multiplies the sum: the dequantized score in fp32.
    (_, _, w), (q_fp8, k_fp8, k_scale, weights) = fp8_inputs(9, 70, 16, 32)
    ks, ke = torch.zeros(9, dtype=torch.int32), torch.full((9,), 70, dtype=torch.int32)
    got = rm.mqa_logits(q_fp8, k_fp8, k_scale, weights, ks, ke)
    q_scale = weights / w.float()
    want = exact_score(
        q_fp8.double() * q_scale.double()[..., None], k_fp8.double() * k_scale.double()[:, None], w
    )
    assert calc_diff(got, want) < 1e-12


@pytest.mark.parametrize("e8m0", [False, True])
def test_fp8_logits_keep_the_bf16_scores_top_k(e8m0):
    (q, k, w), (q_fp8, k_fp8, k_scale, weights) = fp8_inputs(64, 512, 64, 128, e8m0=e8m0)
    if e8m0:
        assert is_power_of_two(k_scale) and is_power_of_two(weights / w.float())
    ks, ke = torch.zeros(64, dtype=torch.int32), torch.full((64,), 512, dtype=torch.int32)
    got = rm.mqa_logits(q_fp8, k_fp8, k_scale, weights, ks, ke)
    want = exact_score(q, k, w)
    assert calc_diff(got, want) < (LOGITS_BOUND_E8M0 if e8m0 else LOGITS_BOUND)
    assert recall(want, got, 64) >= RECALL_BOUND


def test_compressed_logits_hold_each_window_from_its_start():
    (_, _, _), args = fp8_inputs(7, 70, 16, 32)
    ks, ke = windows(7, 70)
    full = rm.mqa_logits(*args, ks, ke)
    compressed = rm.mqa_logits(*args, ks, ke, max_seqlen_k=64)
    for m in range(7):
        length = min(int(ke[m] - ks[m]), 64)  # a longer window is cut at max_seqlen_k
        assert torch.equal(compressed[m, :length], full[m, ks[m] : ks[m] + length])
        assert (compressed[m, length:] == INF).all()


def test_index_cache_holds_fp8_keys_then_their_scales_per_block():
    keys = torch.randn(3, 16, 32).to(BF16)
    cache = rm.quant_index_cache(keys)
    assert cache.shape == (3, 16, 1, 36) and cache.dtype == torch.uint8
    k_fp8, k_scale = rm.quant_rows(keys)
    flat = cache.view(3, -1)
    # Block b: its 16 x 32 FP8 bytes, token-major, then 16 fp32 scales (DeepGEMM's layout).
    assert torch.equal(
        flat[:, : 16 * 32].view(torch.float8_e4m3fn).view(3, 16, 32).view(torch.uint8),
        k_fp8.view(torch.uint8),
    )
    assert torch.equal(flat[:, 16 * 32 :].view(torch.float32), k_scale)
    cache_e8m0 = rm.quant_index_cache(keys, e8m0=True)
    assert is_power_of_two(rm.index_cache_views(cache_e8m0)[1])


def test_index_cache_write_op_stores_tokens_at_their_slots():
    cache = torch.zeros(4, 16, 1, 36, dtype=torch.uint8)
    k = torch.randn(5, 32).to(BF16)
    slots = torch.tensor([0, 17, 18, 63, 40])
    torch.ops.fp8compile.index_cache_write(cache, k, slots)
    keys, scales = rm.index_cache_views(cache)
    k_fp8, k_scale = rm.quant_rows(k)
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(keys[slot // 16, slot % 16].view(torch.uint8), k_fp8[t].view(torch.uint8))
        assert scales[slot // 16, slot % 16] == k_scale[t]
    assert int((scales != 0).sum()) == 5


def paged_case(b=3, next_n=2, h=16, d=32, block=16, lens=(40, 0, 300), blocks=64, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(blocks, block, d, generator=gen).to(BF16)
    cache = rm.quant_index_cache(keys).to(device)
    width = max(1, -(-max(lens) // block))
    tables = torch.randperm(blocks, generator=gen)[: b * width].view(b, width).to(torch.int32).to(device)
    q = torch.randn(b, next_n, h, d, generator=gen).to(BF16)
    q_fp8, q_scale = rm.quant_rows(q)
    weights = torch.rand(b * next_n, h, generator=gen) * q_scale.view(b * next_n, h)
    lens = torch.tensor(lens, dtype=torch.int32)
    return q_fp8.to(device), cache, weights.to(device), lens.to(device), tables


@pytest.mark.parametrize("next_n", [1, 2])
def test_paged_logits_equal_the_contiguous_logits_of_the_gathered_keys(next_n):
    q_fp8, cache, weights, lens, tables = paged_case(next_n=next_n)
    got = rm.paged_mqa_logits(q_fp8, cache, weights, lens, tables, None, 320)
    keys, scales = rm.index_cache_views(cache)
    for b, length in enumerate(lens.tolist()):
        rows = slice(b * next_n, (b + 1) * next_n)
        if length == 0:
            assert (got[rows] == INF).all()
            continue
        blocks = tables[b, : -(-length // 16)].long()
        k, k_scale = keys[blocks].reshape(-1, 32)[:length], scales[blocks].reshape(-1)[:length]
        for j in range(next_n):
            position = length - next_n + j  # query j sees the keys up to its own position
            one = rm.mqa_logits(
                q_fp8[b, j : j + 1],
                k,
                k_scale,
                weights[rows][j : j + 1],
                torch.zeros(1, dtype=torch.int32),
                torch.tensor([position + 1], dtype=torch.int32),
            )
            torch.testing.assert_close(
                got[rows][j, : position + 1], one[0, : position + 1], rtol=1e-6, atol=1e-5
            )
            assert (got[rows][j, position + 1 :] == INF).all()


@pytest.mark.parametrize("lens", [(40, 0, 300), (1, 1, 1), (0, 0, 0), (256, 257, 5000)])
@pytest.mark.parametrize("programs", [1, 4, 132])
def test_schedule_gives_every_unit_of_work_to_exactly_one_program(lens, programs):
    lens_t = torch.tensor(lens, dtype=torch.int32)
    sched = rm.paged_schedule(lens_t, 64, programs).tolist()
    assert len(sched) == programs + 1 and sched[-1] == [len(lens), 0]
    units = [-(-n // rm.SPLIT_KV) for n in lens]
    done = []
    for p in range(programs):  # the kernel's walk from its row to the next
        (seq, unit), end = sched[p], tuple(sched[p + 1])
        while (seq, unit) < end:
            if unit < units[seq]:
                done.append((seq, unit))
            unit += 1
            if unit >= units[seq]:
                seq, unit = seq + 1, 0
    assert sorted(done) == [(s, u) for s in range(len(lens)) for u in range(units[s])]
    per_program = [
        sum(1 for s, u in done if (s, u) >= tuple(sched[p]) and (s, u) < tuple(sched[p + 1]))
        for p in range(programs)
    ]
    assert max(per_program) <= -(-sum(units) // programs)  # equal runs, to one unit


def test_schedule_refuses_blocks_it_cannot_split():
    with pytest.raises(ValueError, match="power-of-two blocks of 16 to 256"):
        rm.paged_schedule(torch.tensor([5], dtype=torch.int32), 48, 4)


# --- ops and kernels ------------------------------------------------------------------------


# SchemaCheckMode compares inputs with allclose, which has no CPU float8 kernel: the ops with FP8
# inputs skip test_schema, and test_ops_leave_their_inputs_as_they_were checks the same bitwise.
FP8_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def op_samples():
    (_, _, _), args = fp8_inputs(5, 70, 16, 32)
    ks, ke = windows(5, 70)
    q_fp8, cache, weights, lens, tables = paged_case()
    sched = METADATA(lens, 16, 4, "reference")
    return [
        (MQA, (*args, ks, ke, True, 0, "reference")),
        (MQA, (*args, ks, ke, False, 64, "reference")),
        (PAGED, (q_fp8, cache, weights, lens, tables, sched, 320, True, "reference")),
    ]


def test_ops_pass_opcheck():
    for op, args in op_samples():
        torch.library.opcheck(op, args, test_utils=FP8_UTILS)
    lens = torch.tensor([40, 0, 300], dtype=torch.int32)
    torch.library.opcheck(METADATA, (lens, 16, 4, "reference"))
    torch.library.opcheck(
        torch.ops.fp8compile.index_cache_write,
        (torch.zeros(2, 16, 1, 36, dtype=torch.uint8), torch.randn(3, 32).to(BF16), torch.tensor([0, 5, 31])),
    )


def test_ops_leave_their_inputs_as_they_were():
    for op, args in op_samples():
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        before = [t.view(torch.uint8).clone() for t in tensors]
        out = op(*args)
        assert all(torch.equal(t.view(torch.uint8), b) for t, b in zip(tensors, before))
        assert all(out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for t in tensors)


def test_ops_refuse_mismatched_shapes_with_a_clear_error():
    (_, _, _), (q_fp8, k_fp8, k_scale, weights) = fp8_inputs(5, 70, 16, 32)
    ks, ke = windows(5, 70)
    with pytest.raises(RuntimeError, match=r"weights is \(5, 16\)"):
        MQA(q_fp8, k_fp8, k_scale, weights[:, :8], ks, ke)
    with pytest.raises(RuntimeError, match=r"k_fp8 is \(N, 32\)"):
        MQA(q_fp8, k_fp8[:, :16], k_scale, weights, ks, ke)


@pytest.mark.skipif(
    DEVICE != "cpu", reason="the interpreter runs on CPU tensors; the GPU test below covers it"
)
@pytest.mark.parametrize("clean", [True, False])
@pytest.mark.parametrize("compressed", [0, 64])
def test_triton_kernel_matches_the_reference_under_the_interpreter(clean, compressed):
    from fp8compile.ops.mqa_logits import triton_mqa

    (_, _, _), args = fp8_inputs(7, 70, 16, 32)  # N = 70: not a multiple of the key tile
    ks, ke = windows(7, 70)
    want = rm.mqa_logits(*args, ks, ke, True, compressed)
    got = triton_mqa.mqa_logits(*args, ks, ke, clean, compressed)
    inside = want != INF
    assert calc_diff(got[inside], want[inside]) < 1e-12
    if clean:
        assert (got[~inside] == INF).all()


@pytest.mark.skipif(
    DEVICE != "cpu", reason="the interpreter runs on CPU tensors; the GPU test below covers it"
)
@pytest.mark.parametrize("tiles", [(4, 32, 4, 1), (2, 16, 4, 2), (1, 64, 4, 1)])
@pytest.mark.parametrize("clean", [True, False])
def test_triton_kernel_streams_only_the_keys_its_token_block_reaches(tiles, clean):
    """Sliding windows: each block of tokens starts past the first key tile and ends before the
    last, so a program skips tiles on both sides (-inf there with clean_logits) and reads the
    rest; a block of tokens that does not divide M, and one tile of keys per token block."""
    from fp8compile.ops.mqa_logits import triton_mqa

    m, n = 13, 200
    (_, _, _), args = fp8_inputs(m, n, 16, 32, seed=1)
    ke = torch.arange(1, m + 1, dtype=torch.int32) * 15  # 15 .. 195
    ks = (ke - 40).clamp(min=0)
    want = rm.mqa_logits(*args, ks, ke, True)
    got = triton_mqa.mqa_logits(*args, ks, ke, clean, tiles=tiles)
    inside = want != INF
    assert calc_diff(got[inside], want[inside]) < 1e-12
    if clean:
        assert (got[~inside] == INF).all()
    with pytest.raises(ValueError, match="one token a program"):
        triton_mqa.mqa_logits(*args, ks, ke, clean, 64, tiles=(2, 32, 4, 1))


@pytest.mark.skipif(
    DEVICE != "cpu", reason="the interpreter runs on CPU tensors; the GPU test below covers it"
)
@pytest.mark.parametrize("next_n", [1, 2])
@pytest.mark.parametrize("clean", [True, False])
@pytest.mark.parametrize("tiles", [None, (32, 32, 4, 1), (64, 128, 4, 1)])
def test_triton_paged_kernel_matches_the_reference_under_the_interpreter(next_n, clean, tiles):
    """Blocks of 16 keys; steps of 16 (the interpreter's default), 32 and 64 keys, so that a step
    spans several blocks, each key found through its own; programs of 64, 32 (one step) and 128
    positions; lengths 40, 0 and 300 against max_context_len 320."""
    from fp8compile.ops.mqa_logits import triton_mqa

    q_fp8, cache, weights, lens, tables = paged_case(next_n=next_n)
    sched = rm.paged_schedule(lens, 16, 4)
    want = rm.paged_mqa_logits(q_fp8, cache, weights, lens, tables, None, 320)
    got = triton_mqa.paged_mqa_logits(q_fp8, cache, weights, lens, tables, sched, 320, clean, tiles)
    inside = want != INF
    assert calc_diff(got[inside], want[inside]) < 1e-12
    if clean:
        assert (got[~inside] == INF).all()


def test_deep_gemm_paged_adapter_cleans_the_logits_itself_past_each_querys_length(monkeypatch):
    """sgl-deep-gemm 0.1.5's sm_90 kernel asserts `not is_context_lens_2d` when asked to clean with
    one length per query (H100, 2026-11-25 (833267e)): the adapter never asks, and writes -inf past
    each query's length itself. Checked against a stand-in for DeepGEMM that leaves zeros."""
    from types import SimpleNamespace

    from fp8compile.ops.mqa_logits import vendors as vendors_mqa

    calls = []

    def fp8_paged_mqa_logits(q, cache, weights, lengths, tables, schedule, max_len, clean_logits):
        calls.append((lengths.tolist(), clean_logits))
        return torch.zeros(q.shape[0] * q.shape[1], max_len)

    stand_in = SimpleNamespace(fp8_paged_mqa_logits=fp8_paged_mqa_logits)
    monkeypatch.setattr(vendors_mqa, "require", lambda module: stand_in)
    q_fp8, cache, weights, lens, tables = paged_case(2, 2, 16, 32, 64, (70, 1), blocks=4)
    for clean in (True, False):
        logits = vendors_mqa.paged_mqa_logits_deep_gemm(q_fp8, cache, weights, lens, tables, None, 96, clean)
        assert calls[-1] == ([[69, 70], [0, 1]], False)  # one length per query; never asked to clean
        seen = torch.arange(96)[None, :] < torch.tensor([69, 70, 0, 1])[:, None]
        assert (logits[seen] == 0).all()
        assert (logits[~seen] == float("-inf")).all() if clean else (logits == 0).all()


def test_deep_gemm_adapter_cleans_the_compressed_layout_past_each_window_itself(monkeypatch):
    """DeepGEMM asserts `not clean_logits` for the compressed layout (max_seqlen_k > 0): the
    adapter asks it not to clean there and sets -inf past each window's length. A stand-in for
    DeepGEMM on the CPU that leaves zeros."""
    from types import SimpleNamespace

    from fp8compile.ops.mqa_logits import vendors as vendors_mqa

    asked = []

    def fp8_mqa_logits(q, kv, weights, ks, ke, clean_logits, max_seqlen_k):
        asked.append(clean_logits)
        return torch.zeros(q.shape[0], max_seqlen_k)

    monkeypatch.setattr(vendors_mqa, "require", lambda module: SimpleNamespace(fp8_mqa_logits=fp8_mqa_logits))
    q, k, k_scale = torch.zeros(3, 4, 32), torch.zeros(10, 32), torch.ones(10)
    ks, ke = torch.tensor([0, 2, 5]), torch.tensor([1, 6, 5])  # windows of 1, 4 and 0 keys
    logits = vendors_mqa.mqa_logits_deep_gemm(q, k, k_scale, torch.ones(3, 4), ks, ke, True, 4)
    assert asked == [False]
    assert torch.equal(logits.isinf(), torch.arange(4)[None, :] >= torch.tensor([1, 4, 0])[:, None])


def test_deep_gemm_adapters_return_contiguous_logits_where_deep_gemm_pads_its_rows(monkeypatch):
    """DeepGEMM's logits are a view of rows padded to its tile of keys (32 keys, row stride 256, on
    an H200); the op's fake says contiguous rows, and Inductor's check of the op's output failed
    DeepSeek-V3.2 on the GPU ("expected size 64==64, stride 256==32"). A stand-in for DeepGEMM
    that pads as it does."""
    from types import SimpleNamespace

    from fp8compile.ops.mqa_logits import vendors as vendors_mqa

    def padded(rows, keys):
        return torch.zeros(rows, 256)[:, :keys]

    stand_in = SimpleNamespace(
        fp8_mqa_logits=lambda q, kv, weights, ks, ke, clean_logits, max_seqlen_k: padded(q.shape[0], 32),
        fp8_paged_mqa_logits=lambda q, cache, w, lengths, tables, schedule, max_len, clean_logits: padded(
            q.shape[0] * q.shape[1], max_len
        ),
    )
    monkeypatch.setattr(vendors_mqa, "require", lambda module: stand_in)
    q, k, k_scale = torch.zeros(3, 4, 32), torch.zeros(32, 32), torch.ones(32)
    ks, ke = torch.zeros(3, dtype=torch.int32), torch.full((3,), 32, dtype=torch.int32)
    logits = vendors_mqa.mqa_logits_deep_gemm(q, k, k_scale, torch.ones(3, 4), ks, ke, True, 0)
    assert logits.shape == (3, 32) and logits.stride() == (32, 1)
    q_fp8, cache, weights, lens, tables = paged_case(2, 1, 16, 32, 64, (70, 1), blocks=4)
    paged = vendors_mqa.paged_mqa_logits_deep_gemm(q_fp8, cache, weights, lens, tables, None, 96, True)
    assert paged.shape == (2, 96) and paged.stride() == (96, 1)


def test_registry_says_why_a_kernel_cannot_serve_these_heads():
    request = registry.Request("mqa_logits", torch.device("cuda"), n=48, k=128)
    assert "powers of two" in registry.why_not("triton", request)
    assert "DeepGEMM's MQA logits take H in (32, 64)" in registry.why_not("deep_gemm", request)
    assert registry.default_order("large", "mqa_logits")[-1] == "reference"


def test_deep_gemm_paged_adapter_gives_one_length_per_query_and_refuses_what_its_kernel_cannot_read():
    from fp8compile.ops.mqa_logits import vendors as vendors_mqa

    # Query j of a sequence of 5 with next_n = 2 sits at position 3 + j: it sees 4 + j keys.
    lens = torch.tensor([5, 1, 0], dtype=torch.int32)
    assert vendors_mqa.per_query_lengths(lens, 2).tolist() == [[4, 5], [0, 1], [0, 0]]
    assert vendors_mqa.per_query_lengths(lens, 1).tolist() == [[5], [1], [0]]
    q_fp8, cache, weights, lens, tables = paged_case()  # blocks of 16, next_n = 2
    with pytest.raises(ValueError, match="blocks of 64 tokens, got 16"):
        vendors_mqa.paged_mqa_logits_deep_gemm(q_fp8, cache, weights, lens, tables, None, 320)
    with pytest.raises(ValueError, match="blocks of 64 tokens, got 16"):
        vendors_mqa.paged_mqa_logits_metadata_deep_gemm(lens, 16, 4)
    q3 = q_fp8.new_zeros(3, 3, *q_fp8.shape[2:])
    with pytest.raises(ValueError, match="next_n 1 or 2"):
        vendors_mqa.paged_mqa_logits_deep_gemm(q3, cache, weights, lens, tables, None, 320)
    # Ours first for the paged form: a tie with DeepGEMM's through the op on an H100, and ours
    # serves every block size and next_n (registry.PAGED_MQA_ORDER).
    assert registry.default_order("small", "paged_mqa_logits")[:2] == ("triton", "deep_gemm")
    assert registry.default_order("small", "paged_mqa_logits_metadata")[:2] == ("triton", "deep_gemm")


@gpu
@pytest.mark.parametrize("backend", ["triton", "deep_gemm"])
@pytest.mark.parametrize("compressed", [0, 512])
def test_gpu_kernels_match_the_reference(backend, compressed):
    if registry.why_not(backend, registry.Request("mqa_logits", torch.device("cuda"), 64, 128)):
        pytest.skip(registry.why_not(backend, registry.Request("mqa_logits", torch.device("cuda"), 64, 128)))
    (_, _, _), args = fp8_inputs(300, 1000, 64, 128, device="cuda")
    ks = torch.randint(0, 500, (300,), dtype=torch.int32, device="cuda")
    ke = (ks + torch.randint(0, 500, (300,), dtype=torch.int32, device="cuda")).clamp(max=1000)
    want = rm.mqa_logits(*args, ks, ke, True, compressed)
    got = MQA(*args, ks, ke, True, compressed, backend)
    # laid out as the op's fake says (DeepGEMM's own rows are padded to its tile of keys)
    assert got.shape == want.shape and got.is_contiguous()
    inside = want != INF
    # fp32 sums in another order: measured below 1e-9 on an H100.
    assert calc_diff(got[inside], want[inside]) < 1e-6
    assert (got[~inside] == INF).all()


@gpu
@pytest.mark.parametrize("backend", ["triton", "deep_gemm"])
@pytest.mark.parametrize("next_n", [1, 2])
def test_gpu_paged_kernels_match_the_reference(backend, next_n):
    why = registry.why_not(backend, registry.Request("paged_mqa_logits", torch.device("cuda"), 64, 128))
    if why:
        pytest.skip(why)
    lens = (1000, 64, 4097, 1)
    q_fp8, cache, weights, lens_t, tables = paged_case(
        4, next_n, 64, 128, 64, lens, blocks=300, device="cuda"
    )
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sched = METADATA(lens_t, 64, sms, backend)
    want = rm.paged_mqa_logits(q_fp8, cache, weights, lens_t, tables, None, 4160)
    got = PAGED(q_fp8, cache, weights, lens_t, tables, sched, 4160, True, backend)
    assert got.shape == want.shape and got.is_contiguous()
    inside = want != INF
    assert calc_diff(got[inside], want[inside]) < 1e-6
    assert (got[~inside] == INF).all()


# --- the pass -------------------------------------------------------------------------------


class EinsumIndexer(nn.Module):
    """An indexer score written by hand: einsum, a softmax scale on q, relu, a weighted head sum."""

    def __init__(self, scale=0.125, sign=1.0):
        super().__init__()
        self.scale, self.sign = scale, sign

    def forward(self, q, k, w):  # q (B, S, H, D), k (B, T, D), w (B, S, H)
        s = torch.einsum("bshd,btd->bsht", q * self.scale, k).relu()
        return self.sign * (s * w.unsqueeze(-1)).sum(-2)


class SharedKeysIndexer(nn.Module):
    """Tokens of one sequence flattened: q (M, H, D) against k (N, D), fp32 math."""

    def forward(self, q, k, w):
        s = torch.relu(torch.matmul(q.float(), k.float().t()))  # (M, H, N)
        return torch.bmm(w.float().unsqueeze(1), s).squeeze(1)


class WeightsInsideRelu(nn.Module):
    """Not an indexer score: the weights multiply before the relu."""

    def forward(self, q, k, w):
        s = torch.einsum("bshd,btd->bsht", q, k)
        return (s * w.unsqueeze(-1)).relu().sum(-2)


def compile_fp8(model, *args, **options):
    backend = fp8compile.backend(**options)
    with torch.no_grad():
        out = torch.compile(model, backend=backend, dynamic=True)(*args)
    return out, backend.report


def indexer_inputs(b=2, s=24, t=24, h=16, d=32, device=DEVICE):
    q = torch.randn(b, s, h, d, device=device).to(BF16)
    k = torch.randn(b, t, d, device=device).to(BF16)
    w = torch.rand(b, s, h, device=device).to(BF16)
    return q, k, w


def test_pass_rewrites_a_hand_written_indexer_and_keeps_its_numbers():
    q, k, w = indexer_inputs()
    model = EinsumIndexer()
    out, report = compile_fp8(model, q, k, w)
    assert report.counts()["mqa_logits"] == 1
    want = torch.stack([exact_score(q[i] * 0.125, k[i], w[i]) for i in range(2)])
    assert calc_diff(out, want) < LOGITS_BOUND
    # Each sequence scores only its own keys: sequence 1 against sequence 0's keys would differ.
    assert calc_diff(out[1], exact_score(q[1] * 0.125, k[0], w[1])) > 0.05


def test_pass_rewrites_an_indexer_over_shared_keys():
    q, k, w = torch.randn(40, 16, 32).to(BF16), torch.randn(70, 32).to(BF16), torch.rand(40, 16).to(BF16)
    out, report = compile_fp8(SharedKeysIndexer(), q, k, w)
    assert report.counts()["mqa_logits"] == 1
    assert calc_diff(out, exact_score(q, k, w)) < LOGITS_BOUND


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        (WeightsInsideRelu(), None),  # no relu-then-weighted-sum shape: not a candidate
        (EinsumIndexer(sign=-1.0), "c > 0"),  # relu(-x) is not -relu(x): checked, left alone
    ],
)
def test_pass_leaves_other_computations_as_they_were(model, reason):
    q, k, w = indexer_inputs()
    with torch.no_grad():
        want = model(q, k, w)
    out, report = compile_fp8(model, q, k, w)
    assert report.counts()["mqa_logits"] == 0
    skips = report.skipped("mqa_logits")
    if reason is None:
        assert skips == []
    else:
        assert len(skips) == 1 and reason in skips[0].reason
    # Left as it was: Inductor's bf16 graph against eager, within a few bf16 ulps (2^-8 = 3.9e-3).
    torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-2)


GOLDEN = Path(__file__).parent / "golden" / "mqa_logits.diff"


def test_golden_graph_diff_of_a_hand_written_indexer(pass_diffs):
    """The einsum, relu and weighted head sum leave; q and k are quantized per row (amax, scale,
    cast), the scale constant and q's scales fold into the weights, and one
    fp8compile::mqa_logits scores each sequence's keys (windows b * T .. (b + 1) * T, compressed
    columns). Regenerate with FP8COMPILE_UPDATE_GOLDEN=1 after an intended change, and read it."""
    q, k, w = indexer_inputs(b=2, s=8, t=16, device="cpu")
    with torch.no_grad():
        out = torch.compile(
            EinsumIndexer(), backend=fp8compile.backend(fusions=("mqa_logits",)), dynamic=False
        )(q, k, w)
    want = torch.stack([exact_score(q[i] * 0.125, k[i], w[i]) for i in range(2)])
    assert calc_diff(out, want) < LOGITS_BOUND
    (diff,) = pass_diffs
    assert diff == golden_text(GOLDEN, diff)


def test_pass_runs_through_every_length_without_recompiling():
    fp8 = fp8compile.backend()
    model = torch.compile(EinsumIndexer(), backend=fp8, dynamic=True)
    with torch.no_grad():
        for s in (3, 17, 40, 2):  # (1 is a size Dynamo specializes: a graph of its own)
            q, k, w = indexer_inputs(b=1, s=s, t=s + 5)
            out = model(q, k, w)
            want = exact_score(q[0] * 0.125, k[0], w[0])
            assert calc_diff(out[0], want) < LOGITS_BOUND
    assert fp8.report.graphs == 1 and fp8.report.counts()["mqa_logits"] == 1


def test_a_static_graph_too_large_to_replay_stays_as_it_was_with_what_to_do(monkeypatch):
    """The pass checks a match by replaying it, at a static graph's own sizes; a long prefill's
    fp32 scores may not fit (M = N = 8192 on an H100: 17 GB of scores, 34 GB of expanded keys).
    Simulated here: the replay at static sizes runs out of memory. The indexer stays as it was,
    and the report says to compile with dynamic sizes, where the check runs at small sizes."""
    from fp8compile.passes import mqa_logits

    real = mqa_logits.run_subgraph

    def out_of_memory_when_static(ctx, env, output, symbols, what):
        if what == "the indexer score" and not symbols:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(ctx, env, output, symbols, what)

    monkeypatch.setattr(mqa_logits, "run_subgraph", out_of_memory_when_static)
    q, k, w = indexer_inputs(b=1, s=40, t=45)
    for dynamic, rewritten in ((False, 0), (True, 1)):
        torch._dynamo.reset()
        fp8 = fp8compile.backend()
        with torch.no_grad():
            out = torch.compile(EinsumIndexer(), backend=fp8, dynamic=dynamic)(q, k, w)
        assert fp8.report.counts()["mqa_logits"] == rewritten
        assert calc_diff(out[0], exact_score(q[0] * 0.125, k[0], w[0])) < LOGITS_BOUND
    torch._dynamo.reset()
    fp8 = fp8compile.backend()
    with torch.no_grad():
        torch.compile(EinsumIndexer(), backend=fp8, dynamic=False)(q, k, w)
    (skip,) = [s for s in fp8.report.skips if s.kind == "mqa_logits"]
    assert "static sizes" in skip.reason and "dynamic=True" in skip.reason, skip.reason


def deepseek_v32(topk: int, layers: int = 2):
    """DeepSeek-V3.2 at the architecture matrix's small sizes: a dense layer, then an MoE layer
    (layers=1: the dense one only; every layer has its indexer)."""
    from fp8compile import architectures

    config = architectures.small_config("deepseek_v32")
    config.index_topk = topk
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config).to(BF16).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
    return model.to(DEVICE)


def test_pass_rewrites_every_deepseek_v32_indexer(captured):
    model = deepseek_v32(topk=16, layers=1)
    ids = torch.randint(0, 200, (2, 64), device=DEVICE)
    fp8 = fp8compile.backend()
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        # at static shapes: dynamic ones are test_pass_runs_through_every_length_without_recompiling's
        # (a dynamic compile of this model took 17-25 s of the CPU suite, a static one 12)
        got = torch.compile(model, backend=fp8)(ids, use_cache=False).logits
    layers = len(model.model.layers)
    assert fp8.report.counts()["mqa_logits"] == layers
    names = {r.name for r in fp8.report.rewrites if r.kind == "mqa_logits"}
    assert names == {f"model.layers.{i}.self_attn.indexer" for i in range(layers)}
    after = captured[-1]
    assert after.count(torch.ops.fp8compile.mqa_logits.default) == layers
    assert after.ops(torch.ops.aten.relu.default) == []  # the fp32 score is gone
    assert torch.isfinite(got).all() and calc_diff(got.float(), want.float()) < DEEPSEEK_V32_BOUND


def test_deepseek_v32_indexer_keeps_the_bf16_top_k():
    model = deepseek_v32(topk=16, layers=1)
    indexer = model.model.layers[0].self_attn.indexer
    calls = []
    indexer.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append((args, kwargs)), with_kwargs=True
    )
    with torch.no_grad():
        model(torch.randint(0, 200, (2, 64), device=DEVICE), use_cache=False)
    args, kwargs = calls[0]
    unfused = fp8compile.backend(fusions=tuple(f for f in FUSIONS if f != "mqa_logits"))
    with torch.no_grad():
        want = indexer(*args, **kwargs)
        got = torch.compile(indexer, backend=fp8compile.backend(), dynamic=True)(*args, **kwargs)
        torch._dynamo.reset()
        # The unfused FP8 composition: the same FP8 projections, then the bf16/fp32 score of q and
        # k rounded to FP8 per row and dequantized (traced into the graph by Dynamo).
        composition = _dequantized_indexer(
            torch.compile(indexer, backend=unfused, dynamic=True), args, kwargs
        )
    assert got.shape == want.shape == (2, 64, 16)
    # Measured over seeds 0-2: 0.970, 0.970, 0.972 for both (the same selections).
    assert recall_of(want, got) >= recall_of(want, composition) - 0.005


def recall_of(want, got) -> float:
    a, b = want.flatten(0, 1), got.flatten(0, 1)
    return sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a, b)) / a.numel()


def _dequantized_indexer(indexer, args, kwargs):
    """The indexer with q and k rounded to FP8 per row before its bf16/fp32 score."""
    real = torch.matmul

    def rounded(a, b):
        if a.dtype == torch.float32 and a.dim() == 4 and b.dim() == 4 and b.shape[1] == 1:  # q @ k^T
            q8, qs = rm.quant_rows(a)
            k8, ks = rm.quant_rows(b.transpose(-1, -2))
            a = q8.float() * qs[..., None]
            b = (k8.float() * ks[..., None]).transpose(-1, -2)
        return real(a, b)

    torch.matmul = rounded
    try:
        return indexer(*args, **kwargs)
    finally:
        torch.matmul = real
