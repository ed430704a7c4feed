"""`python -m fp8compile bench model`: whole transformers causal LMs, bf16 against FP8, in one run.

Models are built from configs at real widths with random N(0, 0.02) weights (no download),
directly on the device in bf16; `--layers` cuts the layer count (the same on every variant, and
said in the output). Variants, in this order (torchao last: it quantizes the model in place):
    bf16                  eager
    bf16_inductor[_ro]    torch.compile, default mode / mode="reduce-overhead"
    fp8[_ro]              torch.compile(backend=fp8compile.backend()), the same two modes
    fp8[_ro]+KEY=VALUE    fp8[_ro] with that Fp8Config option on top (repeatable): an option's A/B
                          in one run, e.g. fp8+inline_conds=true, fp8_ro+split_kv=false
    *_own                 (bf16_inductor[_ro]_own, fp8[_ro]_own) decode with the user's own compile:
                          model.forward = torch.compile(model.forward, ...), generate() with
                          compiling off, so the prompt runs through compiled graphs too; the
                          static cache is made and initialized before the call (static_cache())
    fp8_ro_release        fp8_ro_own with Fp8Config(release_bf16_weights=True): the bf16 weights'
                          device memory given back (restored after the variant)
    fp8_rowwise[_ro]      fp8[_ro] in the rowwise recipe whatever --recipe says: beside the
                          block recipe on the same host (ratios against fp8[_ro] too)
    transformers_fp8      the model saved as a block-FP8 checkpoint (fp8_checkpoint.py) and loaded
                          back by transformers' own loader: its FP8Linear forward, eagerly, on
                          DeepGEMM (the installed wheel where the Hub's build cannot load: rows'
                          transformers_kernel says which)
    transformers_fp8_inductor[_ro]  the same compiled by Inductor (reduce-overhead: where
                          transformers' experts kernels fail in CUDA-graph capture, the default
                          mode's is the MoE checkpoint's anchor)
    fp8[_ro][_own]_ckpt   fp8compile on that checkpoint (its FP8 weights read in place), its
                          calc_diff beside the checkpoint's own unfused composition
                          (fp8_ckpt_unfused_eager: transformers' forward on its kernels'
                          computation in PyTorch); _own: the
                          prompt through the compiled graphs too, where transformers' kernels,
                          which generate() runs the prompt on, do not load (a machine offline)
    torchao_rowwise_ro    torchao float8 dynamic rowwise, then Inductor reduce-overhead (if importable)

Decode is timed the way a transformers user runs it: model.generate() with a static KV cache and
GenerationConfig.compile_config = CompileConfig(backend=..., mode=...), which compiles the decode
step (the prompt runs eagerly). A logits processor records a CUDA event after every step: ms per
step is the time from the first step's event to the last one's over the steps between them, so
the prompt is not counted. The first generate() at a batch size compiles (and records CUDA
graphs); the second is timed, and Dynamo's graph count during it is the recompile count.
Prefill: torch.compile(model) on one sequence of `prefill` tokens (logits of the last token),
median of CUDA-event-timed calls. First calls are cold: the compiler's process-wide start-up is
paid before the first variant, and Inductor's FX graph and AOTAutograd caches are off, so no
variant reuses what an earlier one compiled. Accuracy: logits of a 64-token forward against
bf16 eager, in calc_diff, beside the unfused FP8 composition (architectures.composition: every
linear and expert the passes would take run by the reference block-FP8 linear, eagerly), which
is the bound the compiled FP8 model answers to. `--isolate` runs each variant in a process of its
own (a fresh Python and CUDA context), in order, and merges their rows into one table: a
host-bound point (batch 1) is then timed without what earlier variants left in the process.
"""

from __future__ import annotations

import contextlib
import gc
import json
import re
from pathlib import Path

import torch

import fp8compile

from .. import architectures
from . import tp as tp_bench
from . import fp8_checkpoint, limits
from .decode import decode, sync
from .prefill import prefill_and_accuracy
from .presets import MODELS, build
from .table import model_table, plot
from .variants import VARIANTS, composition_recipes, is_checkpoint_variant, make_variant, torchao_rowwise

BATCHES = (1, 4, 16, 64)


PREFILL_BATCHES = (1, 4)  # sequences of `prefill` tokens each


