"""The all_reduce_norm pass and fp8compile::all_reduce_rms_norm (ops/collectives/): a sharded
decoder's all-reduce, the residual add after it and the RMSNorm of the sum become one op, one
Triton kernel on symmetric memory where it serves the graph's sizes.

On the CPU, over a gloo group of one rank: what the pass matches and leaves, the report's words,
and the op's fallback rounding as transformers' RMSNorm does. Symmetric memory serves CUDA
tensors only, so the CPU tests that rewrite stand in for the kernel's yes (kernel_refuses
patched): the op then runs its fallback, the group's all-reduce and the same arithmetic. The
kernel itself runs on the CPU under Triton's interpreter (one rank, and three in processes of
their own), is compiled for Hopper to read its PTX, and runs on two GPUs in the gpu test at the
end.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fp8compile
from fp8compile.backend import FP8COMPILE_ALL_REDUCE, FP8COMPILE_ALL_REDUCE_NORM
from fp8compile.config import FUSIONS
from fp8compile.ops.collectives import op as collectives, reference, symmetric
from fp8compile.passes import all_reduce_norm
from tests import ranks
from tests.conftest import golden_text

transformers = pytest.importorskip("transformers")
from fp8compile.demo import small_llama  # noqa: E402

BF16 = torch.bfloat16
WITHOUT_NORM = tuple(f for f in FUSIONS if f != "all_reduce_norm")


@pytest.fixture
def kernel_serves(monkeypatch):
    """The pass rewrites as on GPUs whose symmetric memory serves every site (on the CPU it
    serves none): the op's fallback then runs."""
    monkeypatch.setattr(all_reduce_norm, "kernel_refuses", lambda site: None)


class ShardedBlock(nn.Module):
    """A row-sharded projection's partial, summed over the ranks, added to the residual, and the
    sum normalized by `norm` (transformers' LlamaRMSNorm unless given)."""

    def __init__(self, norm: nn.Module | None = None):
        super().__init__()
        self.proj = nn.Linear(256, 256, bias=False)
        self.norm = norm or transformers.models.llama.modeling_llama.LlamaRMSNorm(256, eps=1e-5)
        with torch.no_grad():
            self.norm.weight.normal_(1.0, 0.1)

    def forward(self, x, residual):
        from torch.distributed import _functional_collectives as funcol

        summed = residual + funcol.all_reduce(self.proj(x), "sum", dist.group.WORLD)
        return self.norm(summed), summed


class GemmaStyleNorm(nn.Module):
    """An RMSNorm of another form: Gemma's, scaled by 1 + weight in fp32."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width))
        self.eps = 1e-6

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def _compiled(module, *args, dynamic=False, fusions=FUSIONS, **options):
    """module compiled by the fp8 backend in reduce-overhead (every fusion unless `fusions` says
    otherwise), run on args."""
    fp8 = fp8compile.backend(fusions=fusions, **options)
    with torch.no_grad():
        out = torch.compile(module, backend=fp8, dynamic=dynamic, mode="reduce-overhead")(*args)
    return out, fp8.report


def _inputs(rows=4):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(rows, 256, generator=gen).to(BF16), torch.randn(rows, 256, generator=gen).to(BF16)


@pytest.mark.inductor
def test_each_all_reduce_a_residual_add_and_an_rmsnorm_follow_becomes_one_op(one_rank_group, kernel_serves):
    """A tiny sharded Llama (two layers): o's all-reduce feeds the post-attention norm, down's
    the next layer's input norm or the final norm: four sites, all fused; the logits as unfused."""
    from fp8compile import tensor_parallel

    model = small_llama(vocab=512, hidden=256, intermediate=512, layers=2)
    tensor_parallel.shard(model)
    ids = torch.randint(0, 512, (1, 4), generator=torch.Generator().manual_seed(0))
    fused, report = _compiled(model, ids)
    torch._dynamo.reset()
    unfused, unfused_report = _compiled(model, ids, fusions=WITHOUT_NORM)
    assert report.collectives[0] == {FP8COMPILE_ALL_REDUCE_NORM: 4, "all_gather_into_tensor": 1}
    assert unfused_report.collectives[0] == {FP8COMPILE_ALL_REDUCE: 4, "all_gather_into_tensor": 1}
    words = "4 of 4 all-reduces with the residual add and RMSNorm after them in one kernel"
    assert report.all_reduce_paths["graph 0, with the RMSNorm after"] == words
    assert f"all-reduces, graph 0, with the RMSNorm after: {words}" in str(report)
    with torch.no_grad():
        eager = model(ids).logits
    # the fused op rounds as the eager model (the sum, then the normalized row); Inductor's one
    # kernel for the add and norm keeps fp32 between them: FP8's linears see either, within 1.15x
    fused_diff, unfused_diff = (fp8compile.calc_diff(o.logits, eager) for o in (fused, unfused))
    assert fused_diff <= 1.15 * unfused_diff, (fused_diff, unfused_diff)


