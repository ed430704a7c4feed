"""The routed-experts op at Qwen3-30B-A3B shapes (128 experts, top-8, hidden 2048, expert
intermediate 768) on uniform random routing (seventeenth session, H100):
  --tiles     our grouped GEMM (_moe_gemm_kernel) at 2048 tokens over BLOCK_M, warps, stages
  --backends  the whole op through the triton and deep_gemm backends, 256..4096 tokens
"""
import json
import os
import sys

import torch
import triton

from fp8compile import calc_diff, registry
from fp8compile.numerics import BLOCK
from fp8compile.ops import reference
from fp8compile.ops import triton_moe as tm
from fp8compile.ops.triton_quant import quant_act

torch.manual_seed(0)
E, TOP_K, H, INTER = 128, 8, 2048, 768
dev = "cuda"


def quantized(w):
    return [torch.stack(t) for t in zip(*[reference.quant_weight_block(x) for x in w])]


w13_fp8, w13_s = quantized(torch.randn(E, 2 * INTER, H, device=dev, dtype=torch.bfloat16) * 0.02)
w2_fp8, w2_s = quantized(torch.randn(E, H, INTER, device=dev, dtype=torch.bfloat16) * 0.02)


def routing(tokens):
    return torch.stack([torch.randperm(E, device=dev)[:TOP_K] for _ in range(tokens)]).to(torch.int32)


def gemm(a, a_s, w, w_s, slots, block_expert, rows_per_a, block_m, warps, stages):
    c = torch.empty(a.shape[0] * rows_per_a, w.shape[1], dtype=torch.bfloat16, device=dev)  # one row per slot
    tm._moe_gemm_kernel[(block_expert.numel(), w.shape[1] // BLOCK)](
        a, a_s, w, w_s, c, c, slots, block_expert, c.shape[0], w.shape[2], rows_per_a,
        a.stride(0), a_s.stride(0), w.stride(0), w.stride(1), w_s.stride(0), w_s.stride(1), 0, c.stride(0),
        HAS_BIAS=False, BLOCK_M=block_m, BLOCK_N=BLOCK, BLOCK_K=BLOCK, num_warps=warps, num_stages=stages)
    return c


rows = []
if "--tiles" in sys.argv:
    tokens = 2048
    ids = routing(tokens)
    x_fp8, x_s = quant_act(torch.randn(tokens, H, device=dev, dtype=torch.bfloat16), False, "row")
    h_fp8, h_s = quant_act(torch.randn(tokens * TOP_K, INTER, device=dev, dtype=torch.bfloat16), False, "row")
    for block_m in (64, 128):
        slots, block_expert = tm.route(ids, E, block_m)
        for warps in (4, 8):
            for stages in (2, 3, 4, 5):
                t1 = triton.testing.do_bench(lambda: gemm(x_fp8, x_s, w13_fp8, w13_s, slots, block_expert, TOP_K,
                                                          block_m, warps, stages), warmup=50, rep=300)
                t2 = triton.testing.do_bench(lambda: gemm(h_fp8, h_s, w2_fp8, w2_s, slots, block_expert, 1,
                                                          block_m, warps, stages), warmup=50, rep=300)
                rows.append(dict(block_m=block_m, warps=warps, stages=stages, gemm1_us=t1 * 1e3, gemm2_us=t2 * 1e3))
                print(rows[-1])
    print("reading the FP8 weights once at 3.35 TB/s, us:", w13_fp8.numel() / 3.35e6, w2_fp8.numel() / 3.35e6)
if "--backends" in sys.argv:
    for tokens in (256, 512, 1024, 2048, 4096):
        x = torch.randn(tokens, H, device=dev, dtype=torch.bfloat16)
        ids, weights = routing(tokens), torch.softmax(torch.randn(tokens, TOP_K, device=dev), -1)
        row, outs = dict(tokens=tokens), {}
        for name in ("triton", "deep_gemm"):
            fn = registry.implementation("moe", name)
            outs[name] = fn(x, ids, weights, w13_fp8, w13_s, w2_fp8, w2_s)
            row[name + "_us"] = 1e3 * triton.testing.do_bench(
                lambda: fn(x, ids, weights, w13_fp8, w13_s, w2_fp8, w2_s), warmup=50, rep=300)
        row["calc_diff"] = calc_diff(outs["triton"], outs["deep_gemm"])
        rows.append(row)
        print(row)
json.dump(rows, open(os.environ.get("OUT", ".") + "/moe_probe.json", "w"), indent=1)
