"""`bench tune --kernels small_m_depth`: the decode kernel's split of K against its pipeline depth,
beside a plain read of the same weight.

A decode linear split over K pays, after its stream, a publish-and-sum epilogue (fp32 partials
stored, an atomic arrival, the last split reading them all back); a short stream pays its start
(the first tiles' trip from HBM) over few groups. Narrow tiles unsplit, or fewer programs with
more tiles in flight, trade those against each other. This sweep times the trade at a model's
shard shapes, M = 1 and 16: plain kernels, and gated ones (act(gate, up) fused: the MLP's down
projection) where asked. A candidate whose output is not the default's within DIFF_BOUND is not
timed. Rows are written after every shape (tune_depth.json). On an H200 at Llama-3-70B's TP4 and
Llama-3-8B's TP1 and TP2 shard shapes the default tiling was the fastest at 17 of 20 points
(BENCHMARKS.md, "The decode kernel's split of K against its pipeline depth")."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from . import harness, read, tune

# (rows a program, programs an SM the split aims for, pipeline stages). The first of each kind is the
# kernel's default (triton_gemm.SMALL_M_*); then deeper pipelines; then narrow tiles whose programs
# an SM leave K unsplit (or nearly) at the shard shapes of tensor-parallel decode.
PLAIN = (
    (128, 2, 3),
    (128, 2, 6),
    (128, 1, 6),
    (128, 1, 10),
    (64, 1, 4),
    (64, 1, 8),
    (64, 2, 6),
    (32, 1, 4),
    (32, 1, 8),
    (32, 1, 12),
)
GATED = ((256, 1, 3), (256, 1, 5), (128, 2, 3), (128, 1, 6), (64, 1, 4), (64, 1, 8), (32, 1, 8))
# A split of K sums fp32 partials in another order: bf16 outputs may differ in their last bit.
DIFF_BOUND = 1e-5


def sweep(
    out_dir: Path,
    shapes,
    gated_shapes=(),
    plain=PLAIN,
    gated_sweep=GATED,
    device: torch.device | None = None,
    time_us=None,
) -> list[dict]:
    """Every candidate at every (N, K) of shapes (plain, the `plain` candidates) and gated_shapes
    (gated, the `gated_sweep` ones), M = 1 and 16, on device (default: the current GPU), timed by
    time_us (default: harness.time_us; with the plain read only on a GPU)."""
    from fp8compile.ops.linear import triton_gemm
    from fp8compile.ops.quant import reference as quant_reference

    device = device or torch.device("cuda", torch.cuda.current_device())
    on_gpu = device.type == "cuda"
    time_us = time_us or harness.time_us
    rows: list[dict] = []
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = [(n, k, False) for n, k in shapes] + [(n, k, True) for n, k in gated_shapes]
    with torch.no_grad():
        for n, k, gated in jobs:
            w8 = [
                quant_reference.quant_weight_block(
                    torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
                )
                for _ in range(harness.copies(n * k) if on_gpu else 1)
            ]
            read_us = None
            if on_gpu:
                tiling = read.fastest_tiling([w for w, _ in w8])
                read_us = time_us([lambda w=w: read.plain_read(w, *tiling) for w, _ in w8])
            for m in (1, 16):
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                b = torch.randn(m, k, device=device, dtype=torch.bfloat16) if gated else None

                def run(q, **tiles):
                    return triton_gemm.linear_small_m(x, *q, b=b, **tiles)

                split_of = functools.partial(triton_gemm.small_m_split, n, k, device)
                for row in tune.decode_tilings(
                    run, w8, gated_sweep if gated else plain, split_of, DIFF_BOUND, time_us
                ):
                    weight_tbps = row["us"] and n * k / row["us"] / 1e6
                    rows.append(
                        dict(n=n, k=k, m=m, gated=gated, **row, weight_tbps=weight_tbps, read_us=read_us)
                    )
                mine = [r for r in rows if (r["n"], r["k"], r["m"], r["gated"]) == (n, k, m, gated)]
                first, best = mine[0], min((r for r in mine if r["us"]), key=lambda r: r["us"], default=None)
                if best and first["us"]:
                    tiling = f"{best['block_n']} rows, {best['ppsm']} an SM, split {best['split']}"
                    print(
                        f"   N={n} K={k} M={m}{' gated' if gated else ''}: default {first['us']:.1f} us, "
                        f"best {best['us']:.1f} ({tiling}, {best['stages']} stages; "
                        f"{first['us'] / best['us']:.2f}x), plain read {read_us or 0:.1f}"
                    )
            (out_dir / "tune_depth.json").write_text(json.dumps(rows, indent=1))
    return rows
