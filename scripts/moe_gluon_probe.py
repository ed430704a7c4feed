"""The routed-experts op with the grouped Gluon GEMMs (triton_moe.moe_gluon) against the Triton
kernel's path and DeepGEMM's op, on uniform random routing, and where the Gluon path's time goes.
Qwen3-30B-A3B (128 experts, top-8, hidden 2048, expert intermediate 768) and DeepSeek-V3 (256,
top-8, 7168, 2048) shapes. Writes $OUT/moe_gluon_probe.json."""
import json
import os

import torch
import triton

from fp8compile import calc_diff, registry
from fp8compile.ops import gluon_gemm, reference
from fp8compile.ops import triton_moe as tm
from fp8compile.ops.triton_quant import quant_act

torch.manual_seed(0)
dev = "cuda"
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768, (256, 512, 1024, 2048, 4096, 8192)),
          "deepseek-v3": (256, 8, 7168, 2048, (1024, 4096))}


def bench(fn):
    """GPU time of fn replayed in a CUDA graph (as in a reduce-overhead model): no host time."""
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=100)


def quantized(e, n, k):
    """(E, N, K) FP8 experts of N(0, 0.02) weights, quantized one expert at a time (memory)."""
    parts = [reference.quant_weight_block(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02)
             for _ in range(e)]
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


rows = []
for name, (E, TOP_K, H, INTER, token_counts) in SHAPES.items():
    w13_fp8, w13_s = quantized(E, 2 * INTER, H)
    w2_fp8, w2_s = quantized(E, H, INTER)
    ws = (w13_fp8, w13_s, w2_fp8, w2_s)
    for tokens in token_counts:
        x = torch.randn(tokens, H, device=dev, dtype=torch.bfloat16)
        ids = torch.topk(torch.rand(tokens, E, device=dev), TOP_K, dim=-1).indices.to(torch.int32)
        weights = torch.softmax(torch.randn(tokens, TOP_K, device=dev), -1)
        row = dict(shape=name, tokens=tokens)
        gluon = tm.moe_gluon(x, ids, weights, *ws)
        saved = tm.GLUON_MIN_SLOTS_PER_EXPERT
        tm.GLUON_MIN_SLOTS_PER_EXPERT = 1 << 30  # the Triton kernel's path
        triton_path = tm.moe_triton(x, ids, weights, *ws)
        row["triton_us"] = bench(lambda: tm.moe_triton(x, ids, weights, *ws))
        tm.GLUON_MIN_SLOTS_PER_EXPERT = saved
        row["gluon_us"] = bench(lambda: tm.moe_gluon(x, ids, weights, *ws))
        row["gluon_128_rows_us"] = bench(lambda: tm.moe_gluon(x, ids, weights, *ws, config=gluon_gemm.CONFIG))
        row["gluon_128_rows_same_bits"] = torch.equal(tm.moe_gluon(x, ids, weights, *ws, config=gluon_gemm.CONFIG),
                                                      gluon)
        row["calc_diff_gluon_triton"] = calc_diff(gluon, triton_path)
        try:
            dg = registry.implementation("moe", "deep_gemm")
            row["deep_gemm_calc_diff"] = calc_diff(dg(x, ids, weights, *ws), gluon)
            row["deep_gemm_us"] = bench(lambda: dg(x, ids, weights, *ws))
        except Exception as e:  # noqa: BLE001
            row["deep_gemm_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        if tokens in (2048, 4096):  # the Gluon path's parts
            s = ids.numel()
            bm = gluon_gemm.grouped_config(2 * INTER, H)["BLOCK_M"]
            slots, block_expert = tm.route(ids, E, bm)
            x_fp8, x_scale = quant_act(x, False, "row")
            a, a_s, rmap = tm.gather_rows(x_fp8, x_scale, slots, block_expert, s, TOP_K, bm)
            c1 = gluon_gemm.grouped_gemm(a, a_s, w13_fp8, w13_s, block_expert)
            h, h_s = quant_act(c1[:, :INTER], False, "row", b=c1[:, INTER:])
            c2 = gluon_gemm.grouped_gemm(h, h_s, w2_fp8, w2_s, block_expert)
            active_rows = int((block_expert >= 0).sum()) * bm
            row.update(
                rows=slots.numel(), active_rows=active_rows,
                route_us=bench(lambda: tm.route(ids, E, bm)),
                quant_us=bench(lambda: quant_act(x, False, "row")),
                gather_us=bench(lambda: tm.gather_rows(x_fp8, x_scale, slots, block_expert, s, TOP_K, bm)),
                gemm1_us=bench(lambda: gluon_gemm.grouped_gemm(a, a_s, w13_fp8, w13_s, block_expert)),
                act_quant_us=bench(lambda: quant_act(c1[:, :INTER], False, "row", b=c1[:, INTER:])),
                gemm2_us=bench(lambda: gluon_gemm.grouped_gemm(h, h_s, w2_fp8, w2_s, block_expert)),
                topk_sum_us=bench(lambda: tm.topk_sum(c2, ids, weights, E, rows=rmap)),
                weights_read_us=(w13_fp8.numel() + w2_fp8.numel()) / 3.35e6,
            )
            row["gemm1_tflops"] = 2 * active_rows * 2 * INTER * H / row["gemm1_us"] / 1e6
            row["gemm2_tflops"] = 2 * active_rows * H * INTER / row["gemm2_us"] / 1e6
        rows.append(row)
        print(json.dumps(row), flush=True)
    torch.cuda.empty_cache()
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "moe_gluon_probe.json"), "w"), indent=1)
