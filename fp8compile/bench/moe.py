"""`python -m fp8compile bench moe`: a routed-experts layer, bf16 Inductor against the fp8
backend and DeepGEMM's grouped GEMMs alone. Times: harness.py."""

from __future__ import annotations

from pathlib import Path

import torch

import fp8compile
from fp8compile.numerics import whole_blocks

from . import harness
from .output import save

# (hidden, moe_intermediate, experts, top_k, block): Qwen3-30B-A3B and DeepSeek-V3 widths in
# Qwen3-MoE's block (all 256 of DeepSeek-V3's experts: 22.5 GB of bf16 expert weights plus their
# 11 GB FP8 copy fit an H200 or an H100); transformers' NemotronHConfig defaults in Nemotron-H's
# block: non-gated relu^2 experts of I = 7688 (7808 in the FP8 copies: whole 128-wide blocks),
# beside a shared expert.
MOE_LAYERS = {
    "qwen3-30b-a3b": (2048, 768, 128, 8, "qwen3_moe"),
    "deepseek-v3": (7168, 2048, 256, 8, "qwen3_moe"),
    "nemotron-h": (4096, 7688, 8, 2, "nemotron_h"),
}
MOE_TOKENS = [1, 16, 128, 1024, 4096]


def moe_block(hidden: int, inter: int, experts: int, top_k: int, block: str = "qwen3_moe"):
    """transformers' Qwen3MoeSparseMoeBlock, or NemotronHMoE (block="nemotron_h"): router, top-k,
    experts under "grouped_mm", on the GPU."""
    import transformers

    if block == "nemotron_h":
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE as Block

        cfg = transformers.NemotronHConfig(
            hidden_size=hidden,
            moe_intermediate_size=inter,
            n_routed_experts=experts,
            num_experts_per_tok=top_k,
        )
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        cfg = transformers.Qwen3MoeConfig(
            hidden_size=hidden,
            moe_intermediate_size=inter,
            num_experts=experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=True,
        )
    cfg._experts_implementation = "grouped_mm"
    with torch.device("cuda"):
        block = Block(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    return block


def _deep_gemm_experts(block, tokens: int, top_k: int):
    """DeepGEMM's two grouped GEMMs alone, on this routing's contiguous layout (pre-quantized
    inputs): the anchor for the experts' GEMM time, without routing, activation or top-k sum."""
    import deep_gemm

    from fp8compile.ops.moe.triton_moe import route
    from fp8compile.ops.quant.triton_quant import quant_act
    from fp8compile.weights import fp8_experts

    experts = block.experts
    gated = hasattr(experts, "gate_up_proj")  # else non-gated: the up projection alone
    up = experts.gate_up_proj if gated else experts.up_proj
    num_experts, hidden = up.shape[0], up.shape[2]
    w13 = fp8_experts(up, gate_up="concat" if gated else "none")
    w2 = fp8_experts(experts.down_proj)
    n13, inter = w13[0].shape[1], w2[0].shape[2]  # the FP8 copies' sizes (I in whole blocks)
    ids = torch.topk(torch.rand(tokens, num_experts, device="cuda"), top_k, dim=-1).indices
    slots, block_expert = route(ids, num_experts, deep_gemm.get_mk_alignment_for_contiguous_layout())
    rows = slots.numel()
    row_expert = torch.where(
        slots < ids.numel(), block_expert.repeat_interleave(rows // block_expert.numel()), -1
    )
    a = quant_act(torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16), layout="mn_major")
    h = quant_act(torch.randn(rows, inter, device="cuda", dtype=torch.bfloat16), layout="mn_major")
    c1 = torch.empty(rows, n13, device="cuda", dtype=torch.bfloat16)
    c2 = torch.empty(rows, hidden, device="cuda", dtype=torch.bfloat16)

    def run():
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, w13, c1, row_expert, disable_ue8m0_cast=True)
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(h, w2, c2, row_expert, disable_ue8m0_cast=True)

    return run


