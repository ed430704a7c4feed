"""`bench allreduce --tp N`: the sum all-reduce of an (M, hidden) bf16 activation, the one after
each row-sharded linear of a tensor-parallel step, on N GPUs of one host, one process each:
the group's NCCL collective (what a sharded graph holds before the all_reduce pass), symmetric
memory's one-shot and two-shot kernels, fp8compile::all_reduce (what the pass puts there, its
kernel chosen by size), and fp8compile::all_reduce_rms_norm (the all-reduce with the residual add
and RMSNorm after it, what the all_reduce_norm pass puts there), at the sizes its kernel serves.

Each is timed as a decode step runs it: CALLS back to back inside one CUDA graph, replayed
REPLAYS times between CUDA events, the same count on every rank (collectives meet; a count
picked from each rank's own timing would not). us per call; the max difference from NCCL's sum
(and for the norm, from NCCL's sum added and normalized as transformers does), which every rank
checks before timing.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from . import tp as tp_bench
from .output import save

HIDDEN = (4096, 8192)  # Llama-3-8B's, Llama-3-70B's
MS = (1, 16, 64, 256, 1024, 2048)
CALLS, REPLAYS = 20, 50


def bench_allreduce(
    out_dir: Path, hiddens=HIDDEN, ms=MS, device: str | None = None, tp: int = 2
) -> list[dict]:
    if tp_bench.world() == 1:
        return tp_bench.spawn(
            bench_allreduce, tp, out_dir, device, result="bench_allreduce.json", hiddens=hiddens, ms=ms
        )
    from ..ops.collectives import op, reference, symmetric  # noqa: F401 - op: fp8compile::all_reduce

    group = dist.group.WORLD.group_name
    methods = {
        "nccl": lambda x: reference.all_reduce_sum(x, group),
        "one_shot": lambda x: symmetric.all_reduce_sum(x, group, kernel="one_shot"),
        "two_shot": lambda x: symmetric.all_reduce_sum(x, group, kernel="two_shot"),
        "fp8compile": lambda x: torch.ops.fp8compile.all_reduce(x, group),
    }
    rank, rows = dist.get_rank(), []
    for hidden in hiddens:
        weight = 1 + 0.1 * torch.randn(hidden, device=device, generator=_seeded(100, device))
        weight = weight.to(torch.bfloat16)
        for m in ms:
            x = torch.randn(m, hidden, dtype=torch.bfloat16, device=device, generator=_seeded(rank, device))
            residual = torch.randn(
                m, hidden, dtype=torch.bfloat16, device=device, generator=_seeded(100, device)
            )
            expected = methods["nccl"](x)
            expected_normed = reference.add_rms_norm(expected, residual, weight, EPS)[0]
            row = dict(tp=tp, hidden=hidden, m=m, kb=x.numel() * x.element_size() / 1024)
            norms = {NORM: _norm(residual, weight, group)}
            for name, fn in {**methods, **norms}.items():
                got = fn(x)
                if got is None:
                    row[name] = None  # past the symmetric buffer, or a kernel that does not serve it
                    continue
                want = expected_normed if name in norms else expected
                row[f"{name}_max_diff"] = (got.float() - want.float()).abs().max().item()
                row[name] = time_us(fn, x)
            rows.append(row)
    if tp_bench.is_main():
        save(out_dir, "bench_allreduce.json", rows, _table)
    return rows


EPS = 1e-5
# The all-reduce with the residual add and RMSNorm after it, in one kernel where it serves
# (fp8compile::all_reduce_rms_norm, ops/collectives/triton_push.py): timed to its normalized row.
NORM = "fp8compile_norm"


def _norm(residual, weight, group: str):
    """x -> the normalized row of residual + the sum of x over the group, by the fused kernel;
    None where it does not serve x (the op would take its fallback)."""
    from ..ops.collectives import op

    def run(x):
        rows, h = x.shape
        if op.push_refuses(rows, h, x.dtype, x.device, group) is not None:
            return None
        return torch.ops.fp8compile.all_reduce_rms_norm(x, residual, weight, EPS, group)[0]

    return run


def _seeded(rank: int, device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(rank)
    return gen


def time_us(fn, x) -> float:
    """us per call of fn(x): CALLS calls in one CUDA graph, replayed REPLAYS times. A collective:
    every rank of the default group calls it alike."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up off the default stream, as capture wants
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn(x)
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (REPLAYS * CALLS)


def _table(rows: list[dict]) -> str:
    names = ("nccl", "one_shot", "two_shot", "fp8compile", NORM)
    lines = [
        "| hidden | M | KB a rank | " + " | ".join(f"{n} us" for n in names) + " | fp8compile / nccl |",
        "|---|---|---|" + "---|" * (len(names) + 1),
    ]
    for r in rows:
        cells = [f"{r[n]:.1f}" if r.get(n) else "-" for n in names]
        ratio = f"{r['nccl'] / r['fp8compile']:.2f}x" if r.get("nccl") and r.get("fp8compile") else "-"
        lines.append(f"| {r['hidden']} | {r['m']} | {r['kb']:.0f} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)
