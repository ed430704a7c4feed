"""`python -m fp8compile bench mqa`: a sparse-attention indexer's logits (DeepSeek-V3.2: H = 64
heads of D = 128, one key head), ours (Triton) and DeepGEMM's FP8 kernels against the bf16/fp32
composition transformers runs (DeepseekV32Indexer), compiled by Inductor; and the same
composition compiled with backend="fp8" (the mqa_logits pass rewrites it); both compiled with
dynamic sizes.

prefill: M query tokens against N = M keys of one sequence, causal windows.
decode:  paged, one new token per sequence (next_n = 1), blocks of 64 keys, context C; the
         kernels read B * C * (D + 4) bytes of FP8 keys and scales: TB/s against that read.
         `deep_gemm` is DeepGEMM's kernel through the op (its adapter's work included),
         `deep_gemm_kernel` the kernel alone, the anchor ours is held to.
Times: harness.py (CUDA-graph replay, median us).
"""

from __future__ import annotations

from pathlib import Path

import torch

import fp8compile

from . import harness
from .output import best_fixed, save

HEADS, HEAD_DIM, BLOCK = 64, 128, 64
PREFILL = [4096, 8192]
DECODE = [(1, 4096), (16, 4096), (64, 4096), (1, 65536), (16, 65536), (64, 65536)]


def indexer_score(q, k, w):
    """transformers' DeepseekV32Indexer score: q (B, S, H, D), k (B, T, D), w (B, S, H) -> (B, S, T)."""
    scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * HEAD_DIM**-0.5
    scores = torch.relu(scores)
    weights = w.float() * HEADS**-0.5
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)


class Indexer(torch.nn.Module):
    """The score and its mask, as a model holds them."""

    def forward(self, q, k, w, mask=None):
        score = indexer_score(q, k, w)
        return score if mask is None else score.masked_fill(~mask, float("-inf"))


def _fp8_inputs(q, k, w):
    """What the kernels take: q and k quantized per row, q's scales and the constants in the weights."""
    from fp8compile.ops.mqa_logits.reference import quant_rows

    q_fp8, q_scale = quant_rows(q.flatten(0, 1))
    k_fp8, k_scale = quant_rows(k.flatten(0, 1))
    weights = w.flatten(0, 1).float() * q_scale * (HEAD_DIM**-0.5 * HEADS**-0.5)
    return q_fp8, k_fp8, k_scale, weights