def bench_model(
    out_dir: Path,
    models=None,
    layers: int | None = None,
    batches=None,
    context: int = 1024,
    steps: int = 128,
    prefill: int = 2048,
    variants=None,
    device: str | None = None,
    profile: bool = False,
    recipe: str = "block",
    tp: int = 1,
    tp_shards: str = "local",
    repeat: int = 3,
    prefill_batches=None,
    dtype: str = "bfloat16",
    isolate: bool = False,
) -> list[dict]:
    """steps: decode steps timed per point, 0 for none (accuracy and prefill only);
    recipe: the fp8 variants' Fp8Config.recipe (and the unfused composition's); tp: shard the
    model over this many ranks of the host (tp.py), one process each, as plain local shards with
    functional collectives (tp_shards "local": fp8compile/tensor_parallel.py) or as DTensors
    ("dtensor": parallelize_module); repeat: timed generate()
    calls per decode point (their median is reported); prefill_batches: the prefills' batch
    sizes (default PREFILL_BATCHES); dtype: the models' (bfloat16 or float16), every variant's;
    isolate: each variant in a process of its own (_isolated)."""
    from tqdm import tqdm

    options = dict(models=models, layers=layers, batches=batches, context=context, steps=steps)
    options.update(prefill=prefill, variants=variants, profile=profile, recipe=recipe, repeat=repeat)
    options.update(prefill_batches=prefill_batches, dtype=dtype, tp_shards=tp_shards)
    if isolate:
        names = variants or list(tp_bench.TP_VARIANTS if tp > 1 else VARIANTS)
        return _isolated(out_dir, names, dict(options, tp=tp, device=device))
    if tp > 1 and tp_bench.world() == 1:
        return tp_bench.spawn(bench_model, tp, out_dir, device, **options)
    leader = tp_bench.is_main()
    say = print if leader else lambda *a, **k: None
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    models = models or ["llama-3-8b", "qwen2.5-7b", "qwen3-30b-a3b"]
    if steps < 0:
        raise ValueError(f"steps is a number of decode steps, 0 for none, got {steps}")
    batches = (batches or list(BATCHES)) if steps else []
    prefill_batches = tuple(prefill_batches or PREFILL_BATCHES)
    names = variants or list(tp_bench.TP_VARIANTS if tp > 1 else VARIANTS)
    rows: list[dict] = []
    out_dir.mkdir(parents=True, exist_ok=True)
    _warm_up_compiler(device)
    total = len(models) * len(names) * (len(batches) + 1)
    bar = tqdm(total=total, desc="bench model", disable=not leader)
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(_cold_compiles())
        progress = stack.enter_context(bar)
        transformers_kernel = None  # what transformers' FP8 forward runs, where a variant needs it
        if any(is_checkpoint_variant(name) for name in names):
            transformers_kernel = stack.enter_context(
                fp8_checkpoint.transformers_on_installed_deep_gemm(device)
            )
            say(f"transformers' FP8 forward: {transformers_kernel}")
        for model_name in models:
            # local shards: each rank makes only its own (presets.build)
            local = tp > 1 and tp_shards == "local"
            model = build(
                model_name, layers, device, getattr(torch, dtype), tp_bench.local_shard if local else None
            )
            n_layers = model.config.num_hidden_layers
            released = MODELS[model_name][2]["num_hidden_layers"]
            say(
                f"{model_name}: {n_layers} layers ({released} in the released model), "
                f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters"
                + (" on this rank" if local else "")
                + f", on {device_name}"
                + (f", sharded over {tp} ranks (tensor parallel, {tp_shards} shards)" if tp > 1 else "")
            )
            if tp > 1 and not local:
                tp_bench.shard(model, tp, device, tp_shards)
            # a sharded step's all-reduces, each timed alone: part of its least time (limits.py)
            all_reduces = limits.all_reduce_ms(model, batches, device)
            ids_acc = torch.randint(0, model.config.vocab_size, (1, 64), device=device)
            eager_logits = model(ids_acc, use_cache=False).logits.float()
            base = dict(device=device_name, model=model_name, layers=n_layers, recipe=recipe, tp=tp)
            if tp > 1:
                base["tp_shards"] = tp_shards
            base["dtype"] = dtype
            # The composition swaps nn.Linear forwards (and the experts' F.linear and grouped
            # matmuls) for the reference FP8 linear on whole weights: one per recipe the fp8
            # variants run, each variant's calc_diff bound. A MoE model's routing turns small
            # differences into other experts' outputs, so its bound is its own composition's.
            # Under TP on local shards each rank's linears run the reference on its own shard, as
            # the compiled graph's do: the same model's composition. DTensor weights have none.
            if tp == 1 or local:
                for r in composition_recipes(names, recipe):
                    with architectures.composition(model, r):
                        logits = model(ids_acc, use_cache=False).logits.float()
                    unfused_name = "fp8_unfused_eager" if r == recipe else f"fp8_{r}_unfused_eager"
                    rows.append(
                        dict(
                            base,
                            recipe=r,
                            variant=unfused_name,
                            kind="accuracy",
                            calc_diff=fp8compile.calc_diff(logits, eager_logits),
                            median_calc_diff=architectures.median_token_diff(logits, eager_logits),
                        )
                    )
            checkpoint = None  # the model as a block-FP8 checkpoint loaded back, for the *_ckpt variants
            # torchao changes the model: last; before it the FP8-checkpoint variants, for which the
            # bf16 model waits in host memory (their memory columns are the checkpoint's own)
            ordered = sorted(names, key=lambda n: (n.startswith("torchao"), is_checkpoint_variant(n)))
            # and Inductor's config for the process (coordinate_descent_tuning): put back before each variant
            inductor_config = torch._inductor.config.get_config_copy()
            for index, name in enumerate(ordered):
                if tp > 1 and name.startswith("torchao"):
                    say(f"{name}: not run sharded (torchao quantizes whole weights in place)")
                    progress.update(len(batches) + 1)
                    continue
                variant = make_variant(name, recipe)
                if variant is not None and tp > 1:
                    variant.dynamic = False
                if variant is None:
                    progress.update(len(batches) + 1)
                    continue
                # a row says the recipe its variant ran (fp8_rowwise's is its own, not --recipe's)
                fp8_backend = isinstance(variant.backend, fp8compile.Fp8Backend)
                own_base = dict(base, recipe=variant.backend.config.recipe) if fp8_backend else base
                if variant.checkpoint:
                    own_base = dict(own_base, transformers_kernel=transformers_kernel)
                # The variant before's graphs and FP8 weight copies go, so that no variant's
                # memory columns count another's (the copies live as long as the parameters).
                torch._dynamo.reset()
                torch._inductor.config.load_config(inductor_config)
                for key, value in variant.inductor.items():  # +inductor.KEY=VALUE
                    setattr(torch._inductor.config, key, value)
                fp8compile.drop_fp8_weights()
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                if not variant.checkpoint and checkpoint is not None:  # torchao, after them
                    model.to(device)  # the bf16 model back on the device
                if name.startswith("torchao"):
                    torchao_rowwise(model)
                subject = model
                if variant.checkpoint:
                    if checkpoint is None:
                        checkpoint = fp8_checkpoint.round_trip(model, device)
                        if transformers_kernel is not None:
                            experts = fp8_checkpoint.experts_on_deep_gemm(checkpoint, transformers_kernel)
                            if experts is not None:
                                say(f"transformers' FP8 experts: its {experts!r} implementation")
                        with fp8_checkpoint.transformers_computation(checkpoint):
                            logits = checkpoint(ids_acc, use_cache=False).logits.float()
                        rows.append(
                            dict(
                                base,
                                variant="fp8_ckpt_unfused_eager",
                                kind="accuracy",
                                calc_diff=fp8compile.calc_diff(logits, eager_logits),
                                median_calc_diff=architectures.median_token_diff(logits, eager_logits),
                            )
                        )
                        model.to("cpu")
                        gc.collect()
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                            torch.cuda.reset_peak_memory_stats(device)
                    subject = checkpoint
                progress.set_postfix_str(f"{model_name} {name}")
                stem = re.sub(r"[^\w.-]", "_", f"profile_{model_name}_{name}")  # no + or = in file names
                try:
                    path = out_dir / f"{stem}_prefill.txt" if profile else None
                    for row in prefill_and_accuracy(
                        subject, variant, prefill, device, eager_logits, ids_acc, path, prefill_batches
                    ):
                        rows.append(dict(own_base, variant=name, **row))
                    progress.update()
                    if leader:  # a run cut off by a time limit keeps every point it measured
                        _write(out_dir, rows)
                    if variant.own:
                        subject.forward = torch.compile(
                            type(subject).forward.__get__(subject),
                            backend=variant.backend,
                            mode=variant.mode,
                            dynamic=variant.dynamic,
                        )
                    try:
                        for batch in batches:
                            path = out_dir / f"{stem}_b{batch}.txt" if profile else None
                            timing = (steps, device, path, repeat, all_reduces.get(batch))
                            decoded = decode(subject, variant, batch, context, *timing)
                            rows.append(dict(own_base, variant=name, **decoded))
                            progress.update()
                            if leader:
                                _write(out_dir, rows)
                    finally:
                        if variant.own:
                            del subject.forward
                except Exception as error:  # noqa: BLE001  an FP8 checkpoint's: transformers' kernels may not load
                    if not variant.checkpoint:
                        raise
                    reason = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                    say(f"{name}: did not run: {reason}")
                    rows.append(dict(own_base, variant=name, kind="error", error=reason))
                if device.type == "cuda":
                    mine = [r for r in rows if r["variant"] == name and r.get("model") == model_name]
                    # the decode peak after warm-up; None where no decode ran (--steps 0)
                    warm = max((r["warm_peak_gb"] for r in mine if r.get("warm_peak_gb")), default=None)
                    peak = max(
                        [torch.cuda.max_memory_allocated(device) / 2**30]
                        + [r.get(key) or 0.0 for r in mine for key in ("warm_peak_gb", "peak_before_gb")]
                    )
                    rows.append(dict(own_base, variant=name, kind="memory", warm_peak_gb=warm, peak_gb=peak))
                # fp8_ro_release gave them back: the next variant needs them
                fp8compile.restore_bf16_weights()
                if isinstance(variant.backend, fp8compile.Fp8Backend):
                    report = variant.backend.report
                    say(
                        f"{name}: {report.counts()} over {report.graphs} graphs; CUDA graphs: "
                        f"{sorted(set(report.cuda_graphs.values()))}"
                    )
                    # Why candidates stayed bf16, once per kind and reason (a user's next question).
                    for kind, reason in dict.fromkeys((skip.kind, skip.reason) for skip in report.skips):
                        say(f"  kept bf16 ({kind}): {reason}")
                    # sharded: each graph's collectives, and what its all-reduces run on (this rank's)
                    collectives = report.collective_lines()
                    for line in collectives:
                        say(f"  {line}")
                    for row in rows if collectives else ():
                        if row["variant"] == name and row["kind"] == "accuracy":
                            row["collectives"] = collectives
                if leader:  # a cut-off run (a lease's time limit) keeps its rows and its table so far
                    _write(out_dir, rows)
                    if index + 1 < len(ordered) or model_name != models[-1]:
                        print(model_table(rows))
            torch._inductor.config.load_config(inductor_config)  # as the process had it
            del model, checkpoint
    if leader:
        print(model_table(rows))
        plot(rows, out_dir / "bench_model.png")
    return rows


