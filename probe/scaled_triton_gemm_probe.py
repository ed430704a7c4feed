"""The scaled recipes' Triton large-M GEMM (ops/triton_scaled_gemm.py, quantization included)
against the cuBLAS side (ops/scaled_cublas.py, fast accumulation), rowwise, on two Llama-3-8B
shapes: us (triton.testing.do_bench) and calc_diff against the reference."""

import json
import os

import torch
import triton

from fp8compile.numerics import calc_diff
from fp8compile.ops import reference_scaled as rs
from fp8compile.ops.scaled_cublas import linear_scaled_cublas
from fp8compile.ops.triton_scaled_gemm import linear_scaled_large_m

rows = []
for n, k in [(14336, 4096), (4096, 14336)]:
    w_fp8, w_scale = rs.quant_weight_scaled(torch.randn(n, k, device="cuda").mul(0.02).bfloat16(), "rowwise")
    for m in (16, 128, 1024, 4096):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = rs.linear_scaled(x, w_fp8, w_scale)
        r = dict(m=m, n=n, k=k)
        for name, fn in {
            "cublas_fast": lambda: linear_scaled_cublas(x, w_fp8, w_scale, fast_accum=True),
            "triton": lambda: linear_scaled_large_m(x, w_fp8, w_scale),
        }.items():
            try:
                r[f"{name}_calc_diff"] = calc_diff(fn().float(), ref.float())
                r[f"{name}_us"] = triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3
            except Exception as e:
                r[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(r)
        print(r, flush=True)
json.dump(
    rows, open(os.path.join(os.environ.get("OUT", "."), "scaled_triton_gemm_probe.json"), "w"), indent=1
)
