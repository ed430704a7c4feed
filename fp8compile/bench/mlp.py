"""`python -m fp8compile bench mlp`: the gated MLP, bf16 Inductor against the fp8 backend with
and without its fusions. Times: harness.py."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

import fp8compile

from . import harness
from .output import save

MLPS = {"llama3-8b": (4096, 14336), "qwen2.5-7b": (3584, 18944)}  # (hidden, intermediate), bias-free
MLP_MS = [1, 16, 128, 4096]


def bench_mlp(out_dir: Path, ms=MLP_MS, mlps=MLPS, device: str = "cuda", recipe: str = "block") -> list[dict]:
    """Gated MLP down(silu(gate(x)) * up(x)): bf16 torch.compile (Inductor) vs the fp8 backend
    with every fusion (`fp8`: gate and up as one GEMM, silu_mul fused into the down projection),
    with gate and up as two GEMMs (`fp8_gate_up_apart`: fusions=("silu_mul",)), and with no
    fusion (`fp8_unfused`), all in `recipe`. rowwise and tensor add `fp8_promote`, cuBLAS's GEMM
    promoting to fp32 along K instead of the fast accumulation torchao and fp8 run, and
    `fp8_plain_down`, gate and up merged but the down projection a plain FP8 linear on the bf16
    product (Inductor's act / amax / cast kernel in place of our quantization of act(gate, up)); and
    torchao's float8 rowwise (`torchao_rowwise`, Inductor) where torchao is importable. One
    compiled graph per variant and model serves every weight copy and every M >= 2 (dynamic M)."""
    from tqdm import tqdm

    from fp8compile.demo import GatedMLP

    rows = []
    device_name = torch.cuda.get_device_name(0) if device == "cuda" else device
    backends = {
        "bf16_inductor": "inductor",
        "fp8_unfused": fp8compile.backend(fusions=(), recipe=recipe),
        "fp8_gate_up_apart": fp8compile.backend(fusions=("silu_mul",), recipe=recipe),
        "fp8": fp8compile.backend(recipe=recipe),
    }
    if recipe != "block":  # cuBLAS promoting along K, not in its (default) fast accumulation
        backends["fp8_promote"] = fp8compile.backend(recipe=recipe, fast_accum=False)
        backends["fp8_plain_down"] = fp8compile.backend(recipe=recipe, fusions=("gate_up",))
    torchao = _torchao_rowwise()
    if torchao is not None:
        backends["torchao_rowwise"] = "inductor"
    with torch.no_grad():
        for model_name, (hidden, inter) in tqdm(mlps.items(), desc="bench mlp"):
            copies = [
                GatedMLP(hidden, inter).to(device, torch.bfloat16)
                for _ in range(harness.copies(3 * hidden * inter))
            ]
            inputs = [(m, torch.randn(m, hidden, device=device, dtype=torch.bfloat16)) for m in ms]
            rows += harness.variant_rows(
                lambda v: [
                    torch.compile(torchao(c) if v == "torchao_rowwise" else c, backend=backends[v])
                    for c in copies
                ],
                backends,
                inputs,
                lambda v, m, us: dict(
                    device=device_name,
                    model=model_name,
                    hidden=hidden,
                    inter=inter,
                    m=m,
                    variant=v,
                    recipe=recipe if v.startswith("fp8") else None,
                    us=us,
                    weight_tbps=None
                    if us is None
                    else 3 * hidden * inter * (2 if v == "bf16_inductor" else 1) / us / 1e6,
                ),
            )
            copies = None  # free this model before the next
            torch.cuda.empty_cache()
    return save(out_dir, "bench_mlp.json", rows, mlp_table)


def _torchao_rowwise():
    """A function giving a copy of an MLP under torchao's float8 rowwise recipe (dynamic
    per-token activations, per-channel weights), or None where torchao is not importable."""
    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_
    except ImportError:
        print("torchao_rowwise: torchao is not importable, skipped")
        return None

    def quantized(mlp):
        mlp = copy.deepcopy(mlp)
        quantize_(mlp, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
        return mlp

    return quantized


MLP_COLUMNS = (
    "bf16_inductor",
    "torchao_rowwise",
    "fp8_unfused",
    "fp8_gate_up_apart",
    "fp8",
    "fp8_promote",
    "fp8_plain_down",
)


def mlp_table(rows: list[dict]) -> str:
    by = {(r["model"], r["m"], r["variant"]): r["us"] for r in rows}
    lines = [
        "times in us (CUDA-graph replay, median); ratios are speedups of fp8 (>1 = fp8 faster)",
        f"{'model':<12} {'M':>5} "
        + " ".join(f"{v:>17}" for v in MLP_COLUMNS)
        + "  vs_bf16 vs_torchao vs_unfused vs_gate_up_apart vs_plain_down",
    ]
    for model, m in sorted({(r["model"], r["m"]) for r in rows}, key=lambda t: (t[0], t[1])):
        t = {v: by.get((model, m, v)) for v in MLP_COLUMNS}
        cells = " ".join(f"{t[v]:>17.1f}" if t[v] else f"{'-':>17}" for v in MLP_COLUMNS)
        ratios = " ".join(
            f"{t[v] / t['fp8']:>{w}.2f}" if t["fp8"] and t[v] else f"{'-':>{w}}"
            for v, w in (
                ("bf16_inductor", 8),
                ("torchao_rowwise", 10),
                ("fp8_unfused", 10),
                ("fp8_gate_up_apart", 16),
                ("fp8_plain_down", 13),
            )
        )
        lines.append(f"{model:<12} {m:>5} {cells}  {ratios}")
    return "\n".join(lines)
