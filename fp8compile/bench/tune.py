"""`python -m fp8compile bench tune`: sweeps of our Triton kernels' tile constants (decode
kernel, large-M GEMM, its 64- against 128-row tiles). Times: harness.py."""

from __future__ import annotations

import functools
import itertools
import json
import math
from pathlib import Path

import torch

import fp8compile
from fp8compile.numerics import FP8_DTYPE

from . import harness
from .gemm import SHAPES

# Large-M candidates: (tile config, activation-scale layout). BLOCK_N divides 128 (one weight
# scale per tile and group); 128x256 and 256x128 tiles spilled in the first sweep
# (benchmarks/tune_h200_first.json: 235-311 TFLOP/s against 520-630).
LARGE_M_SWEEP = [
    (dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=4), "row"),
    (dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4), "row"),
    (dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=4, tma=True), "row"),
    (dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=5, tma=True), "row"),
    (dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=4, tma=True), "row"),
    (dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, tma=True), "row"),
    (dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4, tma=True), "row"),
    (dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4, tma=True), "mn_major"),
    (dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=4, tma=True), "mn_major"),
    (dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=4, tma=True, persistent=2), "row"),
    (dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, tma=True, persistent=1), "row"),
    (dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4, tma=True, persistent=1), "row"),
    (dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4, tma=True, persistent=1), "mn_major"),
]


# Activation quantization (ops/quant/triton_quant.py): rows per program and warps. Each program
# quantizes ROWS x 128 (one group of each row); the kernel's default is 16 rows, 4 warps.
QUANT_SWEEP = [(rows, warps) for rows in (16, 32, 64) for warps in (4, 8)]
QUANT_MS = (2048, 4096)