def _write(out_dir: Path, rows: list[dict]) -> None:
    """The rows so far, as bench_model.json: written whole each time, so that a run killed at any
    point leaves a complete file of what it measured."""
    (out_dir / "bench_model.json").write_text(json.dumps(rows, indent=1))


def _isolated(out_dir: Path, names: list[str], options: dict) -> list[dict]:
    """bench_model(**options) for each variant in a process of its own, started fresh (spawn), one
    after another, each writing to out_dir / its name; their rows as one run's, written and tabled
    here. Every process computes the compositions' accuracy rows alike: they are kept once. A
    process that fails (out of memory, a crash) is said, and the next variant runs."""
    import multiprocessing

    spawn = multiprocessing.get_context("spawn")
    rows: list[dict] = []
    kept = set()
    for name in names:
        own = out_dir / re.sub(r"[^\w.-]", "_", name)
        process = spawn.Process(target=bench_model, args=(own,), kwargs=dict(options, variants=[name]))
        process.start()
        process.join()
        if process.exitcode != 0:
            print(f"{name}: its process exited with code {process.exitcode}; no rows")
            continue
        for row in json.loads((own / "bench_model.json").read_text()):
            if row["variant"].endswith("_unfused_eager"):
                key = (row["variant"], row.get("model"), row.get("recipe"))
                if key in kept:
                    continue
                kept.add(key)
            rows.append(dict(row, process=name))
    out_dir.mkdir(parents=True, exist_ok=True)
    _write(out_dir, rows)
    print(model_table(rows))
    plot(rows, out_dir / "bench_model.png")
    return rows


def _warm_up_compiler(device) -> None:
    """Pay the process's one-time compile costs (Inductor's imports, its compile workers, the
    first Triton build) before any variant, so that no variant's first call carries them (the
    first variant's first call took 20.5 s where the next, bf16 too, took 9.8: H100, 4 layers).
    Not on a CPU, where the bench is the tests' plumbing, not a timing: 10 s a run there."""
    if device.type != "cuda":
        return
    x = torch.randn(64, 64, device=device)
    torch.compile(lambda t: torch.relu(t @ t) + 1, dynamic=False)(x)
    sync(device)
    torch._dynamo.reset()


@contextlib.contextmanager
def _cold_compiles():
    """Every variant compiles as a user's first compile does: no hit in the FX graph and
    AOTAutograd caches that an earlier variant of the same graph filled (bf16 Inductor in
    reduce-overhead mode after default mode took 1.3 s where it takes 4.1 cold)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield
