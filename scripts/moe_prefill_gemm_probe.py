"""Probe (one session): the routed experts at prefill sizes with Triton grouped GEMMs in place of
the Gluon kernel's, GPU time under a CUDA graph (bench harness), so that the whole prefill path
of fp8compile::moe could be launches Inductor makes (a Gluon kernel is not one).

    python scripts/moe_prefill_gemm_probe.py            # writes $OUT/moe_prefill_gemm_probe.json

Per layer (Qwen3-30B-A3B, DeepSeek-V3 widths) and token count: the op's Gluon path
(triton_moe.moe_gluon), and the Triton pipeline (route, quantize, _moe_gemm_kernel, activation,
_moe_gemm_kernel, top-k sum) in each tile config, with the calc_diff of its output against the
Gluon path's. Also the two GEMMs alone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from fp8compile.bench.harness import time_us
from fp8compile.numerics import BLOCK, calc_diff
from fp8compile.ops import triton_moe
from fp8compile.ops.triton_quant import quant_act

OUT = Path(os.environ.get("OUT", "/tmp/out"))
LAYERS = {"qwen3-30b-a3b": (2048, 768, 128, 8), "deepseek-v3": (7168, 2048, 256, 8)}
TOKENS = [512, 2048, 8192]
CONFIGS = [  # (BLOCK_M, num_warps, num_stages)
    (64, 4, 3),
    (64, 4, 4),
    (64, 8, 4),
    (128, 8, 3),
    (128, 8, 4),
    (128, 4, 3),
]


def triton_pipeline(x, ids, weights, w13, w2, block_m, warps, stages):
    """moe_triton's Triton path with the GEMM's tiles given."""
    w13_fp8, w13_scale = w13
    w2_fp8, w2_scale = w2
    t, k = ids.shape
    num_experts, two_i, _ = w13_fp8.shape
    s = t * k
    slots, block_expert = triton_moe.route(ids, num_experts, block_m)
    x_fp8, x_scale = quant_act(x, False, "row")

    def gemm(a, a_scale, w_fp8, w_scale, rows_per_a):
        c = torch.empty(s, w_fp8.shape[1], dtype=torch.bfloat16, device=x.device)
        grid, args, constexprs, _ = triton_moe.grouped_gemm_arguments(
            a, a_scale, w_fp8, w_scale, None, c, slots, block_expert, s, rows_per_a, block_m
        )
        triton_moe._moe_gemm_kernel[grid](*args, **constexprs, num_warps=warps, num_stages=stages)
        return c

    c1 = gemm(x_fp8, x_scale, w13_fp8, w13_scale, k)
    half = two_i // 2
    h_fp8, h_scale = quant_act(c1[:, :half], False, "row", b=c1[:, half:])
    c2 = gemm(h_fp8, h_scale, w2_fp8, w2_scale, 1)
    return triton_moe.topk_sum(c2, ids, weights, num_experts, None, out_dtype=x.dtype)


def random_experts(e: int, n: int, k: int):
    """FP8 expert weights (E, N, K) and their block scales, random (DeepSeek-V3's 256 experts in
    bf16 would not fit beside their quantization's fp32 copy)."""
    w = torch.empty(e, n, k, device="cuda", dtype=torch.float8_e4m3fn)
    for i in range(e):
        w[i] = (torch.randn(n, k, device="cuda") * 100).to(torch.float8_e4m3fn)
    return w, torch.rand(e, n // BLOCK, k // BLOCK, device="cuda") * 1e-4


def main() -> None:
    rows = []
    torch.manual_seed(0)
    for name, (hidden, inter, experts, top_k) in LAYERS.items():
        w13, w2 = random_experts(experts, 2 * inter, hidden), random_experts(experts, hidden, inter)
        for t in TOKENS:
            x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
            ids = torch.topk(torch.rand(t, experts, device="cuda"), top_k, dim=-1).indices.int()
            weights = torch.rand(t, top_k, device="cuda").softmax(-1)

            def gluon():
                return triton_moe.moe_gluon(x, ids, weights, *w13, *w2)

            ref = gluon()
            row = dict(layer=name, tokens=t, slots_per_expert=t * top_k / experts, gluon_us=time_us([gluon]))
            for block_m, warps, stages in CONFIGS:
                key = f"triton_m{block_m}_w{warps}_s{stages}"

                def run(block_m=block_m, warps=warps, stages=stages):
                    return triton_pipeline(x, ids, weights, w13, w2, block_m, warps, stages)

                try:
                    row[key + "_calc_diff"] = float(calc_diff(run().double(), ref.double()))
                    row[key + "_us"] = time_us([run])
                except Exception as e:  # a config the compiler refuses (shared memory): say so
                    row[key + "_us"] = f"{type(e).__name__}: {str(e)[:100]}"
            print(json.dumps(row))
            rows.append(row)
        w13 = w2 = None  # free this layer before the next
        torch.cuda.empty_cache()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "moe_prefill_gemm_probe.json").write_text(
        json.dumps(dict(device=torch.cuda.get_device_name(0), block=BLOCK, rows=rows), indent=1)
    )


if __name__ == "__main__":
    main()
