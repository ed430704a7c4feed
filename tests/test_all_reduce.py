"""The all_reduce pass and fp8compile::all_reduce (ops/collectives/): a graph's functional sum
all-reduce and its wait become fp8compile's op, which takes symmetric memory's one-shot and
two-shot kernels at decode sizes on GPUs of one host and the group's own collective elsewhere.

On the CPU, in one process, over a gloo group of one rank (the pass and the op's fallback);
the two-rank sums on the CPU are in test_tensor_parallel.py, on two GPUs in the gpu test below.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fp8compile
from fp8compile.backend import FP8COMPILE_ALL_REDUCE
from fp8compile.config import FUSIONS
from fp8compile.ops.collectives import op as collectives, reference, symmetric
from fp8compile.passes.all_reduce import NO_CUDA_GRAPHS
from tests import ranks
from tests.conftest import golden_text

BF16 = torch.bfloat16


class RowShardedLinear(nn.Module):
    """What fp8compile.tensor_parallel makes of an o or down projection: this rank's partial
    product, summed over the ranks, then the residual added."""

    def __init__(self, reduce_op: str = "sum"):
        super().__init__()
        self.proj = nn.Linear(256, 256, bias=False)
        self.reduce_op = reduce_op

    def forward(self, x):
        from torch.distributed import _functional_collectives as funcol

        return x + funcol.all_reduce(self.proj(x), self.reduce_op, dist.group.WORLD)


def _compiled(module, x, mode="reduce-overhead", **options):
    """module compiled by the fp8 backend (in reduce-overhead unless `mode` says otherwise: the
    pass rewrites graphs that run under CUDA graphs; on the CPU there are none to record), run on x."""
    fp8 = fp8compile.backend(**options)
    with torch.no_grad():
        out = torch.compile(module, backend=fp8, dynamic=False, mode=mode)(x)
    return out, fp8.report


@pytest.mark.inductor  # Inductor lowers the op the pass put in
def test_the_pass_puts_fp8compiles_all_reduce_where_the_graph_summed_over_ranks(one_rank_group):
    module = RowShardedLinear().to(BF16)
    x = torch.randn(4, 256, dtype=BF16)
    out, report = _compiled(module, x)
    assert report.collectives == {0: {FP8COMPILE_ALL_REDUCE: 1}}
    # (on the CPU no CUDA graph is recorded, so the op launches at each call)
    assert "graph 0's collectives: 1 all_reduce (fp8compile's), launched at each call" in str(report)
    # what it runs here, and why not symmetric memory
    cpu = "the group's own collective (symmetric memory serves CUDA tensors; these are cpu)"
    assert report.all_reduce_paths == {f"{one_rank_group} on cpu": cpu}
    assert f"all-reduces, group {one_rank_group} on cpu: {cpu}" in str(report)
    with torch.no_grad():
        eager = module(x)
    # the projection is FP8 on both compiled sides; the sum over one rank is the partial itself
    reference_out, _ = _compiled(module, x, fusions=tuple(f for f in FUSIONS if f != "all_reduce"))
    assert torch.equal(out, reference_out)
    assert fp8compile.calc_diff(out, eager) < 1e-3


GOLDEN = Path(__file__).parent / "golden" / "all_reduce.diff"


def test_golden_graph_diff_of_a_row_sharded_linears_all_reduce(one_rank_group, pass_diffs):
    """The functional all_reduce and its wait_tensor leave; fp8compile.all_reduce takes the same
    input and group, and the residual add reads it (the linear left bf16 here: skip="*").
    Regenerate with FP8COMPILE_UPDATE_GOLDEN=1 after an intended change, and read the diff."""
    module, x = RowShardedLinear().to(BF16), torch.randn(4, 256, dtype=BF16)
    out, _ = _compiled(module, x, fusions=("all_reduce",), skip=("*",))
    with torch.no_grad():
        assert torch.equal(out, module(x))  # the bf16 linear, summed over one rank
    (diff,) = pass_diffs
    assert diff == golden_text(GOLDEN, diff)


def test_without_the_all_reduce_fusion_the_functional_collective_stays(one_rank_group):
    _, report = _compiled(
        RowShardedLinear().to(BF16),
        torch.randn(4, 256, dtype=BF16),
        fusions=tuple(f for f in FUSIONS if f != "all_reduce"),
    )
    assert report.collectives == {0: {"all_reduce": 1}}


def test_without_cuda_graphs_the_functional_collective_stays_and_the_report_says_why(one_rank_group):
    _, report = _compiled(RowShardedLinear().to(BF16), torch.randn(4, 256, dtype=BF16), mode=None)
    assert report.collectives == {0: {"all_reduce": 1}}
    assert report.all_reduce_paths == {"graph 0": NO_CUDA_GRAPHS}
    assert f"all-reduces, graph 0: {NO_CUDA_GRAPHS}" in str(report)


@pytest.mark.inductor
def test_an_all_reduce_past_the_symmetric_buffer_stays_as_written_and_inductor_reduces_it_in_place(
    one_rank_group, monkeypatch
):
    """A graph whose sizes put an all-reduce past the symmetric buffer (a long prefill's): NCCL
    runs it either way, so the pass leaves the functional collective, which Inductor reduces in
    place (its reinplace pass), where fp8compile's op would copy its input first (0.49 ms of a TP2
    prefill of 2048 tokens on 2 x H200). Here the buffer is made smaller than 4 x 256 bf16."""
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setattr(symmetric, "BUFFER_BYTES", 1024)
    module, x = RowShardedLinear().to(BF16), torch.randn(4, 256, dtype=BF16)
    (out, report), codes = run_and_get_code(lambda: _compiled(module, x))
    assert report.collectives == {0: {"all_reduce": 1}}
    assert (
        "of 2048 bytes a rank as written: past the 1024-byte buffer"
        in (report.all_reduce_paths["graph 0, past the symmetric buffer"])
    )
    code = "\n".join(codes)
    assert "_c10d_functional.all_reduce_.default(" in code
    assert "_c10d_functional.all_reduce.default(" not in code


def test_an_all_reduce_of_another_reduction_stays_the_functional_collective(one_rank_group):
    _, report = _compiled(RowShardedLinear("max").to(BF16), torch.randn(4, 256, dtype=BF16))
    assert report.collectives == {0: {"all_reduce": 1}}


def test_a_cpu_tensor_takes_the_groups_own_collective_with_the_reason(one_rank_group):
    x = torch.randn(3, 256, dtype=BF16)
    assert symmetric.serves(x) == "a cpu tensor"
    assert symmetric.all_reduce_sum(x, one_rank_group) is None
    out = torch.ops.fp8compile.all_reduce(x, one_rank_group)
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()  # a new tensor, as funcol's


def test_the_push_kernel_sums_alone_on_one_rank_and_leaves_its_buffer_holding_the_sentinel():
    """fp8compile::all_reduce's kernel at decode sizes (ops/collectives/triton_push.py, the sum
    without the norm) on the CPU under Triton's interpreter, one rank: the sum is the input, a
    -0.0 travels as +0.0 (the sentinel's bits), the epoch counts the calls, and every slot holds
    the sentinel again. Three ranks, alternating with the norm, are in test_all_reduce_norm.py."""
    pytest.importorskip("triton")
    from fp8compile.ops.collectives import triton_push

    x = torch.randint(-8, 9, (3, 320), generator=torch.Generator().manual_seed(0)).to(BF16)
    x[0, :2] = -0.0
    buffer = symmetric.sentinel_fill(torch.empty(3 * 3 * 320, dtype=BF16))
    epoch = torch.zeros(2, dtype=torch.int32)
    for call in range(4):
        out = triton_push.all_reduce_sum(x * (call + 1), (buffer,), epoch, rank=0)
        assert torch.equal(out, x * (call + 1)) and out.data_ptr() != x.data_ptr(), call
        assert epoch.tolist() == [call + 1, 0], call
        assert (buffer.view(torch.int16) == symmetric.SENTINEL_BITS[16]).all(), call
    assert not out[0, :2].signbit().any()
    assert collectives.PUSH_MAX_WORLD == triton_push.MAX_WORLD  # op.py says it without Triton


def test_a_group_made_again_under_the_same_name_gets_a_symmetric_buffer_of_its_own(monkeypatch):
    """A buffer is rendezvoused with one group's peers: a group destroyed and made again (the
    default group is "0" each time) must not be handed the old group's buffer, nor its world size,
    while the group that made a buffer keeps it from call to call."""
    made = []

    def make(group_name, index):
        made.append((group_name, dist.get_world_size()))
        return torch.empty(symmetric.BUFFER_BYTES, dtype=torch.uint8)

    monkeypatch.setattr(symmetric, "_make", make)
    monkeypatch.setattr(symmetric, "_buffers", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    cuda0 = torch.device("cuda", 0)  # only its index is read
    buffers = []
    for _ in range(2):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            name = dist.group.WORLD.group_name
            first = symmetric._buffer(name, cuda0)
            assert symmetric._buffer(name, cuda0) is first
            assert symmetric.state(name, 0).startswith("symmetric memory, a ")
            assert symmetric._world(name) == 1
            buffers.append(first)
        finally:
            dist.destroy_process_group()
        assert symmetric.state(name, 0) == "no call yet"  # its group is gone
    assert made == [(name, 1), (name, 1)]
    assert buffers[0] is not buffers[1]


def test_the_symmetric_kernels_take_bf16_and_fp32_in_whole_16_byte_units_up_to_the_buffer():
    meta = dict(device="meta")
    # (serves() reads only the tensor's device, dtype and size: a "cuda" meta tensor stands in)
    reasons = {
        name: symmetric.serves(_on_cuda(torch.empty(*shape, dtype=dtype, **meta)))
        for name, (shape, dtype) in {
            "fp16": ((1, 4096), torch.float16),
            "odd": ((1, 4095), BF16),
            "past the buffer": ((symmetric.BUFFER_BYTES // 2 + 8,), BF16),
        }.items()
    }
    assert reasons["fp16"].startswith("torch.float16 (the kernels take")
    assert reasons["odd"] == "8190 bytes, not a multiple of 16"
    assert reasons["past the buffer"].startswith(f"{symmetric.BUFFER_BYTES + 16} bytes, past the")


def _on_cuda(t: torch.Tensor):
    """A stand-in whose .device says cuda (serves() looks no further than device, dtype, size)."""

    class OnCuda:
        device = torch.device("cuda", 0)
        dtype = t.dtype

        def numel(self):
            return t.numel()

        def element_size(self):
            return t.element_size()

    return OnCuda()


def _two_gpu_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    group = dist.group.WORLD.group_name
    results = {}
    ranks.mark(out_dir, rank, "joined the group")
    try:
        # First, before any eager call could make the buffer: compiled in reduce-overhead, where
        # the graph's first call runs inside CUDA-graph trees' pool (the pass makes the buffer)
        torch.manual_seed(0)  # the same weights on both ranks
        module = RowShardedLinear().to(BF16).cuda()
        x = torch.randn(16, 256, dtype=BF16, device="cuda") * (rank + 1)
        outs, nccl = {}, tuple(f for f in FUSIONS if f != "all_reduce")
        for name, fusions in (("fp8compile", FUSIONS), ("nccl", nccl)):
            torch._dynamo.reset()
            backend = fp8compile.backend(fusions=fusions)
            if name == "fp8compile":
                backend_report = backend.report
            compiled = torch.compile(module, backend=backend, mode="reduce-overhead")
            with torch.no_grad():
                outs[name] = []
                for call in ("warm-up", "capture", "replay"):
                    ranks.mark(out_dir, rank, f"{name}'s compiled module, its {call} call")
                    outs[name].append(compiled(x).clone())
        results["compiled"] = all(torch.equal(a, b) for a, b in zip(outs["fp8compile"], outs["nccl"]))
        results["path"] = backend_report.all_reduce_paths
        for m in (1, 16, 64, 512):  # one-shot up to 1 MiB a rank at 2 ranks (m = 128 at 4096), two-shot past
            gen = torch.Generator("cuda").manual_seed(rank)
            x = torch.randn(m, 4096, dtype=BF16, device="cuda", generator=gen)
            # each stage waits for its kernels before the next mark: a hang is named where it is
            ranks.mark(out_dir, rank, f"NCCL's eager call at m={m}")
            expected = reference.all_reduce_sum(x, group)
            torch.cuda.synchronize()
            ranks.mark(out_dir, rank, f"the op's eager call at m={m}")
            out = torch.ops.fp8compile.all_reduce(x, group)
            torch.cuda.synchronize()
            ranks.mark(out_dir, rank, f"the op's capture in a CUDA graph at m={m}")
            graph, static_x = torch.cuda.CUDAGraph(), x.clone()
            with torch.cuda.graph(graph):
                captured = torch.ops.fp8compile.all_reduce(static_x, group)
            static_x.copy_(x * 2)
            ranks.mark(out_dir, rank, f"the graph's replay at m={m}")
            graph.replay()
            torch.cuda.synchronize()
            results[m] = dict(
                eager=(out.float() - expected.float()).abs().max().item(),
                replayed=(captured.float() - 2 * expected.float()).abs().max().item(),
            )
        results["state"] = symmetric.state(group, rank)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        ranks.mark(out_dir, rank, "the closing barrier")
        dist.barrier()
        # NCCL's teardown waits until every CUDA graph that captured one of its calls is destroyed
        # (pytorch/pytorch#115388): the NCCL module's graphs live in CUDA-graph trees until reset.
        # On 2 x H200 (torch 2.11) the group's destruction waited for good without this.
        ranks.mark(out_dir, rank, "the CUDA graphs' release")
        del compiled, graph, captured
        torch._dynamo.reset()
        gc.collect()
        ranks.mark(out_dir, rank, "the group's destruction")
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_on_two_gpus_fp8compiles_all_reduce_sums_as_nccl_compiled_eager_and_in_a_cuda_graph(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs of one host")
    ranks.spawn(_two_gpu_worker, 2, tmp_path, deadline_s=240)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        assert results["state"].startswith("symmetric memory"), results["state"]
        # compiled in reduce-overhead, three calls (warm-up, capture, replay): NCCL's bits
        assert results["compiled"]
        assert results["path"] == {f"0 on cuda:{rank}": symmetric.path()}
        for m in (1, 16, 64, 512):
            # two bf16 partials added and rounded once, by NCCL and by the kernels alike
            assert results[m]["eager"] == 0, (m, results[m])
            # replayed on inputs doubled after capture (exact in bf16): the graph reads the new values
            assert results[m]["replayed"] == 0, (m, results[m])
