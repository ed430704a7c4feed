"""Benchmarks: `python -m fp8compile bench model | host | gemm | mlp | moe | tune`.

model.py times whole transformers models (what users judge); host.py the host cost of one
decode linear outside CUDA graphs, layer by layer of the FP8 path; kernels.py times single linears,
MLPs, MoE layers and tile sweeps against the anchors; output.py holds what they all write besides
JSON (plots, host profiles). Vendor libraries and triton are imported by the benchmark that uses
them, never here.
"""
from __future__ import annotations

import os
import time
from pathlib import Path


def main(args) -> int:
    import torch

    out = Path(args.out or os.environ.get("OUT", "bench_out"))
    start = time.time()
    if args.what == "model":
        from .model import bench_model

        bench_model(out, models=args.model, layers=args.layers, batches=args.batch, context=args.context,
                    steps=args.steps, prefill=args.prefill, variants=args.variant, device=args.device,
                    profile=args.profile)
    else:
        if not torch.cuda.is_available():
            raise SystemExit(f"bench {args.what} needs a CUDA GPU")
        from . import kernels

        if args.what == "host":
            from .host import bench_host

            bench_host(out, ms=args.m or (1, 16), chain=args.chain)
        elif args.what == "gemm":
            kernels.bench_gemm(out, ms=args.m or kernels.MS, skip=args.skip or ())
        elif args.what == "mlp":
            kernels.bench_mlp(out, ms=args.m or kernels.MLP_MS)
        elif args.what == "moe":
            kernels.bench_moe(out, tokens=args.m or kernels.MOE_TOKENS,
                              layers={k: kernels.MOE_LAYERS[k] for k in (args.layer or kernels.MOE_LAYERS)})
        else:
            kernels.tune(out, kernels=args.kernels)
    print(f"[{time.time() - start:.0f} s] results in {out}")
    return 0
