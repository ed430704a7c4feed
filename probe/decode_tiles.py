"""Probe: the decode kernels' tiles, old against wider K steps (more bytes in flight per
program, fewer programs, less split-K). Block kernel (_linear_small_m_kernel, traced form:
pointer loads, no PDL) plain and gated, with STEP groups a loop step; rowwise kernel
(_scaled_small_m_kernel, traced form: amax given) with BLOCK_K 128-512. Llama-3-8B and
Qwen2.5-7B decode weights; (M, BLOCK_M) as the model runs them.

    python probe/decode_tiles.py --out DIR            # GPU: timings
    TRITON_INTERPRET=1 python probe/decode_tiles.py --check   # CPU: configs agree with the first
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

import fp8compile
from fp8compile.numerics import AMAX_EPS, FP8_MAX
from fp8compile.ops import reference, reference_scaled, triton_gemm, triton_quant, triton_scaled

SHAPES = [
    (28672, 4096),
    (4096, 14336),
    (6144, 4096),
    (4096, 4096),
    (37888, 3584),
    (3584, 18944),
    (4608, 3584),
    (3584, 3584),
]
DOWN = {(4096, 14336), (3584, 18944)}
MS = [(1, 16), (16, 16), (16, 32), (32, 32)]
# (BLOCK_N, STEP, programs per SM, stages); the first is the shipped one
BLOCK_PLAIN = [(128, 1, 2, 3), (64, 2, 1, 4), (64, 2, 1, 3), (128, 2, 1, 3), (64, 2, 2, 4), (64, 4, 1, 3)]
BLOCK_GATED = [(256, 1, 1, 3), (256, 2, 1, 3), (128, 2, 1, 4), (128, 2, 1, 3), (64, 2, 1, 4), (128, 1, 1, 4)]
# (BLOCK_K, BLOCK_N, programs per SM, stages)
SCALED = [
    (128, 128, 2, 3),
    (256, 64, 1, 4),
    (256, 64, 1, 3),
    (512, 64, 1, 4),
    (256, 64, 2, 4),
    (256, 128, 1, 4),
]


def _split(n, k, block_n, step_k, ppsm, sms):
    return max(1, min(k // step_k, round(ppsm * sms / math.ceil(n / block_n))))


def block_launch(x, b, w, s, block_m, block_n, step, split, stages):
    m, k = x.shape
    n = w.shape[0]
    n_tiles = math.ceil(n / block_n)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    partial = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    arrivals = triton_gemm.split_k_counters(x.device, n_tiles, split)
    b_ = x if b is None else b
    args = (
        x,
        x,
        b_,
        w,
        w,
        s,
        s,
        out,
        partial,
        *arrivals,
        m,
        n,
        k,
        x.stride(0),
        x.stride(1),
        b_.stride(0),
        b_.stride(1),
        w.stride(0),
        s.stride(0),
        s.stride(1),
        out.stride(0),
        AMAX_EPS,
        FP8_MAX,
        1.702,
        7.0,
    )
    constexprs = dict(
        E8M0=False,
        ACT=triton_quant.activation_code(b, "silu"),
        HAS_BIAS=False,
        TMA=False,
        ACT_TMA=False,
        PDL=False,
        TRIGGER=False,
        PREFETCH=1,
        SPLIT_K=split,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        GROUP=128,
        STEP=step,
    )
    launch = {} if x.device.type == "cpu" else dict(num_warps=4, num_stages=stages)
    return (lambda: triton_gemm._small_m_launch((n_tiles, split), args, constexprs, **launch)), out


def scaled_launch(x, amax, w, s, block_m, block_k, block_n, split, stages):
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tiles = (block_m, block_n, split, math.ceil(n / block_n))
    grid, args, constexprs = triton_scaled._launch_arguments(
        x, None, triton_scaled.NO_ACT, w, s, None, "rowwise", None, 0.0, False, out, tiles, traced=True
    )
    args = list(args)
    args[4] = amax
    constexprs.update(BLOCK_K=block_k, EVEN_K=k % block_k == 0)
    launch = {} if x.device.type == "cpu" else dict(num_warps=4, num_stages=stages)
    return (lambda: triton_scaled._launch(grid, args, constexprs, **launch)), out


def check():
    torch.manual_seed(0)
    n, k = 96, 1024
    wb, sb = reference.quant_weight_block(torch.randn(n, k) * 0.02)
    ws, ss = reference_scaled.quant_weight_scaled(torch.randn(n, k) * 0.02, "rowwise")
    for m in (1, 5):
        x = torch.randn(m, k, dtype=torch.bfloat16)
        b = torch.randn(m, k, dtype=torch.bfloat16)
        for gate in (None, b):
            outs = []
            for bn, step, split in [(32, 1, 2), (32, 2, 2), (32, 2, 3), (64, 4, 1), (16, 2, 5)]:
                fn, out = block_launch(x, gate, wb, sb, 16, bn, step, split, 3)
                fn()
                outs.append(out.clone())
            print("block", m, gate is not None, [f"{fp8compile.calc_diff(o, outs[0]):.1e}" for o in outs])
            assert all(torch.equal(o, outs[0]) for o in outs[:2]), "STEP 2 must keep the bits of STEP 1"
            assert all(fp8compile.calc_diff(o, outs[0]) < 1e-6 for o in outs)
        amax = x.float().abs().amax(1)
        outs = []
        for bk, bn, split in [(128, 32, 2), (256, 32, 2), (512, 32, 2), (256, 64, 1)]:
            fn, out = scaled_launch(x, amax, ws, ss, 16, bk, bn, split, 3)
            fn()
            outs.append(out.clone())
        print("scaled", m, [f"{fp8compile.calc_diff(o, outs[0]):.1e}" for o in outs])
        assert all(fp8compile.calc_diff(o, outs[0]) < 1e-5 for o in outs)
    print("ok")


def main(out_dir):
    from fp8compile.bench import harness

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    t0 = time.time()

    def record(kind, n, k, m, block_m, cfg, split, launches):
        try:
            launches[0][0]()
            torch.cuda.synchronize()
        except Exception as e:
            print("   fail", kind, cfg, type(e).__name__, str(e)[:100])
            return
        out = launches[0][1].clone()
        key = (kind, n, k, m, block_m)
        ref = refs.setdefault(key, out)
        d = fp8compile.calc_diff(out, ref)
        us = harness.time_us([f for f, _ in launches]) if d < 1e-5 else None
        rows.append(dict(kind=kind, n=n, k=k, m=m, block_m=block_m, cfg=cfg, split=split, us=us, diff=d))
        print(
            f"{kind} {n}x{k} M={m}/{block_m} {cfg} split {split}: {us and round(us, 2)} us "
            f"({us and round(n * k / us / 1e6, 2)} TB/s) diff {d:.1e}",
            flush=True,
        )

    refs = {}
    for n, k in SHAPES:
        copies = harness.copies(n * k)
        wb = [
            reference.quant_weight_block(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
            for _ in range(copies)
        ]
        ws = [
            reference_scaled.quant_weight_scaled(
                torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, "rowwise"
            )
            for _ in range(copies)
        ]
        for m, block_m in MS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            gate = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            amax = x.float().abs().amax(1)
            for cfg in BLOCK_PLAIN:
                bn, step, ppsm, st = cfg
                split = _split(n, k, bn, 128 * step, ppsm, sms)
                record(
                    "block",
                    n,
                    k,
                    m,
                    block_m,
                    cfg,
                    split,
                    [block_launch(x, None, w, s, block_m, bn, step, split, st) for w, s in wb],
                )
            for cfg in BLOCK_GATED if (n, k) in DOWN else ():
                bn, step, ppsm, st = cfg
                split = _split(n, k, bn, 128 * step, ppsm, sms)
                record(
                    "gated",
                    n,
                    k,
                    m,
                    block_m,
                    cfg,
                    split,
                    [block_launch(gate, x, w, s, block_m, bn, step, split, st) for w, s in wb],
                )
            for cfg in SCALED:
                bk, bn, ppsm, st = cfg
                split = _split(n, k, bn, bk, ppsm, sms)
                record(
                    "scaled",
                    n,
                    k,
                    m,
                    block_m,
                    cfg,
                    split,
                    [scaled_launch(x, amax, w, s, block_m, bk, bn, split, st) for w, s in ws],
                )
        del wb, ws
        print(f"-- {n}x{k} done at {time.time() - t0:.0f} s", flush=True)
    (out_dir / "decode_tiles.json").write_text(
        json.dumps(dict(device=torch.cuda.get_device_name(0), rows=rows), indent=1)
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
