"""GPU probe behind the decode work (BENCHMARKS.md): where the time goes at small M.

1. Read roofline: the time to stream each benchmark shape's FP8 weight bytes with a plain
   Triton read kernel and with a device copy, beside bf16 cuBLAS, DeepGEMM and our small-M
   kernel, all under CUDA-graph replay with >= 4x L2 of weight copies (as `bench gemm`).
2. Small-M kernel variants, each an experiment on the production kernel's loop: weight tiles
   through TMA descriptors instead of pointer loads, activations quantized beforehand instead
   of inside the loop, and a CUDA-core GEMV for M = 1 instead of a padded tensor-core dot.
3. The MoE op at decode: routing by torch ops vs the one-program routing kernel, the op as a
   whole both ways, and a kernel profile of the compiled Qwen3-30B-A3B block at 1 token.

Run on the device: source .whl/prelude.sh && python scripts/decode_probe.py [--parts 1,2,3]
"""
import argparse
import json
import math
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")
from fp8compile import bench  # noqa: E402
from fp8compile.numerics import AMAX_EPS, FP8_MAX  # noqa: E402
from fp8compile.ops import reference, triton_gemm, triton_moe, triton_quant  # noqa: E402
from fp8compile.ops.triton_quant import quant_group  # noqa: E402

RESULTS = {}


@triton.jit
def _read_kernel(p_ptr, out_ptr, n_chunks, CHUNK: tl.constexpr):
    acc = tl.zeros((CHUNK,), dtype=tl.int32)
    for i in range(tl.program_id(0), n_chunks, tl.num_programs(0)):
        acc ^= tl.load(p_ptr + i.to(tl.int64) * CHUNK + tl.arange(0, CHUNK))
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def read_all(w):
    words = w.view(torch.int32).reshape(-1)
    chunk = 2048
    n_chunks = words.numel() // chunk
    progs = 4 * torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(progs, dtype=torch.int32, device=w.device)
    _read_kernel[(progs,)](words, out, n_chunks, CHUNK=chunk, num_warps=8)
    return out