def _prefill_rows(m: int) -> list[dict]:
    gen = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(1, m, HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    k = torch.randn(1, m, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    w = torch.randn(1, m, HEADS, device="cuda", generator=gen).bfloat16()
    causal = torch.ones(m, m, dtype=torch.bool, device="cuda").tril()
    q_fp8, k_fp8, k_scale, weights = _fp8_inputs(q, k, w)
    ks = torch.zeros(m, dtype=torch.int32, device="cuda")
    ke = torch.arange(1, m + 1, dtype=torch.int32, device="cuda")
    fp8 = fp8compile.backend()
    # Dynamic sizes on both sides, as a model's prefill runs after its first length: at static
    # sizes the pass checks its match by replaying it at them, and at 8192 tokens the replay's fp32
    # scores do not fit (the pass then declines, saying so: passes/mqa_logits.py).
    bf16_model = torch.compile(Indexer(), dynamic=True)
    fp8_model = torch.compile(Indexer(), backend=fp8, dynamic=True)
    variants = {
        "bf16_composition": lambda: bf16_model(q, k, w, causal),
        "fp8_compiled": lambda: fp8_model(q, k, w, causal),
    }
    for backend in ("triton", "deep_gemm"):
        op = torch.ops.fp8compile.mqa_logits
        variants[backend] = lambda b=backend: op(q_fp8, k_fp8, k_scale, weights, ks, ke, False, 0, b)
    rows = []
    for name, fn in variants.items():
        torch._dynamo.reset()
        us = harness.time_us([fn])
        rows.append(dict(kind="prefill", m=m, n=m, variant=name, us=us))
        print(f"prefill M=N={m} {name:<17} {us if us is None else round(us, 1)} us", flush=True)
    print(f"fp8 backend: {fp8.report.counts()}")
    return rows


def _decode_case(batch: int, context: int) -> dict:
    """One decode point's inputs: B sequences of `context` keys in blocks of BLOCK, one new token
    each; the FP8 cache and queries, and the same keys contiguous in bf16 for the composition."""
    from fp8compile.ops.mqa_logits.reference import quant_index_cache

    gen = torch.Generator("cuda").manual_seed(0)
    blocks_each = context // BLOCK
    keys = torch.randn(batch * blocks_each, BLOCK, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    tables = torch.randperm(batch * blocks_each, device="cuda", generator=gen).view(batch, blocks_each)
    tables = tables.to(torch.int32)
    q = torch.randn(batch, 1, HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    w = torch.randn(batch, 1, HEADS, device="cuda", generator=gen).bfloat16()
    q_fp8, _, _, weights = _fp8_inputs(q, keys[:1], w)
    return dict(
        q=q,
        w=w,
        k_bf16=keys[tables.long()].view(batch, context, HEAD_DIM),
        q_fp8=q_fp8.view(batch, 1, HEADS, HEAD_DIM),
        cache=quant_index_cache(keys),
        weights=weights,
        lens=torch.full((batch,), context, dtype=torch.int32, device="cuda"),
        tables=tables,
    )


def _decode_rows(batch: int, context: int) -> list[dict]:
    from fp8compile.ops.mqa_logits.triton_mqa import schedule_programs

    case = _decode_case(batch, context)
    q, w, k_bf16, q_fp8 = case["q"], case["w"], case["k_bf16"], case["q_fp8"]
    cache, weights, lens, tables = case["cache"], case["weights"], case["lens"], case["tables"]
    bf16_model = torch.compile(Indexer())
    variants = {"bf16_composition": lambda: bf16_model(q, k_bf16, w)}
    sched = torch.ops.fp8compile.paged_mqa_logits_metadata(lens, BLOCK, schedule_programs(q.device), "triton")
    variants["triton"] = lambda: torch.ops.fp8compile.paged_mqa_logits(
        q_fp8, cache, weights, lens, tables, sched, context, False, "triton"
    )
    try:
        deep_gemm = _deep_gemm_paged(q_fp8, cache, weights, lens, tables, context)
        ours = variants["triton"]()
        print(f"    deep_gemm against triton: calc_diff {fp8compile.calc_diff(deep_gemm(), ours):.2e}")
        variants["deep_gemm"] = deep_gemm
        variants["deep_gemm_kernel"] = _deep_gemm_paged_kernel(q_fp8, cache, weights, lens, tables, context)
    except Exception as e:  # DeepGEMM missing or refusing: the other rows still count
        print(f"    deep_gemm paged: {type(e).__name__}: {str(e)[:160]}")
    rows = []
    read = batch * context * (HEAD_DIM + 4)
    for name, fn in variants.items():
        torch._dynamo.reset()
        us = harness.time_us([fn])
        tbps = None if us is None or name == "bf16_composition" else read / us / 1e6
        rows.append(dict(kind="decode", batch=batch, context=context, variant=name, us=us, tbps=tbps))
        print(f"decode B={batch} C={context} {name:<17} {us if us is None else round(us, 1)} us", flush=True)
    return rows


# The paged kernel's tiles to sweep: (keys a step, positions a program, warps, stages).
PAGED_TILES = [
    (n, split, 4, stages) for n in (64, 128) for split in (128, 256, 512, 1024) for stages in (2, 3, 4)
]


def tune_paged(out: Path, decode=DECODE, tiles=PAGED_TILES) -> list[dict]:
    """`bench tune --kernels mqa_paged`: the paged Triton kernel at each tiling against its
    default choice (triton_mqa._paged_tiles) and DeepGEMM's paged kernel, at bench mqa's decode
    points; a tiling whose logits differ from the default's is reported, not timed. Prints the
    best per point and the best fixed tilings by geometric mean."""
    from fp8compile.ops.mqa_logits import triton_mqa

    rows = []
    for batch, context in decode:
        case = _decode_case(batch, context)
        args = (case["q_fp8"], case["cache"], case["weights"], case["lens"], case["tables"], None, context)
        want = triton_mqa.paged_mqa_logits(*args, False)
        candidates = {"default": None, **{str(t): t for t in tiles}}
        try:
            dg = harness.time_us([_deep_gemm_paged_kernel(*args[:5], context)])
        except Exception as e:  # DeepGEMM missing or refusing: the sweep still counts
            dg = None
            print(f"    deep_gemm paged: {type(e).__name__}: {str(e)[:160]}")
        for name, tile in candidates.items():
            got = triton_mqa.paged_mqa_logits(*args, False, tile)
            same = fp8compile.calc_diff(got, want) < 1e-12
            us = (
                harness.time_us([lambda t=tile: triton_mqa.paged_mqa_logits(*args, False, t)])
                if same
                else None
            )
            rows.append(
                dict(
                    batch=batch,
                    context=context,
                    tiles=name,
                    same=same,
                    us=us,
                    deep_gemm_us=dg,
                    vs_deep_gemm=us and dg and dg / us,
                )
            )
        best = min(
            (r for r in rows if r["batch"] == batch and r["context"] == context and r["us"]),
            key=lambda r: r["us"],
        )
        default = next(
            r for r in rows if (r["batch"], r["context"], r["tiles"]) == (batch, context, "default")
        )
        print(
            f"B={batch} C={context}: default {default['us']:.1f} us, "
            f"best {best['tiles']} {best['us']:.1f} us, DeepGEMM {dg and round(dg, 1)} us",
            flush=True,
        )
    return save(out, "tune_mqa_paged.json", rows, lambda rows: best_fixed(rows, "tiles"))


def _deep_gemm_paged(q_fp8, cache, weights, lens, tables, context):
    """DeepGEMM's fp8_paged_mqa_logits through fp8compile::paged_mqa_logits (mqa_logits/vendors.py's
    adapter: one length per query, its own schedule), asked for by name: ours is first in the
    paged order (registry.PAGED_MQA_ORDER)."""
    import deep_gemm

    sched = torch.ops.fp8compile.paged_mqa_logits_metadata(lens, BLOCK, deep_gemm.get_num_sms(), "deep_gemm")
    return lambda: torch.ops.fp8compile.paged_mqa_logits(
        q_fp8, cache, weights, lens, tables, sched, context, False, "deep_gemm"
    )


def _deep_gemm_paged_kernel(q_fp8, cache, weights, lens, tables, context):
    """DeepGEMM's paged kernel alone, its per-query lengths and int32 tables made beforehand: the
    anchor the Triton kernel is held to (the op's `deep_gemm` row adds the adapter's own work)."""
    import deep_gemm

    from fp8compile.ops.mqa_logits.vendors import per_query_lengths

    per_query = per_query_lengths(lens, q_fp8.shape[1])
    sched = deep_gemm.get_paged_mqa_logits_metadata(per_query, BLOCK, deep_gemm.get_num_sms())
    q, w, t = q_fp8.contiguous(), weights.float().contiguous(), tables.to(torch.int32)
    return lambda: deep_gemm.fp8_paged_mqa_logits(
        q, cache, w, per_query, t, sched, context, clean_logits=False
    )


def _table(rows: list[dict]) -> str:
    lines = []
    for key in sorted({(r["kind"], r.get("m") or r.get("batch"), r.get("context", 0)) for r in rows}):
        same = [r for r in rows if (r["kind"], r.get("m") or r.get("batch"), r.get("context", 0)) == key]
        us = {r["variant"]: r["us"] for r in same}
        base, tri, dg = us.get("bf16_composition"), us.get("triton"), us.get("deep_gemm")
        cells = [f"{v}={u:.1f}us" if u else f"{v}=failed" for v, u in us.items()]
        if base and tri:
            cells.append(f"bf16/triton={base / tri:.2f}x")
        if base and us.get("fp8_compiled"):
            cells.append(f"bf16/fp8_compiled={base / us['fp8_compiled']:.2f}x")
        if dg and tri:
            cells.append(f"triton vs deep_gemm={dg / tri:.2f}x")
        if us.get("deep_gemm_kernel") and tri:
            cells.append(f"triton vs deep_gemm_kernel={us['deep_gemm_kernel'] / tri:.2f}x")
        tb = [f"{r['variant']} {r['tbps']:.2f} TB/s" for r in same if r.get("tbps")]
        lines.append(f"{key[0]} {key[1]}{' C=' + str(key[2]) if key[2] else ''}: " + ", ".join(cells + tb))
    return "\n".join(lines)


def bench_mqa(out: Path, prefill=PREFILL, decode=DECODE) -> list[dict]:
    rows = []
    for m in prefill:
        rows += _prefill_rows(m)
    for batch, context in decode:
        rows += _decode_rows(batch, context)
    return save(out, "bench_mqa.json", rows, _table)