def test_the_ops_fallback_sums_adds_and_normalizes_as_transformers_rmsnorm(one_rank_group):
    x, residual = _inputs()
    norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(256, eps=1e-5).to(BF16)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
        normed, summed = torch.ops.fp8compile.all_reduce_rms_norm(
            x, residual, norm.weight, 1e-5, one_rank_group
        )
        assert torch.equal(summed, residual + x)  # one rank's sum is its partial
        assert torch.equal(normed, norm(residual + x))
    assert collectives.push_refuses(4, 256, BF16, x.device, one_rank_group).startswith(
        "symmetric memory serves CUDA tensors"
    )


GOLDEN = Path(__file__).parent / "golden" / "all_reduce_norm.diff"


def test_golden_graph_diff_of_an_all_reduce_with_its_residual_add_and_rmsnorm(
    one_rank_group, kernel_serves, pass_diffs
):
    """The functional all_reduce and its wait, the add and the RMSNorm's eight nodes leave;
    fp8compile.all_reduce_rms_norm takes the partial, the residual, the norm's weight and eps, and
    its two outputs take the norm's place and the sum's (the projection left bf16: skip="*").
    Regenerate with FP8COMPILE_UPDATE_GOLDEN=1 after an intended change, and read the diff."""
    module = ShardedBlock().to(BF16)
    x, residual = _inputs()
    (normed, summed), _ = _compiled(
        module, x, residual, fusions=("all_reduce", "all_reduce_norm"), skip=("*",)
    )
    with torch.no_grad():
        expected = module(x, residual)
    assert torch.equal(summed, expected[1]) and torch.equal(normed, expected[0])
    (diff,) = pass_diffs
    assert diff == golden_text(GOLDEN, diff)


def test_on_the_cpu_the_pass_leaves_the_three_and_the_report_says_why(one_rank_group):
    _, report = _compiled(ShardedBlock().to(BF16), *_inputs())
    assert report.collectives == {0: {FP8COMPILE_ALL_REDUCE: 1}}
    assert report.all_reduce_paths["graph 0, with the RMSNorm after"] == (
        "0 of 1 all-reduces with the residual add and RMSNorm after them in one kernel; the rest as they "
        "were: 1: symmetric memory serves CUDA tensors; these are cpu"
    )


def test_a_graph_of_symbolic_rows_keeps_the_three_the_kernel_could_not_size(one_rank_group):
    """Fused at every call or nowhere: a graph whose row count is a symbol would fall back to the
    eager arithmetic at sizes the kernel does not serve, slower than Inductor's one kernel."""
    _, report = _compiled(ShardedBlock().to(BF16), *_inputs(5), dynamic=True)
    assert (
        "the rest as they were: 1: the rows are not a known number"
        in report.all_reduce_paths["graph 0, with the RMSNorm after"]
    )


def test_a_norm_of_another_form_is_not_matched(one_rank_group, kernel_serves):
    _, report = _compiled(ShardedBlock(GemmaStyleNorm(256)).to(BF16), *_inputs())
    assert report.collectives == {0: {FP8COMPILE_ALL_REDUCE: 1}}
    assert "graph 0, with the RMSNorm after" not in report.all_reduce_paths


def test_the_fusion_runs_by_default(one_rank_group, kernel_serves):
    """Measured faster than the all-reduce and Inductor's norm kernel (config.DEFAULT_FUSIONS)."""
    defaults = fp8compile.Fp8Config().fusions
    assert "all_reduce_norm" in defaults
    _, report = _compiled(ShardedBlock().to(BF16), *_inputs(), fusions=defaults)
    assert report.collectives == {0: {FP8COMPILE_ALL_REDUCE_NORM: 1}}


