"""Probe (one session): fp8compile::moe at decode sizes through DeepGEMM's masked grouped GEMM
(vendors.moe_deep_gemm_masked) against our Triton decode path (triton_moe.moe_triton) and
DeepGEMM's contiguous layout (vendors.moe_deep_gemm), GPU time under CUDA-graph replay
(bench harness), one layer, uniform random routing; calc_diff of each against the Triton path.

    python scripts/moe_masked_probe.py      # writes $OUT/moe_masked_probe.json
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from fp8compile.bench.harness import time_us
from fp8compile.numerics import BLOCK, calc_diff
from fp8compile.ops import triton_moe, vendors

OUT = Path(os.environ.get("OUT", "/tmp/out"))
LAYERS = {"qwen3-30b-a3b": (2048, 768, 128, 8), "deepseek-v3": (7168, 2048, 256, 8)}
TOKENS = [1, 4, 16, 64, 128, 256]


def random_experts(e: int, n: int, k: int):
    w = torch.empty(e, n, k, device="cuda", dtype=torch.float8_e4m3fn)
    for i in range(e):
        w[i] = (torch.randn(n, k, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    return w, torch.rand(e, n // BLOCK, k // BLOCK, device="cuda") * 1e-4 + 1e-5


def main() -> None:
    torch.manual_seed(0)
    rows = []
    paths = {
        "triton": triton_moe.moe_triton,
        "deep_gemm_masked": vendors.moe_deep_gemm_masked,
        "deep_gemm_contiguous": vendors.moe_deep_gemm,
    }
    for name, (hidden, inter, experts, top_k) in LAYERS.items():
        w13, w2 = random_experts(experts, 2 * inter, hidden), random_experts(experts, hidden, inter)
        for t in TOKENS:
            x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
            ids = torch.topk(torch.rand(t, experts, device="cuda"), top_k, dim=-1).indices.int()
            weights = torch.rand(t, top_k, device="cuda").softmax(-1)
            row = dict(layer=name, tokens=t)
            ref = paths["triton"](x, ids, weights, *w13, *w2)
            for path, fn in paths.items():

                def run(fn=fn):
                    return fn(x, ids, weights, *w13, *w2)

                try:
                    row[f"{path}_calc_diff"] = float(calc_diff(run().double(), ref.double()))
                    row[f"{path}_us"] = time_us([run])
                except Exception as e:
                    row[f"{path}_us"] = f"{type(e).__name__}: {str(e)[:160]}"
            print(json.dumps(row))
            rows.append(row)
        w13 = w2 = None
        torch.cuda.empty_cache()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "moe_masked_probe.json").write_text(
        json.dumps(dict(device=torch.cuda.get_device_name(0), rows=rows), indent=1)
    )


if __name__ == "__main__":
    main()
