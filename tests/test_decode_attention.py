"""fp8compile::gqa_decode_attention, the split-KV decode attention the gqa_attention pass uses on a
GPU: the attention over repeat_kv'd keys and values, whatever the chunks, masks and layouts.
On the CPU in Triton's interpreter at small sizes; on the GPU at Llama-3-8B's, against cuDNN."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import fp8compile  # noqa: E402
from fp8compile import calc_diff  # noqa: E402
from fp8compile.ops.attention import op as attention_op, triton_attention  # noqa: E402
from fp8compile.passes.gqa_attention import grouped_sdpa  # noqa: E402
from tests.conftest import DEVICE, gpu  # noqa: E402

# The kernel rounds the probabilities to bf16 before multiplying them with V (as flash kernels
# do), and the output to bf16. Against an fp32 reference, the cases of the first test below
# measure calc_diff 9.1e-6..1.7e-5, split into chunks or not: the bf16 store (of the split
# kernel with one chunk, of the combine kernel with more) is truncated by Triton's CPU
# interpreter instead of rounded. The fp32 reference itself rounded to bf16 measures
# 1.3e-6..1.4e-6. Losing the second of the four chunks of 64 keys measures 0.15..0.30.
BF16_ATTENTION = 3e-5


def repeat_kv(x, rep):
    b, kv, length, d = x.shape
    return x[:, :, None].expand(b, kv, rep, length, d).reshape(b, kv * rep, length, d)


def reference(q, k, v, mask, scale, rep):
    """sdpa over repeat_kv'd keys and values in fp32; q (B, H, S, D)."""
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.float()
    return F.scaled_dot_product_attention(
        q.float(), repeat_kv(k.float(), rep), repeat_kv(v.float(), rep), attn_mask=mask, scale=scale
    )


def inputs(b, kv, rep, s, length, d, mask_kind, device=DEVICE):
    q = torch.randn(b, kv * rep, s, d, device=device).bfloat16()
    k, v = (torch.randn(b, kv, length, d, device=device).bfloat16() for _ in range(2))
    past = length - length // 4  # a static cache: the last quarter not written yet
    mask = None
    if mask_kind == "additive":  # (B, 1, S, L), what transformers' sdpa mask becomes
        mask = torch.zeros(b, 1, s, length, device=device)
        mask[..., past:] = float("-inf")
        mask = mask.bfloat16()
    elif mask_kind == "per_head":
        mask = torch.randn(b, kv * rep, s, length, device=device)
        mask[..., past:] = float("-inf")
    elif mask_kind == "bool":
        mask = torch.ones(b, 1, s, length, dtype=torch.bool, device=device)
        mask[..., past:] = False
    elif mask_kind == "2d":
        mask = torch.randn(s, length, device=device)
    return q, k, v, mask


