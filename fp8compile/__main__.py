"""Command line: `python -m fp8compile demo | backends`."""

from __future__ import annotations

import argparse
import sys


def _backends(args) -> int:
    import torch

    from . import registry
    from .config import make_config
    from .passes.dispatch import ranges

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    request = registry.Request("linear", device, n=args.n, k=args.k, m_min=args.m, m_max=args.m)
    ((tier, _, _),) = ranges(make_config(), args.m)
    order = registry.default_order(tier)
    print(f"backends for linear N={args.n} K={args.k} M={args.m} on {device} ({tier}-M preference order):")
    chosen = registry.choose(request, tier=tier)
    for name in order:
        why = registry.why_not(name, request)
        state = "CHOSEN" if name == chosen else "usable" if why is None else "not used: " + why
        if name == "triton" and why is None and device.type == "cuda":
            from .ops.triton_gemm import large_m_kernel

            state += f" ({large_m_kernel(args.m, args.n, device)})"
        print(f"  {name:<15} {state}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fp8compile")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="compile a small Llama with backend='fp8' and print the report")
    demo.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    demo.add_argument("--e8m0", action="store_true", help="power-of-two scales")
    demo.add_argument("--batch-invariant", action="store_true")
    backends = sub.add_parser(
        "backends", help="which kernel backend serves a linear here, and why not the others"
    )
    backends.add_argument("--device", default=None)
    backends.add_argument("-m", type=int, default=1)
    backends.add_argument("-n", type=int, default=4096)
    backends.add_argument("-k", type=int, default=4096)
    bench = sub.add_parser(
        "bench",
        help="benchmarks: whole models (model), host cost per decode linear (host), "
        "and kernels against bf16 cuBLAS, cuBLAS FP8, DeepGEMM, FlashInfer "
        "(gemm, mlp, moe, tune)",
    )
    bench.add_argument("what", choices=["model", "host", "gemm", "mlp", "moe", "tune"])
    bench.add_argument("--out", default=None, help="folder for JSON and PNG (default: $OUT or ./bench_out)")
    bench.add_argument(
        "-m",
        type=int,
        action="append",
        help="M values (default: gemm 1 16 32 128 1024 4096; mlp 1 16 128 4096; "
        "moe 1 16 128 1024 4096; host 1 16)",
    )
    bench.add_argument(
        "--chain",
        type=int,
        default=8,
        help="`bench host`: linears per compiled graph; times are per linear (default 8)",
    )
    bench.add_argument(
        "--skip", action="append", help="`bench gemm`: leave this variant out (e.g. fp8compile_tuned)"
    )
    bench.add_argument(
        "--layer",
        action="append",
        choices=["qwen3-30b-a3b", "deepseek-v3"],
        help="MoE layers for `bench moe` (default: both)",
    )
    bench.add_argument(
        "--kernels",
        nargs="+",
        default=["small_m", "large_m"],
        choices=["small_m", "large_m", "tiles"],
        help="which Triton kernels `tune` sweeps",
    )
    from .bench.model import BATCHES, MODELS, VARIANTS

    bench.add_argument(
        "--model",
        action="append",
        choices=list(MODELS),
        help="`bench model`: models (default: llama-3-8b, qwen2.5-7b, qwen3-30b-a3b)",
    )
    bench.add_argument(
        "--variant", action="append", choices=list(VARIANTS), help="`bench model`: variants (default: all)"
    )
    bench.add_argument(
        "--layers", type=int, default=None, help="`bench model`: cut every model to this many layers"
    )
    bench.add_argument(
        "--batch", type=int, action="append", help=f"`bench model`: decode batch sizes (default {BATCHES})"
    )
    bench.add_argument(
        "--context", type=int, default=1024, help="`bench model`: prompt tokens before decoding"
    )
    bench.add_argument("--steps", type=int, default=128, help="`bench model`: decode steps timed")
    bench.add_argument("--prefill", type=int, default=2048, help="`bench model`: tokens of the timed prefill")
    bench.add_argument(
        "--device", default=None, help="`bench model`: cuda or cpu (default: cuda if available)"
    )
    bench.add_argument(
        "--profile",
        action="store_true",
        help="`bench model`: cProfile one more generate() per batch (profile_*.txt: host time by function)",
    )
    args = parser.parse_args(argv)
    if args.command == "bench":
        from .bench import main as bench_main

        return bench_main(args)
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main(args.device, e8m0=args.e8m0, batch_invariant=args.batch_invariant)
    return _backends(args)


if __name__ == "__main__":
    sys.exit(main())