def test_the_kernel_refuses_what_it_cannot_hold_before_looking_for_a_buffer(monkeypatch):
    cuda = torch.device("cuda", 0)  # only its type is read before the buffer
    monkeypatch.setattr(collectives, "_multiprocessors", lambda device: 132)
    assert collectives.push_refuses(1, 4096, torch.float8_e4m3fn, cuda, "0").startswith("torch.float8_e4m3fn")
    assert collectives.push_refuses(1, 32768, BF16, cuda, "0") == (
        "rows of 32768, past the 16384 the kernel holds in registers"
    )
    too_many = symmetric.BUFFER_BYTES // (2 * 4096) + 1
    assert "not a whole number of 16-byte units in the buffer" in collectives.push_refuses(
        too_many, 4096, BF16, cuda, "0"
    )
    assert "not a whole number" in collectives.push_refuses(1, 4095, BF16, cuda, "0")
    # a program a row, each waiting on its peers' programs of the row: no more rows than SMs
    assert collectives.push_refuses(133, 1024, BF16, cuda, "0") == (
        "133 rows, more than the GPU's 132 multiprocessors (a program a row, each waiting on its peers')"
    )


def _sentinel_only(buffer: torch.Tensor) -> bool:
    bits = buffer.element_size() * 8
    as_int = buffer.view(torch.int16 if bits == 16 else torch.int32)
    return bool((as_int == symmetric.SENTINEL_BITS[bits]).all())


@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32])
def test_the_kernel_on_one_rank_sums_normalizes_and_leaves_its_buffer_holding_the_sentinel(dtype):
    """The kernel on the CPU (Triton's interpreter, one rank: its buffer a plain tensor filled
    as symmetric.push_buffers fills it), in each dtype an RMSNorm's input comes in. Four calls
    back to back, past the buffer's three thirds: each sum exact (integers), each norm within two
    bf16 units, the epoch advanced once a call, and every slot holding the sentinel again. A
    partial of -0.0, the sentinel's bits, travels as +0.0."""
    pytest.importorskip("triton")
    from fp8compile.ops.collectives import triton_push

    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randint(-8, 9, (3, 320), generator=gen).to(dtype) for _ in range(2))
    x[0, :4] = -0.0
    residual[0, :2] = -0.0
    weight = (1 + 0.1 * torch.randn(320, generator=gen)).to(dtype)
    buffer = symmetric.sentinel_fill(torch.empty(3 * 3 * 320 + 5, dtype=dtype))
    epoch = torch.zeros(2, dtype=torch.int32)
    for call in range(4):
        normed, summed = triton_push.all_reduce_rms_norm(
            x * (call + 1), residual, weight, EPS, (buffer,), epoch, rank=0
        )
        expected = reference.add_rms_norm(x * (call + 1), residual, weight, EPS)
        assert torch.equal(summed, expected[1]), call  # == takes -0.0 for +0.0: the signs below
        assert _relative(normed, expected[0]) <= 2**-6, call  # two roundings, each dropping bits here
        assert epoch.tolist() == [call + 1, 0] and _sentinel_only(buffer), call
    # -0.0 + -0.0 is -0.0 in the eager model; pushed as +0.0, the sum's zero is +0.0
    assert not summed[0, :2].signbit().any()
    assert torch.equal(summed[0, 2:4].signbit(), expected[1][0, 2:4].signbit())


def _interpreted_rank(rank, port, out_dir, xs, residual, weight, buffers, epochs, summed, rows):
    """One rank of the kernel under Triton's interpreter: the buffers are host memory every
    rank's process maps (shared tensors), as symmetric memory's ranks map their peers'."""
    from fp8compile.ops.collectives import triton_push

    for call, m in enumerate(rows):  # back to back, the rows of each call its own
        ranks.mark(out_dir, rank, f"call {call}")
        x = xs[rank][:m] * (call + 1)
        if call % 2:  # every other call the sum alone, as fp8compile::all_reduce runs it
            out = triton_push.all_reduce_sum(x, tuple(buffers), epochs[rank], rank)
        else:
            _, out = triton_push.all_reduce_rms_norm(
                x, residual[:m], weight, EPS, tuple(buffers), epochs[rank], rank
            )
        summed[rank][call][:m].copy_(out)
    ranks.mark(out_dir, rank, "done")