def bench_moe(out_dir: Path, tokens=MOE_TOKENS, layers=MOE_LAYERS) -> list[dict]:
    """A routed-experts layer (router + top-k + experts): bf16 torch.compile (Inductor, grouped_mm)
    vs the fp8 backend (default kernels, Triton only, and DeepGEMM's masked layout for up to 64
    tokens) vs DeepGEMM's grouped GEMMs alone.
    One compiled graph per variant serves every token count >= 2 (dynamic tokens)."""
    from tqdm import tqdm

    rows = []
    device_name = torch.cuda.get_device_name(0)
    backends = {
        "bf16_inductor": "inductor",
        "fp8": fp8compile.backend(),
        "fp8_triton": fp8compile.backend(backends=("triton", "reference")),
        # DeepGEMM's masked grouped GEMM on the decode side, up to 64 tokens
        "fp8_deep_gemm_masked": fp8compile.backend(
            backends=("deep_gemm_masked", "triton", "reference"), small_m=64
        ),
    }
    with torch.no_grad():
        for name, (hidden, inter, experts, top_k, kind) in tqdm(layers.items(), desc="bench moe"):
            block = moe_block(hidden, inter, experts, top_k, kind)
            gemms = 2 if kind == "nemotron_h" else 3  # an expert's weights: (gate,) up and down
            # bytes of one expert's weights: bf16, and FP8 (its copies' I in whole 128-wide blocks)
            bf16_bytes, fp8_bytes = 2 * gemms * hidden * inter, gemms * hidden * whole_blocks(inter)
            active = {}  # experts a routing of t tokens touches (router of random weights)
            inputs = []
            for t in tokens:
                x = torch.randn(1, t, hidden, device="cuda", dtype=torch.bfloat16)
                torch._dynamo.mark_dynamic(x, 1)
                inputs.append((t, x))
                logits = torch.nn.functional.linear(x.view(t, hidden), block.gate.weight)
                active[t] = int(torch.topk(logits, top_k).indices.unique().numel())

            def row(variant, t, us):
                streamed = active[t] * (bf16_bytes if variant == "bf16_inductor" else fp8_bytes)
                return dict(
                    device=device_name,
                    layer=name,
                    hidden=hidden,
                    inter=inter,
                    experts=experts,
                    top_k=top_k,
                    tokens=t,
                    variant=variant,
                    us=us,
                    active_experts=active[t],
                    weight_tbps=None if us is None else streamed / us / 1e6,
                )

            rows += harness.variant_rows(
                lambda v: [torch.compile(block, backend=backends[v])], backends, inputs, row, report=True
            )
            for t, _ in inputs:
                try:
                    rows.append(
                        row("deep_gemm_gemms", t, harness.time_us([_deep_gemm_experts(block, t, top_k)]))
                    )
                except Exception as e:  # DeepGEMM missing or failing: the other columns still count
                    print(f"    deep_gemm_gemms: {type(e).__name__}: {str(e)[:120]}")
            block = None  # free this layer before the next
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    return save(out_dir, "bench_moe.json", rows, moe_table)


def moe_table(rows: list[dict]) -> str:
    variants = ("bf16_inductor", "fp8", "fp8_triton", "fp8_deep_gemm_masked", "deep_gemm_gemms")
    by = {(r["layer"], r["tokens"], r["variant"]): r["us"] for r in rows}
    lines = [
        "times in us (CUDA-graph replay, median); ratios are speedups (>1 = faster)",
        f"{'layer':<14} {'tokens':>6} " + " ".join(f"{v:>20}" for v in variants) + "   fp8/bf16 fp8/dg_gemms",
    ]
    for layer, t in sorted({(r["layer"], r["tokens"]) for r in rows}):
        us = {v: by.get((layer, t, v)) for v in variants}
        cells = " ".join(f"{us[v]:>20.1f}" if us[v] else f"{'-':>20}" for v in variants)
        r1 = f"{us['bf16_inductor'] / us['fp8']:10.2f}" if us["fp8"] and us["bf16_inductor"] else f"{'-':>10}"
        r2 = (
            f"{us['deep_gemm_gemms'] / us['fp8']:12.2f}"
            if us["fp8"] and us["deep_gemm_gemms"]
            else f"{'-':>12}"
        )
        lines.append(f"{layer:<14} {t:>6} {cells}   {r1} {r2}")
    return "\n".join(lines)
