"""Probe: does the weight tile's shape (bytes contiguous per row per step) set the decode stream
rate? (1) a plain XOR read of each weight in [BN, BK] tiles, split over K as the decode kernel is;
(2) the rowwise decode kernel (_scaled_small_m_kernel, traced form: amax given) with BLOCK_K 128,
256, 512 and each BLOCK_N / programs per SM / stages. Llama-3-8B's four decode weights, M = 1, 16.

    python probe/wide_k.py --out DIR            # GPU: timings
    TRITON_INTERPRET=1 python probe/wide_k.py --check   # CPU: every config agrees with the default
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time

import torch
import triton
import triton.language as tl

import fp8compile
from fp8compile.ops import reference_scaled, triton_scaled

SHAPES = [(28672, 4096), (4096, 14336), (6144, 4096), (4096, 4096)]


@triton.jit
def _read(w_ptr, out_ptr, K, stride_wn, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    chunks = K // BLOCK_K
    per = tl.cdiv(chunks, SPLIT_K)
    c0 = pid_k * per
    c1 = tl.minimum(c0 + per, chunks)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.int32)
    for c in range(c0, c1):
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + (c * BLOCK_K + offs_k)[None, :])
        acc = acc ^ w.to(tl.int32)
    tl.store(out_ptr + pid_n * SPLIT_K + pid_k, tl.xor_sum(tl.xor_sum(acc, 1), 0))


def _split(n, k, block_n, block_k, ppsm, sms):
    return max(1, min(k // block_k, round(ppsm * sms / math.ceil(n / block_n))))


def gemm_launch(x, amax, w, s, m_tile, block_n, block_k, split, stages):
    """A launch of the rowwise decode kernel on x (M, K) with amax given, at these tiles."""
    m, k = x.shape
    n = w.shape[0]
    n_tiles = math.ceil(n / block_n)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tiles = (m_tile, block_n, split, n_tiles)
    grid, args, constexprs = triton_scaled._launch_arguments(
        x, None, triton_scaled.NO_ACT, w, s, None, "rowwise", None, 0.0, False, out, tiles, traced=True
    )
    args = list(args)
    args[4] = amax
    constexprs.update(BLOCK_K=block_k, EVEN_K=k % block_k == 0)
    launch = {} if x.device.type == "cpu" else dict(num_warps=4, num_stages=stages)
    return (lambda: triton_scaled._launch(grid, args, constexprs, **launch)), out


GEMM_CONFIGS = [
    (bk, bn, ppsm, st)
    for bk, bn, ppsm, st in itertools.product((128, 256, 512), (32, 64, 128), (1, 2, 4), (3, 4))
    if bk * bn * st <= 4 * 128 * 128 * 2 and bk * bn >= 8192
]
READ_CONFIGS = [
    (bk, bn, ppsm, st)
    for bk, bn, ppsm, st in itertools.product((128, 256, 512, 1024), (16, 32, 64, 128), (1, 2, 4), (3,))
    if 8192 <= bk * bn <= 32768
]


def check():
    torch.manual_seed(0)
    n, k = 96, 1024
    w, s = reference_scaled.quant_weight_scaled(torch.randn(n, k) * 0.02, "rowwise")
    for m in (1, 5):
        x = torch.randn(m, k, dtype=torch.bfloat16)
        amax = x.float().abs().amax(1)
        ref = None
        for bk, bn, split in [(128, 32, 2), (256, 32, 2), (512, 32, 2), (256, 64, 1), (512, 16, 1)]:
            fn, out = gemm_launch(x, amax, w, s, 16, bn, bk, split, 3)
            fn()
            ref = out.clone() if ref is None else ref
            d = fp8compile.calc_diff(out, ref)
            print(m, bk, bn, split, f"{d:.2e}")
            assert d < 1e-5, d
    wu = w.view(torch.uint8)
    for bk, bn, split in [(128, 32, 2), (512, 16, 1)]:
        out = torch.empty(math.ceil(n / bn) * split, dtype=torch.int32)
        _read[(math.ceil(n / bn), split)](wu, out, k, k, SPLIT_K=split, BLOCK_N=bn, BLOCK_K=bk)
        total = 0
        for v in out.tolist():
            total ^= v
        expect = 0
        for v in wu.flatten().to(torch.int32).tolist():
            expect ^= v
        assert total == expect, (total, expect)
    print("ok")


def main(out_dir):
    from fp8compile.bench import harness

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    t0 = time.time()
    for n, k in SHAPES:
        ws = [
            reference_scaled.quant_weight_scaled(
                torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, "rowwise"
            )
            for _ in range(harness.copies(n * k))
        ]
        for bk, bn, ppsm, st in READ_CONFIGS:
            split = _split(n, k, bn, bk, ppsm, sms)
            grid = (math.ceil(n / bn), split)
            outs = torch.empty(grid[0] * split, dtype=torch.int32, device="cuda")
            fns = [
                lambda w=w: _read[grid](
                    w.view(torch.uint8), outs, k, k, SPLIT_K=split, BLOCK_N=bn, BLOCK_K=bk, num_stages=st
                )
                for w, _ in ws
            ]
            us = harness.time_us(fns)
            rows.append(dict(kind="read", n=n, k=k, bk=bk, bn=bn, ppsm=ppsm, stages=st, split=split, us=us))
            print(
                f"read {n}x{k} bk {bk} bn {bn} ppsm {ppsm} split {split}: {us and round(us, 2)} us",
                flush=True,
            )
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            amax = x.float().abs().amax(1)
            ref = None
            for bk, bn, ppsm, st in [(128, 128, 2, 3)] + GEMM_CONFIGS:
                split = _split(n, k, bn, bk, ppsm, sms)
                launches = [gemm_launch(x, amax, w, s, 16, bn, bk, split, st) for w, s in ws]
                try:
                    launches[0][0]()
                    torch.cuda.synchronize()
                except Exception as e:
                    print("   fail", bk, bn, ppsm, st, type(e).__name__, str(e)[:100])
                    continue
                out = launches[0][1]
                ref = out.clone() if ref is None else ref
                d = fp8compile.calc_diff(out, ref)
                us = harness.time_us([f for f, _ in launches]) if d < 1e-5 else None
                rows.append(
                    dict(
                        kind="gemm",
                        n=n,
                        k=k,
                        m=m,
                        bk=bk,
                        bn=bn,
                        ppsm=ppsm,
                        stages=st,
                        split=split,
                        us=us,
                        diff=d,
                    )
                )
                print(
                    f"gemm {n}x{k} M={m} bk {bk} bn {bn} ppsm {ppsm} st {st} split {split}: "
                    f"{us and round(us, 2)} us ({us and round(n * k / us / 1e6, 2)} TB/s) diff {d:.1e}",
                    flush=True,
                )
        del ws
        print(f"-- {n}x{k} done at {time.time() - t0:.0f} s", flush=True)
    device = torch.cuda.get_device_name(0)
    (out_dir / "wide_k.json").write_text(json.dumps(dict(device=device, rows=rows), indent=1))
    for kind, keys in (("read", ("n", "k")), ("gemm", ("n", "k", "m"))):
        groups = {}
        for r in rows:
            if r["kind"] == kind and r["us"]:
                groups.setdefault(tuple(r[c] for c in keys), []).append(r)
        for key, rs in groups.items():
            best = min(rs, key=lambda r: r["us"])
            base = rs[0]
            print(
                f"{kind} {key}: first {base['us']:.2f} us; best {best['us']:.2f} us "
                f"(bk {best['bk']} bn {best['bn']} ppsm {best['ppsm']} st {best['stages']}, "
                f"{best['n'] * best['k'] / best['us'] / 1e6:.2f} TB/s)"
            )


if __name__ == "__main__":
    import pathlib

    p = argparse.ArgumentParser()
    p.add_argument("--out", type=pathlib.Path)
    p.add_argument("--check", action="store_true")
    a = p.parse_args()
    if a.check:
        check()
    else:
        main(a.out)