def test_on_three_interpreted_ranks_the_kernel_sums_in_rank_order_through_every_third(tmp_path):
    """The push protocol across ranks on the CPU: three processes, five calls back to back (past
    the three thirds, of 3, 1, 2, 3 and 1 rows, every other one the sum alone). Each rank's sum
    is the partials added in fp32 and rounded once (integers: exact in bf16), the residual added
    where the call adds it, every rank's epoch counts the calls, and the buffers hold nothing but
    the sentinel after the last."""
    pytest.importorskip("triton")
    world, h, rows = 3, 320, (3, 1, 2, 3, 1)
    m = max(rows)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randint(-8, 9, (m, h), generator=gen).to(BF16).share_memory_() for _ in range(world)]
    residual = torch.randint(-8, 9, (m, h), generator=gen).to(BF16).share_memory_()
    weight = (1 + 0.1 * torch.randn(h, generator=gen)).to(BF16).share_memory_()
    buffers = [symmetric.sentinel_fill(torch.empty(3 * m * world * h, dtype=BF16)).share_memory_()]
    buffers += [
        symmetric.sentinel_fill(torch.empty_like(buffers[0])).share_memory_() for _ in range(world - 1)
    ]
    epochs = [torch.zeros(2, dtype=torch.int32).share_memory_() for _ in range(world)]
    summed = [torch.zeros(len(rows), m, h, dtype=BF16).share_memory_() for _ in range(world)]
    args = (xs, residual, weight, buffers, epochs, summed, rows)
    ranks.spawn(_interpreted_rank, world, tmp_path, 120, *args)
    for call, n in enumerate(rows):
        partials = sum(x[:n].float() * (call + 1) for x in xs).to(BF16)
        expected = partials if call % 2 else (residual[:n].float() + partials.float()).to(BF16)
        assert all(torch.equal(summed[rank][call][:n], expected) for rank in range(world)), call
    assert all(e.tolist() == [len(rows), 0] for e in epochs)
    assert all(_sentinel_only(b) for b in buffers)


def _hopper_launch(world: int) -> dict:
    """The kernel at `world` ranks and a width of 4096, bf16, for tests/sm_compile (sm_90, PTX
    only); skips where this Triton has no NVIDIA backend to compile it with."""
    triton = pytest.importorskip("triton")
    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("this Triton has no NVIDIA backend")
    from fp8compile.ops.collectives import triton_push

    pointers = ["x_ptr", "residual_ptr", "weight_ptr", "normed_ptr", "summed_ptr", "own_ptr"]
    pointers += [f"b{i}" for i in range(triton_push.MAX_WORLD)]
    return dict(
        kernel="fp8compile.ops.collectives.triton_push:_push_all_reduce_kernel",
        capability=90,
        pointers={**dict.fromkeys(pointers, "*bf16"), "epoch_ptr": "*i32", "rank": "i32", "eps": "fp32"},
        constexprs=dict(
            WORLD=world,
            BITS=16,
            SENTINEL=symmetric.SENTINEL_BITS[16],
            NORM=True,
            THIRDS_OF=symmetric.THIRDS,
            BLOCK=4096,
        ),
        num_warps=triton_push.NUM_WARPS,
        num_stages=1,
    )


def test_the_kernel_compiled_for_hopper_pushes_16_bytes_a_store_and_meets_no_peer():
    """Compiled for sm_90 at two ranks and a width of 4096 (256 threads, 32 bytes a thread a
    row): two 16-byte stores a peer for the push, two a slot for the sentinel put back, two each
    for the sum and the normalized row, and the epoch's two words; its only atomic instruction is
    the count of the call's programs (no compare-and-swap: no barrier, no signal pad). The wait
    reads its slots 16 bytes a load, volatile (past L1, where an earlier read could stand), two
    a slot before the loop and two in it."""
    from tests import sm_compile

    launch = _hopper_launch(world=2)
    (loads,) = sm_compile.global_loads([launch])
    assert loads.count("ld.volatile.global.v4.b32") == 2 * 2 * 2, loads
    assert loads.count("ld.volatile.global.b32") == 1, loads  # the epoch
    assert not [load for load in loads if load.endswith(".b16")], loads
    (stores,) = sm_compile.global_stores([launch])
    assert stores.count("st.global.v4.b32") == 2 * 2 + 2 * 2 + 2 + 2, stores
    assert stores.count("st.global.b32") == 2 and len(stores) == 14, stores
    (atomics,) = sm_compile.atomics([launch])
    assert atomics == ["atom.global.gpu.acq_rel.add.u32"], atomics


