"""Benchmarks: `python -m fp8compile bench model | host | gemm | mlp | moe | mqa | tune | allreduce`.

One module per bench: model.py times whole transformers models (what users judge); host.py the
host cost of one decode linear outside CUDA graphs, layer by layer of the FP8 path; gemm.py,
mlp.py, moe.py and mqa.py single linears, gated MLPs, MoE layers and indexer logits against the
anchors; allreduce.py a tensor-parallel step's all-reduce against NCCL; tune.py sweeps
our kernels' tiles, tune_depth.py the decode kernel's split of K against its pipeline depth.
harness.py is the kernel benches' timing (CUDA-graph replay, weights past L2); output.py what
they all write (JSON with its table, plots, host profiles). Vendor libraries and triton are
imported by the benchmark that uses them, never here.
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

        bench_model(
            out,
            models=args.model,
            layers=args.layers,
            batches=args.batch,
            context=args.context,
            steps=args.steps,
            prefill=args.prefill,
            variants=args.variant,
            device=args.device,
            profile=args.profile,
            recipe=args.recipe,
            tp=args.tp,
            tp_shards=args.tp_shards,
            dtype=args.dtype,
            repeat=args.repeat,
            prefill_batches=args.prefill_batch,
            isolate=args.isolate,
        )
    else:
        if not torch.cuda.is_available():
            raise SystemExit(f"bench {args.what} needs a CUDA GPU")
        if args.what == "allreduce":
            from . import allreduce

            allreduce.bench_allreduce(out, ms=args.m or allreduce.MS, tp=max(args.tp, 2))
        elif args.what == "host":
            from .host import bench_host

            bench_host(out, ms=args.m or (1, 16), chain=args.chain, rounds=args.repeat)
        elif args.what == "gemm":
            from . import gemm

            gemm.bench_gemm(
                out,
                shapes=args.shape or gemm.SHAPES,
                ms=args.m or gemm.MS,
                skip=args.skip or (),
                warm_l2=args.warm_l2,
            )
        elif args.what == "mlp":
            from . import mlp

            mlp.bench_mlp(out, ms=args.m or mlp.MLP_MS, recipe=args.recipe)
        elif args.what == "mqa":
            from . import mqa

            mqa.bench_mqa(out)
        elif args.what == "moe":
            from . import moe

            moe.bench_moe(
                out,
                tokens=args.m or moe.MOE_TOKENS,
                layers={k: moe.MOE_LAYERS[k] for k in (args.layer or moe.MOE_LAYERS)},
            )
        else:
            from .gemm import SHAPES
            from .tune import tune

            if "mqa_paged" in args.kernels:
                from . import mqa

                mqa.tune_paged(out)
            if "gqa_decode" in args.kernels:
                from . import attention

                attention.tune_gqa_decode(out)
            if "small_m_depth" in args.kernels:
                from . import tune_depth

                tune_depth.sweep(out, args.shape or SHAPES, args.gated_shape)
            gemm_kernels = [k for k in args.kernels if k not in ("mqa_paged", "gqa_decode", "small_m_depth")]
            if gemm_kernels:
                tune(out, shapes=args.shape or SHAPES, kernels=gemm_kernels)
    print(f"[{time.time() - start:.0f} s] results in {out}")
    return 0
