"""Command line: `python -m fp8compile demo | backends | models | bench`."""

from __future__ import annotations

import argparse
import sys

from .config import RECIPES


def _tokens(text: str) -> int:
    """An M for the command line: a whole number of tokens, at least one."""
    m = int(text)
    if m < 1:
        raise argparse.ArgumentTypeError(f"M is a number of tokens, at least 1, got {m}")
    return m


def _shape(text: str) -> tuple[int, int]:
    """A weight shape for the command line: NxK (output features x input features)."""
    try:
        n, k = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a weight shape is NxK, e.g. 6144x4096, got {text!r}") from None
    if n < 1 or k < 1:
        raise argparse.ArgumentTypeError(f"N and K are at least 1, got {text!r}")
    return n, k


def _variant_name(text: str) -> str:
    from .bench.variants import inductor_options, split_variant

    try:
        split_variant(text)
        inductor_options(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _backends(args) -> int:
    import torch

    from . import registry
    from .config import make_config
    from .passes.dispatch import ranges

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    request = registry.Request("linear", device, n=args.n, k=args.k, m_min=args.m, m_max=args.m)
    ((tier, _, _),) = ranges(make_config(), args.m, args.n)
    order = registry.default_order(tier)
    print(f"backends for linear N={args.n} K={args.k} M={args.m} on {device} ({tier}-M preference order):")
    try:
        chosen, kept = registry.choose(request, tier=tier), None
    except registry.NoGpuKernel as e:  # a GPU without FP8 kernels: the linear stays bf16
        chosen, kept = None, str(e)
    for name in order:
        why = registry.why_not(name, request)
        state = "CHOSEN" if name == chosen else "usable" if why is None else "not used: " + why
        if name == "triton" and why is None and device.type == "cuda":
            from .ops.linear.triton_gemm import large_m_kernel

            state += f" ({large_m_kernel(args.m, args.n, device)})"
        print(f"  {name:<15} {state}")
    if kept:
        print(kept)
    return 0


def _models(args) -> int:
    import concurrent.futures
    import functools
    import dataclasses
    import json
    import logging
    import warnings
    from pathlib import Path

    import torch

    from . import architectures

    warnings.filterwarnings("ignore")  # per-architecture deprecation chatter; the matrix says what matters
    logging.getLogger("transformers").setLevel(logging.ERROR)
    dtype = getattr(torch, args.dtype)
    if args.in_process:  # one architecture, its row as JSON on the last line
        (arch,) = args.arch
        row = architectures.run(
            arch, device=args.device, modes=tuple(args.generate), dtype=dtype, null=args.null, lean=args.lean
        )
        print(json.dumps(dataclasses.asdict(row)))
        return 0
    archs = args.arch or architectures.causal_lm_architectures()
    rows = []
    modes = tuple(args.generate)
    print(architectures.table([], modes, args.lean))
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:  # each its own process
        run = functools.partial(
            architectures.run_isolated,
            timeout=args.timeout,
            device=args.device,
            modes=modes,
            dtype=dtype,
            null=args.null,
            lean=args.lean,
        )
        for row in pool.map(run, archs):
            rows.append(row)
            print(architectures.table([row], modes, args.lean).splitlines()[-1], flush=True)
            if args.out:  # after every row: a matrix cut off by a time limit keeps the rows it has
                out = Path(args.out)
                out.mkdir(parents=True, exist_ok=True)
                (out / "models.md").write_text(architectures.table(rows, modes) + "\n")
                (out / "models.json").write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    counts = {
        status: sum(r.status == status for r in rows) for status in dict.fromkeys(r.status for r in rows)
    }
    print(f"{len(rows)} architectures: " + ", ".join(f"{n} {status}" for status, n in counts.items()))
    return 0 if all(r.status != "failed" and r.status != "over bound" for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fp8compile")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="compile a small Llama with backend='fp8' and print the report")
    demo.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    demo.add_argument("--e8m0", action="store_true", help="power-of-two scales")
    demo.add_argument("--batch-invariant", action="store_true")
    demo.add_argument("--recipe", choices=RECIPES, default="block", help="scaling recipe (Fp8Config.recipe)")
    backends = sub.add_parser(
        "backends", help="which kernel backend serves a linear here, and why not the others"
    )
    backends.add_argument("--device", default=None)
    backends.add_argument("-m", type=_tokens, default=1)
    backends.add_argument("-n", type=int, default=4096)
    backends.add_argument("-k", type=int, default=4096)
    models = sub.add_parser(
        "models",
        help="the architecture matrix: transformers causal LMs built small, compiled with backend='fp8' "
        "on the CPU (or --device cuda): what was rewritten, what stayed bf16 and why, logits against "
        "the FP8 composition",
    )
    models.add_argument("arch", nargs="*", help="model types (default: every causal LM of transformers)")
    models.add_argument("--out", default=None, help="also write the matrix (Markdown) and JSON here")
    models.add_argument(
        "--timeout", type=int, default=600, help="seconds per architecture, each in its own process"
    )
    models.add_argument(
        "--device", default="cpu", help="cpu (reference kernels) or cuda (the GPU kernels the registry picks)"
    )
    models.add_argument(
        "--jobs", type=int, default=1, help="architectures run at once, each in its own process"
    )
    models.add_argument(
        "--generate",
        action="append",
        default=[],
        choices=["default", "reduce-overhead"],
        help="also run generate() with a static cache compiled in this mode, bf16 Inductor beside fp8 "
        "(tokens/s on a GPU, recompiles, CUDA graphs); may be given twice",
    )
    models.add_argument(
        "--dtype",
        choices=["bfloat16", "float16"],
        default="bfloat16",
        help="the models' dtype (float16: each bound by its own float16 composition)",
    )
    models.add_argument(
        "--null",
        action="store_true",
        help="with --generate: time bf16 Inductor on both sides, the ratio the timing reads where "
        "nothing differs (its noise floor)",
    )
    models.add_argument(
        "--lean",
        action="store_true",
        help="also decode through fp8compile.LeanDecoder on the fp8 backend, greedy and sampled "
        "(reduce-overhead on a GPU): an exception fails the row; a model without a static cache is refused",
    )
    models.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)  # one arch, JSON out
    bench = sub.add_parser(
        "bench",
        help="benchmarks: whole models (model), host cost per decode linear (host), "
        "and kernels against bf16 cuBLAS, cuBLAS FP8, DeepGEMM, FlashInfer "
        "(gemm, mlp, moe, tune), sparse-attention indexer logits against DeepGEMM (mqa), and a "
        "tensor-parallel step's all-reduce against NCCL (allreduce --tp N)",
    )
    bench.add_argument("what", choices=["model", "host", "gemm", "mlp", "moe", "mqa", "tune", "allreduce"])
    bench.add_argument("--out", default=None, help="folder for JSON and PNG (default: $OUT or ./bench_out)")
    bench.add_argument(
        "--recipe",
        choices=RECIPES,
        default="block",
        help="`bench model` / `bench mlp`: the fp8 variants' scaling recipe (dynamic activation scales)",
    )
    bench.add_argument(
        "-m",
        type=_tokens,
        action="extend",
        nargs="+",
        help="M values (default: gemm 1 16 32 128 1024 4096; mlp 1 16 128 4096; "
        "moe 1 16 128 1024 4096; host 1 16)",
    )
    bench.add_argument(
        "--shape",
        type=_shape,
        action="extend",
        nargs="+",
        help="`bench gemm` / `bench tune`: a weight shape NxK to time instead of the five default "
        "ones, e.g. --shape 6144x4096 --shape 28672x4096 (Llama-3-8B's q|k|v and gate|up)",
    )
    bench.add_argument(
        "--chain",
        type=int,
        default=8,
        help="`bench host`: linears per compiled graph; times are per linear (default 8)",
    )
    bench.add_argument(
        "--skip",
        action="extend",
        nargs="+",
        help="`bench gemm`: leave this variant out (e.g. fp8compile_tuned)",
    )
    bench.add_argument(
        "--warm-l2",
        action="store_true",
        help="`bench gemm`: time every call on one weight copy, which stays in L2 where it fits (the "
        "most an L2 prefetch could give), instead of on copies enough to keep each out of L2",
    )
    bench.add_argument(
        "--layer",
        action="extend",
        nargs="+",
        choices=["qwen3-30b-a3b", "deepseek-v3", "nemotron-h"],
        help="MoE layers for `bench moe` (default: all)",
    )
    bench.add_argument(
        "--kernels",
        nargs="+",
        default=["small_m", "large_m"],
        choices=[
            "small_m",
            "large_m",
            "tiles",
            "quant",
            "scaled_small_m",
            "small_m_depth",
            "mqa_paged",
            "gqa_decode",
        ],
        help="which Triton kernels `tune` sweeps (quant: the activation quantization; mqa_paged: the "
        "paged indexer-logits kernel, bench/mqa.py; scaled_small_m: the rowwise decode kernel; "
        "small_m_depth: the decode kernel's split of K against its pipeline depth, bench/tune_depth.py; "
        "gqa_decode: the split-KV decode attention's launch, bench/attention.py)",
    )
    bench.add_argument(
        "--gated-shape",
        type=_shape,
        action="extend",
        nargs="+",
        default=[],
        help="`bench tune --kernels small_m_depth`: a down projection's NxK, timed with act(gate, up) fused",
    )
    from .bench.model import BATCHES, PREFILL_BATCHES
    from .bench.presets import MODELS
    from .bench.variants import VARIANTS

    bench.add_argument(
        "--model",
        action="extend",
        nargs="+",
        choices=list(MODELS),
        help="`bench model`: models (default: llama-3-8b, qwen2.5-7b, qwen3-30b-a3b)",
    )
    bench.add_argument(
        "--variant",
        action="extend",
        nargs="+",
        type=_variant_name,
        help=f"`bench model`: variants (default: all): {', '.join(VARIANTS)}; an fp8 one may add "
        "Fp8Config options, e.g. fp8_ro+large_m=1536 (beside fp8_ro: the option's A/B in one run), and "
        "any that Inductor compiles Inductor's own, e.g. bf16_inductor_ro+inductor.combo_kernels=true",
    )
    bench.add_argument(
        "--layers", type=int, default=None, help="`bench model`: cut every model to this many layers"
    )
    bench.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16"],
        help="`bench model`: the models' dtype (default bfloat16); the bf16_* anchors then run the "
        "float16 model without FP8",
    )
    bench.add_argument(
        "--batch",
        type=int,
        action="extend",
        nargs="+",
        help=f"`bench model`: decode batch sizes (default {BATCHES})",
    )
    bench.add_argument(
        "--context", type=int, default=1024, help="`bench model`: prompt tokens before decoding"
    )
    bench.add_argument(
        "--steps",
        type=int,
        default=128,
        help="`bench model`: decode steps timed; 0 = no decode (accuracy and prefill only, e.g. for a "
        "prefill option's A/B)",
    )
    bench.add_argument("--prefill", type=int, default=2048, help="`bench model`: tokens of the timed prefill")
    bench.add_argument(
        "--prefill-batch",
        type=int,
        action="extend",
        nargs="+",
        help=f"`bench model`: sequences per timed prefill (default {PREFILL_BATCHES})",
    )
    bench.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="`bench model`: timed generate() calls per decode point; `bench host`: interleaved rounds "
        "of every variant; the median is reported (default 3)",
    )
    bench.add_argument(
        "--device", default=None, help="`bench model`: cuda or cpu (default: cuda if available)"
    )
    bench.add_argument(
        "--tp",
        type=int,
        default=1,
        help="`bench model`: shard the models over this many GPUs of the host (tensor parallel, NCCL); "
        "`bench allreduce`: the ranks (default 2 there)",
    )
    bench.add_argument(
        "--tp-shards",
        choices=("local", "dtensor"),
        default="local",
        help="`bench model --tp`: each rank's shards as plain tensors with functional collectives in the "
        "graph (local, fp8compile.tensor_parallel), or as DTensors (parallelize_module)",
    )
    bench.add_argument(
        "--isolate",
        action="store_true",
        help="`bench model`: each variant in a process of its own, in order, their rows in one table: a "
        "host-bound step (batch 1) timed without what earlier variants left in the process (in one "
        "process, later variants' steps looked slower: docs/performance.md)",
    )
    bench.add_argument(
        "--profile",
        action="store_true",
        help="`bench model`: cProfile one more generate() per batch (profile_*.txt: host time by function); "
        "on a GPU also the GPU time per step by kernel and its idle time by the kernels it falls between",
    )
    args = parser.parse_args(argv)
    if args.command == "bench":
        from .bench import main as bench_main

        return bench_main(args)
    if args.command == "models":
        return _models(args)
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main(
            args.device, e8m0=args.e8m0, batch_invariant=args.batch_invariant, recipe=args.recipe
        )
    return _backends(args)


if __name__ == "__main__":
    sys.exit(main())