@triton.jit
def _variant_kernel(x_ptr, xs_ptr, w_ptr, w_desc, w_s_ptr, out_ptr, partial_ptr, arrivals_ptr, M, N, K,
                    stride_xm, stride_xsm, stride_wn, stride_wsn, stride_wsg, stride_om, eps, fp8_max,
                    TMA: tl.constexpr, PREQ: tl.constexpr, GEMV: tl.constexpr, SPLIT_K: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
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
    w_ptrs = w_ptr + safe_n[:, None] * stride_wn + (g0 * GROUP + offs_k)[None, :]
    w_s_ptrs = w_s_ptr + (safe_n // GROUP) * stride_wsn
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for g in range(g0, g1):
        row_mask = offs_m[:, None] < M
        if PREQ:
            x_fp8 = tl.load(x_ptr + offs_m[:, None] * stride_xm + (g * GROUP + offs_k)[None, :], mask=row_mask, other=0.0)
            x_s = tl.load(xs_ptr + offs_m * stride_xsm + g, mask=offs_m < M, other=1.0)
        else:
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (g * GROUP + offs_k)[None, :], mask=row_mask,
                        other=0.0).to(tl.float32)
            x_fp8, x_s = quant_group(x, eps, fp8_max, False)
        if TMA:
            w = w_desc.load([pid_n * BLOCK_N, g * GROUP])
        else:
            w = tl.load(w_ptrs)
        w_s = tl.load(w_s_ptrs + g * stride_wsg)
        if GEMV:  # BLOCK_M = 1: products on CUDA cores, no padded MMA
            part = tl.sum(w.to(tl.float32) * x_fp8.to(tl.float32), axis=1, keep_dims=True)
        else:
            part = tl.dot(w, tl.trans(x_fp8))
        acc += part * w_s[:, None] * x_s[None, :]
        w_ptrs += GROUP
    mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    if SPLIT_K > 1:
        tile = offs_m[None, :] * N + offs_n[:, None]
        tl.store(partial_ptr + pid_k * M * N + tile, acc, mask=mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(SPLIT_K):
                acc += tl.load(partial_ptr + s * M * N + tile, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(arrivals_ptr + pid_n, 0)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def variant(x, w_fp8, w_scale, tma=False, preq=False, gemv=False, block_n=128, ppsm=2, stages=3, warps=4):
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    n = w_fp8.shape[0]
    xs = x
    if preq:
        x, xs = triton_quant.quant_act(x)
    block_m = 1 if gemv else 16 if m <= 16 else 32
    n_tiles = triton.cdiv(n, block_n)
    split = max(1, min(k // 128, round(ppsm * torch.cuda.get_device_properties(0).multi_processor_count / n_tiles)))
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    partial = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    arrivals = triton_gemm._arrival_counters(x.device, n_tiles)
    desc = TensorDescriptor.from_tensor(w_fp8, [block_n, 128]) if tma else w_fp8
    _variant_kernel[(n_tiles, split)](
        x, xs, w_fp8, desc, w_scale, out, partial, arrivals, m, n, k, x.stride(0), xs.stride(0), w_fp8.stride(0),
        w_scale.stride(0), w_scale.stride(1), out.stride(0), AMAX_EPS, FP8_MAX, TMA=tma, PREQ=preq, GEMV=gemv,
        SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=block_n, GROUP=128, num_warps=warps, num_stages=stages)
    return out


TILES = ((128, 2, 3), (128, 2, 5), (128, 4, 4), (64, 4, 4), (64, 2, 6), (128, 1, 6))  # (BLOCK_N, programs/SM, stages)


def part_roofline_and_variants(do_variants: bool, tiles=TILES):
    import deep_gemm

    rows = []
    for n, k in bench.SHAPES:
        r = bench._copies(n * k)
        ws = [reference.quant_weight_block(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(r)]
        w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(bench._copies(2 * n * k))]
        dst = [torch.empty_like(w) for w, _ in ws]
        t_read = bench._time_us([lambda w=w: read_all(w) for w, _ in ws])
        t_copy = bench._time_us([lambda w=w, d=d: d.copy_(w) for (w, _), d in zip(ws, dst)])
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq = triton_quant.quant_act(x, layout="mn_major")
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            t = dict(read=t_read, copy_2x=t_copy,
                     bf16=bench._time_us([lambda w=w: torch.nn.functional.linear(x, w) for w in w16]),
                     deep_gemm=bench._time_us([lambda q=q: deep_gemm.fp8_gemm_nt(xq, q, out, disable_ue8m0_cast=True)
                                               for q in ws]),
                     ours=bench._time_us([lambda q=q: triton_gemm.linear_small_m(x, *q) for q in ws]))
            if do_variants:
                ref = reference.linear_block(x, *ws[0])
                configs = {"ptr": {}, "tma": dict(tma=True), "ptr_preq": dict(preq=True), "tma_preq": dict(tma=True, preq=True)}
                if m == 1:
                    configs.update(gemv=dict(gemv=True), gemv_tma=dict(gemv=True, tma=True))
                for name, cfg in configs.items():
                    for block_n, ppsm, stages in tiles:
                        if cfg.get("gemv") and block_n == 128:
                            continue
                        try:
                            got = variant(x, *ws[0], block_n=block_n, ppsm=ppsm, stages=stages, **cfg)
                            err = (got.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
                        except Exception as e:
                            print(f"  {name} {block_n},{ppsm},{stages}: {type(e).__name__}: {str(e)[:200]}")
                            continue
                        us = bench._time_us([lambda q=q: variant(x, *q, block_n=block_n, ppsm=ppsm, stages=stages, **cfg)
                                             for q in ws])
                        t[f"{name}/{block_n},{ppsm},{stages}"] = us
                        if err > 1e-2:
                            print(f"  {name} {block_n},{ppsm},{stages}: WRONG, max rel err {err:.3g}")
            rows.append(dict(n=n, k=k, m=m, **t))
            best = min((v, key) for key, v in t.items() if v and key not in ("read", "copy_2x", "bf16"))
            tb = lambda us: n * k / us / 1e6  # noqa: E731
            print(f"N={n} K={k} M={m}: read {t_read:.1f} us ({tb(t_read):.2f} TB/s), copy {t_copy:.1f} us "
                  f"({2 * tb(t_copy):.2f} TB/s moved), bf16 {t['bf16']:.1f}, deep_gemm {t['deep_gemm']:.1f}, "
                  f"ours {t['ours']:.1f} ({tb(t['ours']):.2f} TB/s), best {best[1]} {best[0]:.1f} ({tb(best[0]):.2f} TB/s)")
    RESULTS["small_m"] = rows


def part_moe():
    import fp8compile

    rows = []
    for e, s, bm in ((128, 8, 16), (128, 128, 16), (256, 8, 16), (256, 128, 16), (128, 512, 16), (128, 1024, 16),
                     (128, 4096, 32), (128, 8192, 64), (128, 32768, 64), (256, 32768, 64)):
        ids = torch.topk(torch.rand(s // 8, e, device="cuda"), 8, dim=-1).indices
        want = triton_moe.route_torch(ids, e, bm)
        row = dict(what="route", experts=e, slots=s, block_m=bm, torch_us=bench._time_us([lambda: triton_moe.route_torch(ids, e, bm)]))
        for name in ("route_kernel", "route_chunked"):
            if name == "route_kernel" and s > triton_moe.ROUTE_KERNEL_MAX_SLOTS:
                continue
            fn = getattr(triton_moe, name)
            got = fn(ids, e, bm)
            row[name + "_us"] = bench._time_us([lambda fn=fn: fn(ids, e, bm)])
            row[name + "_same"] = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        rows.append(row)
        print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))

    block = bench._moe_block(2048, 768, 128, 8)
    experts = block.experts
    from fp8compile.weights import fp8_experts

    w13, w2 = fp8_experts(experts.gate_up_proj, gate_up="concat"), fp8_experts(experts.down_proj)
    for t in (1, 16, 128, 1024, 4096):
        x = torch.randn(t, 2048, device="cuda", dtype=torch.bfloat16)
        ids = torch.topk(torch.rand(t, 128, device="cuda"), 8, dim=-1).indices
        wts = torch.rand(t, 8, device="cuda", dtype=torch.bfloat16)
        op = lambda: triton_moe.moe_triton(x, ids, wts, *w13, *w2)  # noqa: E731
        kernels_route = triton_moe.route
        triton_moe.route = triton_moe.route_torch
        before = bench._time_us([op])
        ref = op()
        triton_moe.route = kernels_route
        after = bench._time_us([op])
        same = torch.equal(op(), ref)
        rows.append(dict(what="moe_triton", tokens=t, torch_route_us=before, kernel_route_us=after, same=same))
        print(f"moe_triton qwen3 T={t}: torch routing {before:.1f} us, routing kernel {after:.1f} us, same={same}")

    with torch.no_grad():
        torch._dynamo.reset()
        f = torch.compile(block, backend=fp8compile.backend())
        for t in (1, 16):
            x = torch.randn(1, t, 2048, device="cuda", dtype=torch.bfloat16)
            for _ in range(3):
                f(x)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    f(x)
                torch.cuda.synchronize()
            print(f"--- compiled Qwen3-30B-A3B block, fp8 backend, {t} tokens, 10 calls")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))
    RESULTS["moe"] = rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="1,2,3")
    ap.add_argument("--tiles", default=None, help="BLOCK_N,PPSM,STAGES;... (default: all of TILES)")
    args = ap.parse_args()
    parts = args.parts.split(",")
    tiles = TILES if args.tiles is None else [tuple(map(int, t.split(","))) for t in args.tiles.split(";")]
    if "3" in parts:
        part_moe()
    if "1" in parts or "2" in parts:
        part_roofline_and_variants("2" in parts, tiles)
    out = os.environ.get("OUT", "bench_out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "decode_probe.json"), "w") as fh:
        json.dump(RESULTS, fh, indent=1)
    print("geo-mean of best per variant family (M=1,16):")
    fams = {}
    for r in RESULTS.get("small_m", []):
        for key, v in r.items():
            if isinstance(v, float) and "/" in key:
                fams.setdefault(key, []).append(v / r["ours"])
    for key, vs in sorted(fams.items(), key=lambda kv: math.prod(kv[1]) ** (1 / len(kv[1])))[:15]:
        print(f"  {key}: {math.prod(vs) ** (1 / len(vs)):.3f} x ours ({len(vs)} points)")


if __name__ == "__main__":
    main()