def test_past_a_third_of_its_buffer_or_eight_ranks_the_kernel_refuses_and_says_which(monkeypatch):
    monkeypatch.setattr(collectives, "_multiprocessors", lambda device: 256)

    def world_of(world: int):
        pushed = symmetric.PushBuffers((), torch.zeros(2, dtype=torch.int32), 0, world)
        monkeypatch.setattr(symmetric, "push_buffers", lambda group_name, device, dtype: pushed)

    cuda = torch.device("cuda", 0)
    world_of(2)
    assert collectives.push_refuses(16, 4096, BF16, cuda, "0") is None
    # 2 ranks x 128 rows of 8 KB: 2 MiB a rank takes in, a third of the buffer; 256 rows are past it
    assert symmetric.PUSH_BYTES == symmetric.THIRDS * symmetric.ONE_SHOT_READ_BYTES
    assert collectives.push_refuses(128, 4096, BF16, cuda, "0") is None
    assert "4194304 bytes a rank takes in, past the 2097152" in collectives.push_refuses(
        256, 4096, BF16, cuda, "0"
    )
    world_of(16)
    assert (
        collectives.push_refuses(1, 4096, BF16, cuda, "0") == "16 ranks; the kernel writes at most 8 buffers"
    )


EPS = 1e-5


def _two_gpu_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    group = dist.group.WORLD.group_name
    results = {"refuses": collectives.push_refuses(1, 4096, BF16, torch.device("cuda", rank), group)}
    try:
        for m in (1, 16, 64):
            ranks.mark(out_dir, rank, f"the op's eager calls at m={m}")
            gen = torch.Generator("cuda").manual_seed(rank)
            x = torch.randn(m, 4096, dtype=BF16, device="cuda", generator=gen)
            shared = torch.Generator("cuda").manual_seed(100)  # residual and weight as every rank has them
            residual = torch.randn(m, 4096, dtype=BF16, device="cuda", generator=shared)
            weight = (1 + 0.1 * torch.randn(4096, device="cuda", generator=shared)).to(BF16)
            expected = reference.add_rms_norm(reference.all_reduce_sum(x, group), residual, weight, EPS)
            normed, summed = torch.ops.fp8compile.all_reduce_rms_norm(x, residual, weight, EPS, group)
            for _ in range(200):  # back to back, through the buffer's thirds many times over
                again = torch.ops.fp8compile.all_reduce_rms_norm(x, residual, weight, EPS, group)
            ranks.mark(out_dir, rank, f"the op in a CUDA graph at m={m}")
            graph, static_x = torch.cuda.CUDAGraph(), x.clone()
            with torch.cuda.graph(graph):
                captured = torch.ops.fp8compile.all_reduce_rms_norm(static_x, residual, weight, EPS, group)
            static_x.copy_(x * 2)  # exact in bf16
            graph.replay()
            doubled = reference.add_rms_norm(reference.all_reduce_sum(x * 2, group), residual, weight, EPS)
            results[m] = dict(
                summed=torch.equal(summed, expected[1]),
                normed=_relative(normed, expected[0]),
                again=torch.equal(again[0], normed) and torch.equal(again[1], summed),
                replayed_summed=torch.equal(captured[1], doubled[1]),
                replayed_normed=_relative(captured[0], doubled[0]),
                normed_bits=normed.cpu(),
            )
        push = symmetric.push_buffers(group, torch.device("cuda", rank), BF16)
        results["epoch"] = None if push is None else push.epoch.tolist()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference relative to the reference's magnitude (bf16's unit: 2**-8)."""
    return ((a.float() - b.float()).abs() / b.float().abs().clamp_min(1e-3)).max().item()


@pytest.mark.gpu
def test_on_two_gpus_the_kernel_sums_as_nccl_and_normalizes_within_a_bf16_unit(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs of one host")
    ranks.spawn(_two_gpu_worker, 2, tmp_path, deadline_s=240)  # a barrier that never meets: fail
    by_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for rank in by_rank:
        assert rank["refuses"] is None
        # every call ran the kernel: at each m one, 200 back to back, and the graph's replay
        assert rank["epoch"] == [3 * (1 + 200 + 1), 0], rank["epoch"]
        for m in (1, 16, 64):
            # the partials added in fp32 and rounded once, as NCCL at two ranks; the residual added
            assert rank[m]["summed"] and rank[m]["replayed_summed"], (m, rank[m])
            # normalized in fp32 as the reference, its sum of squares in another order: a bf16 unit
            assert rank[m]["normed"] <= 2**-7 and rank[m]["replayed_normed"] <= 2**-7, (m, rank[m])
            assert rank[m]["again"]
    for m in (1, 16, 64):  # every rank the same bits
        assert torch.equal(by_rank[0][m]["normed_bits"], by_rank[1][m]["normed_bits"])