def grouped(q, k, v, mask, scale, rep, chunk=0):
    b, h, s, d = q.shape
    out = attention_op.gqa_decode_attention(q.reshape(b, h // rep, rep * s, d), k, v, mask, scale, rep, chunk)
    return out.reshape(b, h // rep, rep, s, d).reshape(b, h, s, d)


@pytest.mark.parametrize("mask_kind", [None, "additive", "per_head", "bool", "2d"])
@pytest.mark.parametrize("s", [1, 3])
@pytest.mark.parametrize("chunk", [64, 128, 0])
def test_split_kv_attention_is_the_attention_over_repeated_kv(mask_kind, s, chunk):
    # 200 keys: chunks of 64 and 128 end past the last key; rep 4, 2 K/V heads
    q, k, v, mask = inputs(2, 2, 4, s, 200, 64, mask_kind)
    got = grouped(q, k, v, mask, 0.1, 4, chunk)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    assert calc_diff(got, reference(q, k, v, mask, 0.1, 4)) < BF16_ATTENTION


@pytest.mark.parametrize("mask_kind", ["additive", "bool"])
@pytest.mark.parametrize("length", [197, 208])
def test_a_mask_every_query_row_shares_is_read_a_row_a_step_where_its_rows_are_unaligned(mask_kind, length):
    # A (B, 1, 1, L) mask at one query token: every row of a work item reads the same mask row.
    # Over 197 keys the rows of the (B, H, S, L) tile do not start on 16 bytes, whether bool or
    # bf16, and the kernel loads the one row instead; over 208 they do and it loads the tile.
    q, k, v, mask = inputs(3, 2, 4, 1, length, 64, mask_kind)
    mask[1, ..., :70] = False if mask_kind == "bool" else float("-inf")  # left padding, one sequence
    assert triton_attention.one_mask_row(mask.expand(3, 8, 1, length), 1) == (length == 197)
    got = grouped(q, k, v, mask, 0.1, 4, chunk=64)
    assert calc_diff(got, reference(q, k, v, mask, 0.1, 4)) < BF16_ATTENTION


def test_the_mask_is_read_as_a_tile_where_its_rows_differ():
    # per head, or per query token of several: the rows of a work item read different mask rows
    per_head = torch.zeros(1, 8, 1, 197, dtype=torch.bool)
    tokens = torch.zeros(1, 1, 3, 197, dtype=torch.bool).expand(1, 8, 3, 197)
    assert not triton_attention.one_mask_row(per_head, 1)
    assert not triton_attention.one_mask_row(tokens, 3)
    assert not triton_attention.one_mask_row(None, 1)


def test_one_chunk_writes_the_output_itself_and_agrees_with_many():
    q, k, v, mask = inputs(1, 2, 4, 1, 130, 32, "additive")
    one, many = grouped(q, k, v, mask, 0.2, 4, chunk=192), grouped(q, k, v, mask, 0.2, 4, chunk=64)
    want = reference(q, k, v, mask, 0.2, 4)
    assert calc_diff(one, want) < BF16_ATTENTION and calc_diff(many, want) < BF16_ATTENTION


def test_chunks_with_no_key_weigh_nothing_and_a_row_with_none_gives_zeros():
    # Left padding masks the first chunks whole; sequence 1 has no key at all.
    q, k, v, _ = inputs(2, 1, 4, 1, 256, 32, None)
    mask = torch.zeros(2, 1, 1, 256, device=DEVICE)
    mask[0, ..., :150] = float("-inf")
    mask[1] = float("-inf")
    got = grouped(q, k, v, mask, 0.2, 4, chunk=64)
    assert not got.isnan().any()
    assert calc_diff(got[0], reference(q[:1], k[:1], v[:1], mask[:1], 0.2, 4)[0]) < BF16_ATTENTION
    assert torch.equal(got[1], torch.zeros_like(got[1]))


def test_the_combine_kernel_weighs_many_chunks_by_their_log_sum_exp():
    # 37 chunks: three steps of the kernel's 16, the last partial; a head whose first 20 chunks
    # saw no key (lse -inf), a row that saw none at all; R and D not powers of two.
    b, kv, chunks, rows, d = 2, 3, 37, 5, 40
    o = torch.randn(b, kv, chunks, rows, d)
    lse = 3 * torch.randn(b, kv, chunks, rows)
    lse[0, 0, :20] = float("-inf")
    lse[1, 2, :, 1] = float("-inf")
    out = torch.empty(b, kv, rows, d, dtype=torch.bfloat16)
    grid, args, constexprs = triton_attention.combine_arguments(o, lse, out)
    triton_attention._gqa_combine_kernel[grid](*args, **constexprs)
    w = torch.softmax(lse.double(), dim=2).nan_to_num(0.0)  # the row with no key: all weights 0
    want = (w[..., None] * o.double()).sum(2)
    assert torch.equal(out[1, 2, 1], torch.zeros(d, dtype=torch.bfloat16))
    # measured 5.2e-6..5.9e-6 over three seeds: the bf16 store, which the interpreter truncates
    assert calc_diff(out, want) < BF16_ATTENTION


def test_the_combine_kernel_takes_the_chunk_count_at_run_time():
    # A cache that grows gives a symbolic key count, so a symbolic chunk count: a compile-time
    # constant taken from it would guard on it, and the graph would recompile as the cache grows.
    def constexprs(chunks):
        o, lse = torch.empty(1, 2, chunks, 4, 64), torch.empty(1, 2, chunks, 4)
        return triton_attention.combine_arguments(o, lse, torch.empty(1, 2, 4, 64))[2]

    assert constexprs(2) == constexprs(37) == constexprs(300)


@pytest.mark.parametrize("heads_outer", [True, False])
def test_the_pass_function_lays_the_split_kv_output_out_as_sdpa_did(heads_outer):
    q, k, v, mask = inputs(2, 2, 3, 2, 96, 32, "additive")
    got = grouped_sdpa(q, k, v, mask, 0.25, 3, heads_outer, split_keys=True, chunk=64)
    assert calc_diff(got, reference(q, k, v, mask, 0.25, 3)) < BF16_ATTENTION
    assert (got if heads_outer else got.transpose(1, 2)).is_contiguous(), got.stride()


def test_keys_not_at_unit_stride_along_the_head_dimension_are_read_right():
    q, k, v, mask = inputs(1, 2, 4, 1, 96, 32, "additive")
    k_t, v_t = (t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (k, v))
    assert k_t.stride(-1) != 1
    assert (
        calc_diff(grouped(q, k_t, v_t, mask, 0.2, 4, 64), reference(q, k, v, mask, 0.2, 4)) < BF16_ATTENTION
    )


def test_the_op_schema_and_autograd_registration_pass_opcheck():
    # The fake and traced checks run the op on fake tensors: on the CPU Triton's interpreter
    # would run the kernel there, so they are the GPU test's below.
    q, k, v, mask = inputs(1, 2, 4, 1, 96, 32, "additive")
    torch.library.opcheck(
        torch.ops.fp8compile.gqa_decode_attention.default,
        (q.reshape(1, 2, 4, 32), k, v, mask, 0.2, 4, 64),
        test_utils=("test_schema", "test_autograd_registration"),
    )


@gpu
def test_on_the_gpu_the_op_passes_opcheck_with_fake_tensors_and_dynamic_shapes():
    q, k, v, mask = inputs(2, 8, 4, 1, 1152, 128, "additive")
    torch.library.opcheck(
        torch.ops.fp8compile.gqa_decode_attention.default,
        (q.reshape(2, 8, 4, 128), k, v, mask, 128**-0.5, 4, 0),
        test_utils=("test_faketensor", "test_aot_dispatch_dynamic"),
    )


def test_a_chunk_that_is_not_a_multiple_of_the_key_step_is_refused():
    q, k, v, _ = inputs(1, 1, 4, 1, 64, 32, None)
    with pytest.raises(ValueError, match="multiple of 64"):
        grouped(q, k, v, None, 0.2, 4, chunk=100)


def test_chunks_fill_the_gpu_about_twice_and_never_go_below_one_key_step():
    cuda = torch.device("cuda", 0)
    fill = 2 * 132  # an H100 or H200

    def chunks(length, batch, kv=8):
        return -(-length // triton_attention.chunk_keys(length, batch, kv, cuda))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_attention, "num_sms", lambda index: fill // 2)
        assert chunks(1152, 1) == 18  # 33 wanted; 64 keys each at least
        assert chunks(4096, 1) == 32 and chunks(4096, 4) == 8  # 4 x 8 x 8 = 256 items
        assert chunks(1152, 64) == 1


def test_the_op_launched_another_way_computes_the_same_attention():
    # 128 keys a step, 8 warps, 2 stages, 4 programs an SM: what `bench tune --kernels
    # gqa_decode` times beside the op's own launch; chunks of 128 over 200 keys (two, the second
    # partial)
    q, k, v, mask = inputs(2, 2, 4, 1, 200, 64, "bool")
    b, h, s, d = q.shape
    launch = triton_attention.Launch(block_l=128, num_warps=8, num_stages=2, programs_per_sm=4)
    got = attention_op.split_kv_attention(q.reshape(b, 2, 4 * s, d), k, v, mask, 0.1, 4, 128, launch)
    assert calc_diff(got.reshape(b, h, s, d), reference(q, k, v, mask, 0.1, 4)) < BF16_ATTENTION
    with pytest.raises(ValueError, match="multiple of 128"):
        attention_op.split_kv_attention(q.reshape(b, 2, 4 * s, d), k, v, mask, 0.1, 4, 64, launch)


def test_more_programs_an_sm_cut_the_keys_into_more_chunks():
    cuda = torch.device("cuda", 0)
    four = triton_attention.Launch(programs_per_sm=4)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_attention, "num_sms", lambda index: 132)
        assert -(-4096 // triton_attention.chunk_keys(4096, 1, 8, cuda)) == 32
        assert -(-4096 // triton_attention.chunk_keys(4096, 1, 8, cuda, four)) == 64
        assert triton_attention.programs_to_fill(cuda, four) == 4 * 132


def test_the_shared_memory_bound_covers_what_triton_compiles_for_sm_90_and_sm_89():
    # A launch whose bound is under what the kernel asks for would crash on the GPU it was
    # fitted to. Triton 3.7.1 asks 6-12% under the bound at these launches, 33% under at one stage.
    from tests import sm_compile

    pytest.importorskip("triton.backends.nvidia")
    Launch = triton_attention.Launch
    cases = [
        (triton_attention.LAUNCH, 4, 1, 128, "*i1"),  # Llama-3-8B at decode
        (triton_attention.WIDE_LAUNCH, 2, 1, 256, "*bf16"),  # Gemma at decode
        (triton_attention.LAUNCH, 2, 1, 256, "*bf16"),
        (triton_attention.WIDE_LAUNCH, 2, 32, 256, "*i1"),  # Gemma, 32 query tokens
        (triton_attention.WIDE_LAUNCH, 8, 8, 256, "*i1"),  # 8 query heads a K/V head, 8 tokens
        (Launch(num_warps=8, num_stages=2, programs_per_sm=1), 8, 8, 256, "*i1"),  # fitted() there
        (Launch(block_l=128, num_stages=4), 4, 4, 64, "*fp32"),
        (Launch(block_l=32, num_stages=1), 8, 8, 128, "*bf16"),
    ]
    # An Ada GPU (sm_89, 101376 bytes a block): Gemma's heads at decode, and what fitted() gives them
    wide = triton_attention.WIDE_LAUNCH
    ada = [(wide, 2, 1, 256, "*bf16"), (dataclasses.replace(wide, num_stages=2), 2, 1, 256, "*bf16")]

    def launch(la, rep, s, d, mask_type, capability=90):
        mask = triton_attention.MASK_BOOL if mask_type == "*i1" else triton_attention.MASK_ADD
        constexprs = dict(
            SCALE=d**-0.5,
            KV=8,
            REP=rep,
            S=s,
            D=d,
            BLOCK_R=max(16, triton_attention.next_pow2(rep * s)),
            BLOCK_D=max(16, triton_attention.next_pow2(d)),
            BLOCK_L=la.block_l,
            MASK=mask,
            MASK_ROW=False,
            WRITE_LSE=True,
            DOT_F32=False,
        )
        pointers = dict(
            q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", mask_ptr=mask_type, o_ptr="*fp32", lse_ptr="*fp32"
        )
        return dict(
            kernel="fp8compile.ops.attention.triton_attention:_gqa_decode_kernel",
            capability=capability,
            pointers=pointers,
            constexprs=constexprs,
            ones=["stride_ml"],
            num_warps=la.num_warps,
            num_stages=la.num_stages,
        )

    got = sm_compile.shared_bytes([launch(*case) for case in cases] + [launch(*case, 89) for case in ada])
    sizes = {"*i1": 1, "*bf16": 2, "*fp32": 4}
    bounds = [triton_attention.shared_bytes(la, rep * s, d, sizes[m]) for la, rep, s, d, m in cases + ada]
    assert all(g <= b for g, b in zip(got, bounds)), list(zip(cases + ada, got, bounds))
    # 32 query tokens of Gemma's heads, and 8 of 8 heads, ask 237568 bytes: more than an H100 or
    # H200 has (232448); the launch fitted() gives them fits
    assert got[3] == got[4] > 232448 >= got[5]
    assert triton_attention.fitted(wide, 2, 256, 2, 101376) == ada[1][0]
    assert got[-2] > 101376 >= got[-1]  # on Ada, Gemma's decode: 145408 bytes, fitted 77824


def test_a_launch_is_fitted_to_the_gpus_shared_memory_stages_first_then_keys_a_step():
    fitted, launch = triton_attention.fitted, triton_attention.LAUNCH
    h100, a100, ada = 232448, 166912, 101376  # bytes one block may opt in to
    assert fitted(launch, 4, 128, 1, ada) == launch  # Llama's heads fit everywhere
    assert fitted(launch, 2, 256, 2, h100) == launch  # Gemma's on Hopper: the tuned launch
    assert fitted(launch, 64, 256, 1, h100) == triton_attention.Launch(num_stages=2)
    assert fitted(launch, 64, 256, 2, ada) == triton_attention.Launch(block_l=16, num_stages=2)
    for budget in (h100, a100, ada):
        for rows in (1, 16, 64):
            for d in (64, 128, 256):
                got = fitted(launch, rows, d, 4, budget)
                assert triton_attention.shared_bytes(got, rows, d, 4) <= budget
                assert launch.block_l % got.block_l == 0  # a chunk of the op's launch still divides
    assert fitted(launch, 64, 256, 4, 16384) is None


def test_the_ops_launch_on_a_gpu_is_fitted_to_its_shared_memory_and_none_when_none_fits():
    cuda = torch.device("cuda", 0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_attention, "shared_memory", lambda index: 101376)  # an Ada GPU
        wide = triton_attention.WIDE_LAUNCH
        assert triton_attention.launch_on(cuda, 2, 256, None) == dataclasses.replace(wide, num_stages=2)
        patch.setattr(triton_attention, "shared_memory", lambda index: 16384)
        assert triton_attention.launch_on(cuda, 2, 256, None) is None  # supports() then says why
    assert triton_attention.launch_on(torch.device("cpu"), 64, 256, None) == triton_attention.WIDE_LAUNCH
    assert triton_attention.launch_on(torch.device("cpu"), 4, 128, None) == triton_attention.LAUNCH


def test_the_launch_sweep_checks_every_launch_against_fp32_and_names_a_wrong_one(
    tmp_path, monkeypatch, capsys
):
    from fp8compile.bench import attention

    launches = [
        triton_attention.LAUNCH,
        triton_attention.Launch(block_l=128),
        triton_attention.Launch(num_warps=8),
    ]
    split_kv = attention_op.split_kv_attention

    def broken_at_128(q, k, v, mask, scale, rep, chunk, launch):
        out = split_kv(q, k, v, mask, scale, rep, chunk, launch)
        return out.flip(-1) if launch.block_l == 128 else out

    monkeypatch.setattr(attention_op, "split_kv_attention", broken_at_128)
    points = [(1, 130), (1, 70, attention.GEMMA)]  # Llama's heads, then Gemma's (D = 256)
    rows = attention.tune_gqa_decode(tmp_path, points=points, sweep=launches, device=torch.device(DEVICE))
    llama = ["(64, 4, 3, 2)", "(128, 4, 3, 2)", "(64, 8, 3, 2)"]
    assert [r["launch"] for r in rows] == llama + ["(64, 8, 3, 1)"] + llama  # D = 256: WIDE_LAUNCH first
    assert [r["heads"] for r in rows] == [str(attention.LLAMA)] * 3 + [str(attention.GEMMA)] * 4
    assert [r["default"] for r in rows] == [True, False, False] + [True, False, False, False]
    assert [r["calc_diff"] < attention.WRONG for r in rows] == [True, False, True] + [True, True, False, True]
    assert "(128, 4, 3, 2) wrong" in capsys.readouterr().out
    assert (tmp_path / "tune_gqa_decode.json").exists()


def test_the_launch_sweep_reports_a_launch_too_big_for_the_gpu_and_times_the_rest(
    tmp_path, monkeypatch, capsys
):
    from triton.runtime.errors import OutOfResources

    from fp8compile.bench import attention

    split_kv = attention_op.split_kv_attention

    def short_of_shared_memory(q, k, v, mask, scale, rep, chunk, launch):
        if launch.block_l == 128:  # as Triton refuses to load a kernel that asks too much
            raise OutOfResources(274432, 232448, "shared memory")
        return split_kv(q, k, v, mask, scale, rep, chunk, launch)

    monkeypatch.setattr(attention_op, "split_kv_attention", short_of_shared_memory)
    sweep = [triton_attention.LAUNCH, triton_attention.Launch(block_l=128)]
    rows = attention.tune_gqa_decode(
        tmp_path, points=[(1, 70, attention.GEMMA)], sweep=sweep, device=torch.device(DEVICE)
    )
    # the op's launch at D = 256 (WIDE_LAUNCH) leads the sweep
    assert [r["calc_diff"] is None for r in rows] == [False, False, True]
    assert rows[0]["default"] and rows[0]["calc_diff"] < attention.WRONG
    assert "(128, 4, 3, 2) does not fit" in capsys.readouterr().out


def test_split_kv_is_a_bool_option_on_by_default():
    assert fp8compile.Fp8Config().split_kv is True
    with pytest.raises(TypeError, match="split_kv"):
        fp8compile.Fp8Config(split_kv="yes")


@gpu
@pytest.mark.parametrize("length", [1057, 1152, 4096])  # 1057: the mask read a row a step
@pytest.mark.parametrize("batch", [1, 4, 64])
@pytest.mark.parametrize("mask_kind", ["additive", "bool"])
def test_on_the_gpu_split_kv_is_as_accurate_as_cudnn_at_llama_sizes(length, batch, mask_kind):
    q, k, v, mask = inputs(batch, 8, 4, 1, length, 128, mask_kind)
    want = reference(q, k, v, mask, 128**-0.5, 4)
    cudnn_mask = mask if mask_kind == "additive" else torch.where(mask, 0.0, float("-inf")).bfloat16()
    cudnn = grouped_sdpa(q, k, v, cudnn_mask, None, 4, True)
    got = grouped(q, k, v, mask, 128**-0.5, 4)
    # Measured on an H200 at these sizes (BENCHMARKS.md, 2026-11-26 (01816bf)): relative error
    # 0.0022-0.0025 against cuDNN's 0.0024-0.0025, so at most cuDNN's; 1.5x leaves room for seeds.
    assert calc_diff(got, want) <= 1.5 * calc_diff(cudnn, want) + 1e-7


@gpu
@pytest.mark.parametrize("rep, s", [(2, 32), (8, 8)])
def test_on_the_gpu_64_query_rows_of_width_256_take_a_launch_that_fits_its_shared_memory(rep, s):
    # The op's own launch asks 237568 bytes here (Triton 3.7.1), more than an H100 or H200 has.
    q, k, v, mask = inputs(2, 2, rep, s, 1057, 256, "bool")
    got = grouped(q, k, v, mask, 256**-0.5, rep)
    assert calc_diff(got, reference(q, k, v, mask, 256**-0.5, rep)) < BF16_ATTENTION


@gpu
def test_on_the_gpu_inductor_launches_the_combine_kernel_and_generates_none_for_it():
    """The chunks are combined by a fixed Triton kernel. As ATen ops the combine was a reduction
    that Inductor lowered and generated a kernel for at every layer: 6.7 s of a 32-layer Llama's
    first call on an H200 (BENCHMARKS.md, 2026-11-26 (9414b3b))."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    q, k, v, mask = inputs(2, 8, 4, 1, 1152, 128, "additive")  # 18 chunks of 64 keys

    def attention(q, k, v, mask):
        return grouped(q, k, v, mask, 128**-0.5, 4, chunk=64)

    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        out, codes = run_and_get_code(torch.compile(attention, dynamic=False), q, k, v, mask)
    code = "\n".join(codes)
    assert "_gqa_decode_kernel" in code and "_gqa_combine_kernel" in code
    assert "triton_red_" not in code and "triton_per_" not in code, "Inductor generated a reduction"
    # the same two kernels as the op called directly (compiled with Inductor's argument hints)
    assert calc_diff(out, attention(q, k, v, mask)) < 1e-6


@gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_on_the_gpu_a_static_cache_decode_runs_split_kv_with_the_tokens_of_sdpa(mode):
    from fp8compile.bench.decode import static_cache
    from fp8compile.demo import small_llama

    def _generate(model, ids, backend, mode, steps=6):
        torch._dynamo.reset()
        model.forward = torch.compile(type(model).forward.__get__(model), backend=backend, mode=mode)
        try:
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=steps,
                do_sample=False,
                past_key_values=static_cache(model, ids.shape[0], ids.shape[1] + steps, "cuda"),
                output_logits=True,
                return_dict_in_generate=True,
            )
        finally:
            del model.forward
        return out.sequences, out.logits

    model = small_llama().cuda()  # 4 query heads on 2 K/V heads
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, 32000, (2, 12), device="cuda")
    split = fp8compile.backend(fusions=("gqa_attention",), skip=("*",))
    sdpa = fp8compile.backend(fusions=("gqa_attention",), skip=("*",), split_kv=False)
    with torch.no_grad():
        tokens, logits = _generate(model, ids, split, mode=mode)
        want_tokens, want_logits = _generate(model, ids, sdpa, mode=mode)
    decode = [r for r in split.report.rewrites if r.kind == "attention" and r.graph == 1]
    assert decode and all(r.kernels == (("S = 1", "sdpa split-KV (fp8compile)"),) for r in decode)
    assert all("split-KV" not in r.kernels[0][1] for r in sdpa.report.rewrites)
    # on a GPU the report says why sdpa's kernel runs
    assert all(
        r.detail == "gqa 4/2 heads; not split-KV: Fp8Config(split_kv=False)" for r in sdpa.report.rewrites
    )
    assert torch.equal(tokens, want_tokens)
    assert max(calc_diff(a.float(), b.float()) for a, b in zip(logits, want_logits)) < 1e-4
