"""Probe (issue 18): the scaled recipes' decode kernel against the block recipe's and cuBLAS's
rowwise _scaled_mm, one linear at decode sizes, CUDA-graph replay (weights past L2)."""

import json
import os
import sys

import torch
import triton

from fp8compile.ops import decode_op, reference, reference_scaled, scaled_cublas, triton_gemm, triton_scaled

SHAPES = [(28672, 4096), (4096, 14336), (6144, 4096)]  # Llama-3-8B gate|up, down, qkv


def bench(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=200) * 1e3


rows = []
for n, k in SHAPES:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    wb = reference.quant_weight_block(w)
    wr = reference_scaled.quant_weight_scaled(w, "rowwise")
    wt = reference_scaled.quant_weight_scaled(w, "tensor")
    for m in (1, 16, 32):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        max_m = 16 if m <= 16 else 32
        v = {
            "bf16": lambda: torch.nn.functional.linear(x, w),
            "block_small_m": lambda: triton_gemm.linear_small_m(x, *wb),
            "block_decode_op": lambda: decode_op.linear_decode(x, *wb, max_m=max_m),
            "rowwise_small_m": lambda: triton_scaled.linear_scaled_small_m(x, *wr, recipe="rowwise"),
            "rowwise_decode_op": lambda: triton_scaled.linear_scaled_decode(x, *wr, max_m=max_m),
            "tensor_small_m": lambda: triton_scaled.linear_scaled_small_m(x, *wt, recipe="tensor"),
            "rowwise_cublas": lambda: scaled_cublas.linear_scaled_cublas(x, *wr, recipe="rowwise"),
            "tensor_cublas": lambda: scaled_cublas.linear_scaled_cublas(x, *wt, recipe="tensor"),
        }
        for name, fn in v.items():
            fn()
            us = bench(fn)
            rows.append(
                dict(n=n, k=k, m=m, variant=name, us=us, tbps=n * k * (2 if name == "bf16" else 1) / us / 1e6)
            )
            print(
                f"N={n:>6} K={k:>6} M={m:>3} {name:<18} {us:8.1f} us {rows[-1]['tbps']:.2f} TB/s", flush=True
            )
json.dump(
    rows,
    open(os.path.join(os.environ.get("OUT", "."), sys.argv[1] if len(sys.argv) > 1 else "probe.json"), "w"),
    indent=1,
)
