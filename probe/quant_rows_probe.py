"""A gated MLP's act(gate, up) quantized per token (the rowwise recipe's down-projection input):
Inductor's fused kernel (what the traced cuBLAS side compiles today) against two Triton kernels of
ours, at prefill sizes. GPU time (triton.testing.do_bench) and bits against the reference."""

import json
import os

import torch
import triton
import triton.language as tl

from fp8compile.numerics import AMAX_EPS, FP8_MAX, calc_diff
from fp8compile.ops.reference import gated
from fp8compile.ops.reference_scaled import quant_act_scaled


@triton.jit
def _two_pass(g_ptr, u_ptr, q_ptr, s_ptr, M, K, stride_m, stride_qm, eps, fp8_max, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        m = cols < K
        g = tl.load(g_ptr + row * stride_m + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * stride_m + cols, mask=m, other=0.0).to(tl.float32)
        h = (g * tl.sigmoid(g) * u).to(tl.bfloat16).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(h))
    scale = tl.maximum(tl.max(amax, axis=0), eps) / fp8_max
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        m = cols < K
        g = tl.load(g_ptr + row * stride_m + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * stride_m + cols, mask=m, other=0.0).to(tl.float32)
        h = (g * tl.sigmoid(g) * u).to(tl.bfloat16).to(tl.float32)
        tl.store(
            q_ptr + row * stride_qm + cols, tl.clamp(h / scale, -fp8_max, fp8_max).to(tl.float8e4nv), mask=m
        )
    tl.store(s_ptr + row, scale)


@triton.jit
def _one_pass(g_ptr, u_ptr, q_ptr, s_ptr, M, K, stride_m, stride_qm, eps, fp8_max, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_K)
    m = cols < K
    g = tl.load(g_ptr + row * stride_m + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_m + cols, mask=m, other=0.0).to(tl.float32)
    h = (g * tl.sigmoid(g) * u).to(tl.bfloat16).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(h), axis=0), eps) / fp8_max
    tl.store(q_ptr + row * stride_qm + cols, tl.clamp(h / scale, -fp8_max, fp8_max).to(tl.float8e4nv), mask=m)
    tl.store(s_ptr + row, scale)


def ours(kernel, block_k, warps):
    def run(gu, k):
        m = gu.shape[0]
        q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=gu.device)
        s = torch.empty(m, dtype=torch.float32, device=gu.device)
        kernel[(m,)](
            gu,
            gu[:, k:],
            q,
            s,
            m,
            k,
            gu.stride(0),
            q.stride(0),
            AMAX_EPS,
            FP8_MAX,
            BLOCK_K=block_k,
            num_warps=warps,
        )
        return q, s

    return run


def reference(gu, k):
    return quant_act_scaled(gated(gu[:, :k], gu[:, k:]).to(gu.dtype), "rowwise")


rows = []
for m, k in [(4096, 14336), (2048, 14336), (4096, 18944), (4096, 11008)]:
    gu = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)
    ref_q, ref_s = reference(gu, k)
    variants = {"inductor": torch.compile(reference, dynamic=False)}
    for bk, w in [(1024, 4), (2048, 4), (2048, 8), (4096, 8)]:
        variants[f"two_pass_{bk}_w{w}"] = ours(_two_pass, bk, w)
    for w in (8, 16, 32):
        variants[f"one_pass_w{w}"] = ours(_one_pass, triton.next_power_of_2(k), w)
    moved = m * k * (2 * 2 + 1)  # gate and up read (bf16), the FP8 product written
    for name, fn in variants.items():
        try:
            q, s = fn(gu, k)
            same_q = (q.view(torch.uint8) == ref_q.view(torch.uint8)).float().mean().item()
            same_s = torch.equal(s, ref_s)
            diff = calc_diff(q.float() * s[:, None], ref_q.float() * ref_s[:, None])
            us = triton.testing.do_bench(lambda: fn(gu, k), warmup=25, rep=100) * 1e3
            r = dict(
                m=m,
                k=k,
                variant=name,
                us=us,
                tbps=moved / us / 1e6,
                same_q=same_q,
                same_s=same_s,
                calc_diff=diff,
            )
        except Exception as e:  # a variant that does not compile (registers) says so
            r = dict(m=m, k=k, variant=name, error=f"{type(e).__name__}: {str(e)[:120]}")
        rows.append(r)
        print(r)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "quant_rows_probe.json"), "w"), indent=1)
