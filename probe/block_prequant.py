"""Probe: why the block decode kernel's time grows from M = 1 to 32 where DeepGEMM's does not.
The shipped kernel (traced form: pointer loads, in-loop 1x128 quantization) against the same
loop on x quantized beforehand (fp8 x and its group scales loaded per group), our quantization
launch alone, and DeepGEMM's GEMM on the same quantized x. Llama-3-8B's decode weights.

    python probe/block_prequant.py --out DIR
    TRITON_INTERPRET=1 python probe/block_prequant.py --check
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import triton
import triton.language as tl

import fp8compile
from fp8compile.numerics import AMAX_EPS, FP8_MAX
from fp8compile.ops import reference, triton_gemm, triton_quant
from fp8compile.ops.triton_gemm import counters_ptr, store_split_k

SHAPES = [(28672, 4096), (4096, 14336), (6144, 4096), (4096, 4096), (7168, 2048)]


@triton.jit
def _prequant_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    w_s_ptr,
    out_ptr,
    partial_ptr,
    arrivals_hi,
    arrivals_lo,
    M,
    N,
    K,
    stride_xm,
    stride_xsm,
    stride_wn,
    stride_wsn,
    stride_wsg,
    stride_om,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    groups = K // GROUP
    per_split = tl.cdiv(groups, SPLIT_K)
    g0 = pid_k * per_split
    g1 = min(g0 + per_split, groups)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, GROUP)
    safe_n = offs_n % N
    rows = offs_m < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for g in range(g0, g1):
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + (g * GROUP + offs_k)[None, :], mask=rows[:, None], other=0.0
        )
        x_s = tl.load(xs_ptr + offs_m * stride_xsm + g, mask=rows, other=1.0)
        w = tl.load(w_ptr + safe_n[:, None] * stride_wn + (g * GROUP + offs_k)[None, :])
        w_s = tl.load(w_s_ptr + (safe_n // GROUP) * stride_wsn + g * stride_wsg)
        acc += tl.dot(w, tl.trans(x)) * w_s[:, None] * x_s[None, :]
    store_split_k(
        acc,
        out_ptr,
        partial_ptr,
        counters_ptr(arrivals_hi, arrivals_lo),
        w_s_ptr,
        offs_m,
        offs_n,
        M,
        N,
        stride_om,
        False,
        SPLIT_K,
    )


def _tiles(m, n, k, device):
    return triton_gemm._small_m_tiles(m, n, k, False, device, None, None)


def prequant_launch(x8, xs, w, s, block_m):
    m, k = x8.shape
    n = w.shape[0]
    _, block_n, split, n_tiles = _tiles(m, n, k, x8.device)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x8.device)
    partial = torch.empty(split, m, n, dtype=torch.float32, device=x8.device) if split > 1 else out
    arrivals = triton_gemm.split_k_counters(x8.device, n_tiles, split)
    launch = {} if x8.device.type == "cpu" else dict(num_warps=4, num_stages=3)

    def run():
        _prequant_kernel[(n_tiles, split)](
            x8,
            xs,
            w,
            s,
            out,
            partial,
            *arrivals,
            m,
            n,
            k,
            x8.stride(0),
            xs.stride(0),
            w.stride(0),
            s.stride(0),
            s.stride(1),
            out.stride(0),
            SPLIT_K=split,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            GROUP=128,
            **launch,
        )

    return run, out


def shipped_launch(x, w, s, block_m, split=None, block_n=None):
    m, k = x.shape
    n = w.shape[0]
    _, block_n_, split_, n_tiles = _tiles(m, n, k, x.device)
    split, block_n = split or split_, block_n or block_n_
    n_tiles = math.ceil(n / block_n)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    partial = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    arrivals = triton_gemm.split_k_counters(x.device, n_tiles, split)
    args = (
        x,
        x,
        x,
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
        x.stride(0),
        x.stride(1),
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
        ACT=0,
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
    )
    launch = {} if x.device.type == "cpu" else dict(num_warps=4, num_stages=3)
    return (lambda: triton_gemm._small_m_launch((n_tiles, split), args, constexprs, **launch)), out


def check():
    torch.manual_seed(0)
    n, k = 96, 512
    w, s = reference.quant_weight_block(torch.randn(n, k) * 0.02)
    for m in (1, 5):
        x = torch.randn(m, k, dtype=torch.bfloat16)
        x8, xs = triton_quant.quant_act(x)
        a, out_a = shipped_launch(x, w, s, 16)
        b, out_b = prequant_launch(x8, xs, w, s, 16)
        a()
        b()
        d = fp8compile.calc_diff(out_b, out_a)
        print(m, f"{d:.1e}")
        assert d < 1e-6
    print("ok")


def splits(out_dir):
    """The shipped kernel at its split and at fewer splits (less fp32 partial traffic, which
    grows with M), and at 64-wide N tiles."""
    from fp8compile.bench import harness

    rows = []
    for n, k in SHAPES:
        ws = [
            reference.quant_weight_block(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
            for _ in range(harness.copies(n * k))
        ]
        for m, block_m in [(1, 16), (16, 16), (16, 32), (32, 32)]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            _, _, split, _ = _tiles(m, n, k, x.device)
            ref = None
            t = {}
            for bn, sp in [
                (128, split),
                (128, max(1, split // 2)),
                (128, max(1, split // 4)),
                (64, max(1, split // 2)),
                (64, split),
            ]:
                fns = [shipped_launch(x, w, s, block_m, sp, bn) for w, s in ws]
                fns[0][0]()
                out = fns[0][1].clone()
                ref = out if ref is None else ref
                d = fp8compile.calc_diff(out, ref)
                t[f"bn{bn}_split{sp}"] = harness.time_us([f for f, _ in fns]) if d < 1e-5 else None
            rows.append(dict(n=n, k=k, m=m, block_m=block_m, **t))
            print(n, k, m, block_m, {a: round(b, 1) if b else b for a, b in t.items()}, flush=True)
    (out_dir / "block_splits.json").write_text(
        json.dumps(dict(device=torch.cuda.get_device_name(0), rows=rows), indent=1)
    )


def main(out_dir):
    from fp8compile.bench import harness
    import deep_gemm

    rows = []
    for n, k in SHAPES:
        ws = [
            reference.quant_weight_block(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
            for _ in range(harness.copies(n * k))
        ]
        for m, block_m in [(1, 16), (16, 16), (16, 32), (32, 32)]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            x8, xs = triton_quant.quant_act(x)
            x8t, xst = triton_quant.quant_act(x, layout="mn_major")
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            t = {}
            t["shipped"] = harness.time_us([shipped_launch(x, w, s, block_m)[0] for w, s in ws])
            t["prequant_gemm"] = harness.time_us([prequant_launch(x8, xs, w, s, block_m)[0] for w, s in ws])
            t["quant"] = harness.time_us([lambda: triton_quant.quant_act(x)])
            t["prequant_with_quant"] = harness.time_us(
                [
                    lambda w=w, s=s: prequant_launch(*triton_quant.quant_act(x), w, s, block_m)[0]()
                    for w, s in ws
                ]
            )
            t["deep_gemm"] = harness.time_us(
                [lambda q=q: deep_gemm.fp8_gemm_nt((x8t, xst), q, out, disable_ue8m0_cast=True) for q in ws]
            )
            rows.append(dict(n=n, k=k, m=m, block_m=block_m, **t))
            print(n, k, m, block_m, {a: round(b, 1) if b else b for a, b in t.items()}, flush=True)
    (out_dir / "block_prequant.json").write_text(
        json.dumps(dict(device=torch.cuda.get_device_name(0), rows=rows), indent=1)
    )


if __name__ == "__main__":
    import pathlib

    p = argparse.ArgumentParser()
    p.add_argument("--out", type=pathlib.Path)
    p.add_argument("--check", action="store_true")
    p.add_argument("--splits", action="store_true")
    a = p.parse_args()
    if a.check:
        check()
    elif a.splits:
        splits(a.out)
    else:
        main(a.out)