def quant_launch(x: torch.Tensor, b: torch.Tensor | None, rows: int, num_warps: int):
    """(launch, (x_fp8, scale)): one quantization of x (act(x, b) = silu(x) * b with b) into
    buffers of its own, as the cuBLAS side lays them out (scales column-major), with `rows` rows
    per program and `num_warps` warps."""
    from fp8compile.ops.quant import triton_quant

    m, k = x.shape
    x_fp8 = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scale = triton_quant.empty_scales(m, k // 128, "col", x.device)
    grid, args, constexprs = triton_quant.quant_act_arguments(
        x, b, x_fp8, scale, False, "silu", 1.702, 7.0, rows
    )
    return (lambda: triton_quant._quant_act_launch(grid, args, constexprs, num_warps=num_warps)), (
        x_fp8,
        scale,
    )


def _quant_sweep(k: int, results: list) -> None:
    """Every QUANT_SWEEP candidate at QUANT_MS rows of K columns, of x itself and of a gated
    MLP's act(gate, up) read from the two halves of one gate|up output (as the down projection
    reads them); a candidate whose bits differ from the first one's is not timed."""
    for m, gated in itertools.product(QUANT_MS, (False, True)):
        r = harness.copies(m * k * 2 * (2 if gated else 1))
        inputs = []
        for _ in range(r):
            if gated:
                gate_up = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)
                inputs.append((gate_up[:, :k], gate_up[:, k:]))
            else:
                inputs.append((torch.randn(m, k, device="cuda", dtype=torch.bfloat16), None))
        moved = m * k * (2 * (2 if gated else 1) + 1) + m * (k // 128) * 4  # bytes read and written
        first = None
        for rows, warps in QUANT_SWEEP:
            launches = [quant_launch(x, b, rows, warps) for x, b in inputs]
            launches[0][0]()
            x_fp8, scale = launches[0][1]
            bits = (x_fp8.view(torch.uint8), scale)
            first = bits if first is None else first
            same = all(torch.equal(a, b) for a, b in zip(bits, first))
            us = harness.time_us([launch for launch, _ in launches]) if same else None
            results.append(
                dict(
                    k=k,
                    m=m,
                    gated=gated,
                    rows=rows,
                    num_warps=warps,
                    same_bits=same,
                    us=us,
                    tbps=us and moved / us / 1e6,
                )
            )
            print(
                f"   quant K={k} M={m}{' act(gate, up)' if gated else ''}: {rows} rows, {warps} warps: "
                + (
                    f"{us:.1f} us, {moved / us / 1e6:.2f} TB/s"
                    if us
                    else "bits differ"
                    if not same
                    else "failed"
                )
            )


# The scaled recipes' decode kernel (ops/linear/triton_scaled.py): tile width, programs per SM (its split
# of K), pipeline stages; plain and gated (act(gate, up) computed as the tiles load), M <= 16.
SCALED_SMALL_M_SWEEP = list(itertools.product((64, 128, 256), (1, 2, 4), (3, 4)))


def _scaled_small_m_sweep(n: int, k: int, results: list) -> None:
    """Every SCALED_SMALL_M_SWEEP candidate on a rowwise weight (n, k), dynamic per-token scales
    (the row-amax launch included, as the eager op runs it), M = 1 and 16, plain and gated;
    a candidate whose output is not the default tiles' within 1e-6 calc_diff is not timed."""
    from fp8compile.ops.linear import reference_scaled, triton_gemm, triton_scaled

    w8 = [
        reference_scaled.quant_weight_scaled(
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, "rowwise"
        )
        for _ in range(harness.copies(n * k))
    ]
    for m, gated in itertools.product((1, 16), (False, True)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) if gated else None

        def run(q, **tiles):
            if gated:
                return triton_scaled.gated_linear_scaled_small_m(x, b, *q, **tiles)
            return triton_scaled.linear_scaled_small_m(x, *q, **tiles)

        split_of = functools.partial(
            triton_gemm.small_m_split, n, k, torch.device("cuda", torch.cuda.current_device())
        )
        for row in decode_tilings(run, w8, SCALED_SMALL_M_SWEEP, split_of, 1e-6, harness.time_us):
            results.append(
                dict(n=n, k=k, m=m, gated=gated, **row, weight_tbps=row["us"] and n * k / row["us"] / 1e6)
            )
        mine = [r for r in results if (r["n"], r["k"], r["m"], r["gated"]) == (n, k, m, gated) and r["us"]]
        best = min(mine, key=lambda r: r["us"], default=None)
        if best:
            print(
                f"   scaled N={n} K={k} M={m}{' gated' if gated else ''}: best block_n {best['block_n']}, "
                f"{best['ppsm']} per SM (split {best['split']}), {best['stages']} stages: "
                f"{best['us']:.1f} us ({best['weight_tbps']:.2f} TB/s)"
            )


def decode_tilings(run, weights, candidates, split_of, bound: float, time_us) -> list[dict]:
    """A decode kernel's candidate tilings, (rows a program, programs an SM, stages) each: run on
    weights[0] with block_n, split_k (split_of(block_n, programs an SM)) and num_stages, its
    calc_diff against the default tiling's output, and, where within bound, its time over every
    weight copy (time_us). A tiling that fails (shared memory, a tile the compiler refuses) is a
    row without a calc_diff or time."""
    default = run(weights[0])
    rows = []
    for block_n, ppsm, stages in candidates:
        split = split_of(block_n, ppsm)
        tiles = dict(block_n=block_n, split_k=split, num_stages=stages)
        try:
            diff = fp8compile.calc_diff(run(weights[0], **tiles), default)
        except Exception as e:  # noqa: BLE001
            print(f"    {tiles}: failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            diff = None
        us = (
            diff is not None
            and diff < bound
            and time_us([lambda q=q: run(q, **tiles) for q in weights])
            or None
        )
        rows.append(dict(block_n=block_n, ppsm=ppsm, stages=stages, split=split, calc_diff=diff, us=us))
    return rows


def _deep_gemm_us(x_q, w8, n: int) -> float | None:
    import deep_gemm

    out = torch.empty(x_q[0].shape[0], n, device="cuda", dtype=torch.bfloat16)
    return harness.time_us(
        [lambda q=q: deep_gemm.fp8_gemm_nt(x_q, q, out, disable_ue8m0_cast=True) for q in w8]
    )


def tune(out_dir: Path, shapes=SHAPES, kernels=("small_m", "large_m")) -> dict:
    """Sweep the Triton kernels' tile constants; print the best fixed choice by geometric mean.
    kernels: "small_m", "large_m", "tiles" (the large-M GEMM's 64- against 128-row tiles by
    M, and whether they give the same bits), "quant" (the activation quantization's rows per
    program and warps, at each K of the shapes) and "scaled_small_m" (the rowwise decode
    kernel's tiles, plain and gated)."""
    from fp8compile.ops import vendors
    from fp8compile.ops.quant import reference as quant_reference
    from fp8compile.ops.linear import triton_gemm
    from fp8compile.ops.quant import triton_quant

    from tqdm import tqdm

    results = {"small_m": [], "large_m": [], "tiles": [], "quant": [], "scaled_small_m": []}
    with torch.no_grad():
        for n, k in shapes if "scaled_small_m" in kernels else ():
            _scaled_small_m_sweep(n, k, results["scaled_small_m"])
        for k in dict.fromkeys(k for _, k in shapes) if "quant" in kernels else ():
            _quant_sweep(k, results["quant"])
        gemms = {"small_m", "large_m", "tiles"} & set(kernels)
        for n, k in tqdm(shapes if gemms else (), desc="tune"):
            r8 = harness.copies(n * k)
            w8 = [
                quant_reference.quant_weight_block(
                    torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                )
                for _ in range(r8)
            ]
            for m in (1, 16, 32) if "small_m" in kernels else ():
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                for block_n, ppsm, stages in itertools.product((32, 64, 128), (1, 2, 4, 8), (3, 4, 5)):
                    n_blocks = math.ceil(n / block_n)
                    sms = torch.cuda.get_device_properties(0).multi_processor_count
                    split = max(1, min(k // 128, round(ppsm * sms / n_blocks)))
                    us = harness.time_us(
                        [
                            lambda q=q: triton_gemm.linear_small_m(
                                x, *q, split_k=split, block_n=block_n, num_stages=stages
                            )
                            for q in w8
                        ]
                    )
                    results["small_m"].append(
                        dict(
                            n=n,
                            k=k,
                            m=m,
                            block_n=block_n,
                            ppsm=ppsm,
                            stages=stages,
                            split=split,
                            us=us,
                            weight_tbps=us and n * k / us / 1e6,
                        )
                    )
            for m in (1024, 4096) if "large_m" in kernels else ():
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                x_q = {layout: triton_quant.quant_act(x, layout=layout) for layout in ("row", "mn_major")}
                dg = (
                    _deep_gemm_us(x_q["mn_major"], w8[:2], n)
                    if vendors.import_error("deep_gemm") is None
                    else None
                )
                first = None
                for cfg, layout in LARGE_M_SWEEP:
                    cfg = {"GROUP_M": 8, "tma": False, **cfg}
                    try:  # every candidate must compute what the first one does
                        out = triton_gemm.gemm_large_m(*x_q[layout], *w8[0], config=cfg)
                        first = out if first is None else first
                        agrees = fp8compile.calc_diff(out, first) < 1e-6
                    except Exception as e:
                        print(f"    {cfg}: failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                        agrees = False
                    # a candidate that fails or disagrees is not timed: no time, TFLOP/s or ratio for it
                    us = (
                        agrees
                        and harness.time_us(
                            [
                                lambda q=q: triton_gemm.gemm_large_m(*x_q[layout], *q, config=cfg)
                                for q in w8[:2]
                            ]
                        )
                        or None
                    )
                    results["large_m"].append(
                        dict(
                            n=n,
                            k=k,
                            m=m,
                            **{"persistent": 0, **cfg},
                            scales=layout,
                            agrees=agrees,
                            us=us,
                            tflops=us and 2 * m * n * k / us / 1e6,
                            deep_gemm_us=dg,
                            vs_deep_gemm=us and dg and dg / us,
                        )
                    )
            for m in (64, 128, 256, 512, 1024, 2048) if "tiles" in kernels else ():
                x_q = triton_quant.quant_act(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
                small, large = triton_gemm.SMALL_TILE_CONFIG, triton_gemm.LARGE_M_CONFIG
                same = torch.equal(
                    triton_gemm.gemm_large_m(*x_q, *w8[0], config=small),
                    triton_gemm.gemm_large_m(*x_q, *w8[0], config=large),
                )
                us = {
                    name: harness.time_us(
                        [lambda q=q: triton_gemm.gemm_large_m(*x_q, *q, config=cfg) for q in w8[:2]]
                    )
                    for name, cfg in (("small_tiles", small), ("large_tiles", large))
                }
                results["tiles"].append(dict(n=n, k=k, m=m, same_bits=same, **us))
                print(
                    f"   N={n} K={k} M={m}: 64-row tiles {us['small_tiles']:.1f} us, 128-row tiles "
                    f"{us['large_tiles']:.1f} us, same bits: {same}"
                )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tune.json").write_text(json.dumps(results, indent=1))
    large_keys = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "tma", "persistent", "scales")
    for kind, keys in (
        ("small_m", ("block_n", "ppsm", "stages")),
        ("large_m", large_keys),
        ("quant", ("rows", "num_warps")),
        ("scaled_small_m", ("gated", "block_n", "ppsm", "stages")),
    ):
        if not results[kind]:
            continue
        groups: dict[tuple, list] = {}
        for r in results[kind]:
            groups.setdefault(tuple(r[key] for key in keys), []).append(r["us"])
        scored = sorted(
            (math.exp(sum(map(math.log, ts)) / len(ts)), cfg) for cfg, ts in groups.items() if all(ts)
        )
        print(f"{kind}: best fixed configs by geometric-mean time over shapes x M ({', '.join(keys)}):")
        for score, cfg in scored[:5]:
            print(f"   {cfg}: {score:.1f} us")
        if kind in ("quant", "scaled_small_m"):
            continue  # their lines printed as they ran
        best_each = {}
        for r in results[kind]:
            key = (r["n"], r["k"], r["m"])
            if r["us"] and (key not in best_each or r["us"] < best_each[key]["us"]):
                best_each[key] = r
        for key, r in sorted(best_each.items()):
            print(
                f"   best for N={key[0]} K={key[1]} M={key[2]}: {tuple(r[x] for x in keys)} {r['us']:.1f} us"
                + (
                    f" ({r['weight_tbps']:.2f} TB/s)"
                    if kind == "small_m"
                    else f" ({r['tflops']:.0f} TFLOP/s, DeepGEMM/ours {r['vs_deep_gemm'] or 0:.2f})"
                )
            )
    return results
