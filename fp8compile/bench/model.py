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
bf16 eager, in calc_diff; for dense models beside the unfused FP8 composition
(architectures.composition: every linear the pass would take run by the reference block-FP8
linear, eagerly), which is the bound the compiled FP8 model answers to.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import re
import statistics
import time
from pathlib import Path

import torch

import fp8compile

from .. import architectures
from ..config import parse_option
from . import tp as tp_bench
from .output import profiled, pyplot

# name -> (transformers model class, config class, config fields). Real widths; layer counts of
# the released models (cut with --layers).
MODELS = {
    "llama-3-8b": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            num_hidden_layers=32,
            rope_theta=500000.0,
            max_position_embeddings=8192,
        ),
    ),
    "qwen2.5-7b": (
        "Qwen2ForCausalLM",
        "Qwen2Config",
        dict(
            hidden_size=3584,
            intermediate_size=18944,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
            num_hidden_layers=28,
            rope_theta=1000000.0,
            max_position_embeddings=32768,
        ),
    ),
    "qwen3-30b-a3b": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            vocab_size=151936,
            num_hidden_layers=48,
            max_position_embeddings=32768,
        ),
    ),
    # Families whose attention or layout differs (issue: every model a user brings). Released
    # layer counts; --layers cuts them (Mixtral-8x7B's 32 layers are 94 GB in bf16: cut to fit).
    "mistral-7b-v0.1": (  # every layer a 4096-token sliding window
        "MistralForCausalLM",
        "MistralConfig",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32000,
            num_hidden_layers=32,
            sliding_window=4096,
            rope_theta=10000.0,
            max_position_embeddings=32768,
        ),
    ),
    "gemma-2-9b": (  # sliding and global layers alternating, logit softcapping, gelu-tanh MLP
        "Gemma2ForCausalLM",
        "Gemma2Config",
        dict(
            hidden_size=3584,
            intermediate_size=14336,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            vocab_size=256000,
            num_hidden_layers=42,
            sliding_window=4096,
            query_pre_attn_scalar=256,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            max_position_embeddings=8192,
        ),
    ),
    "gemma-3-12b": (  # five 1024-token sliding layers to one global, q/k norms
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        dict(
            hidden_size=3840,
            intermediate_size=15360,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            vocab_size=262208,
            num_hidden_layers=48,
            sliding_window=1024,
            query_pre_attn_scalar=256,
            max_position_embeddings=131072,
        ),
    ),
    "phi-3-medium": (  # fused qkv_proj and gate_up_proj weights
        "Phi3ForCausalLM",
        "Phi3Config",
        dict(
            hidden_size=5120,
            intermediate_size=17920,
            num_attention_heads=40,
            num_key_value_heads=10,
            vocab_size=32064,
            num_hidden_layers=40,
            max_position_embeddings=4096,
        ),
    ),
    "mixtral-8x7b": (  # 8 experts, top-2, fp32 routing weights
        "MixtralForCausalLM",
        "MixtralConfig",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_local_experts=8,
            num_experts_per_tok=2,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32000,
            num_hidden_layers=32,
            rope_theta=1000000.0,
            max_position_embeddings=32768,
        ),
    ),
    "qwen3-8b": (  # dense Qwen3: q/k norms
        "Qwen3ForCausalLM",
        "Qwen3Config",
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            num_hidden_layers=36,
            rope_theta=1000000.0,
            max_position_embeddings=40960,
        ),
    ),
    # the CPU plumbing test's model
    "tiny-llama": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            hidden_size=256,
            intermediate_size=512,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1024,
            num_hidden_layers=2,
            max_position_embeddings=512,
        ),
    ),
}
# bf16_gqa(_ro): bf16 Inductor plus our gqa_attention pass alone (every linear left bf16), the
# anchor that tells FP8's share of a speedup from the attention rewrite's. fp8_rowwise(_ro): the
# rowwise recipe whatever --recipe says, so that one run puts it beside the block recipe's
# fp8(_ro) on the same host. An A/B of one option is an fp8 variant with +KEY=VALUE
# (split_variant): fp8+inductor_launch=false (the decode kernel behind our op),
# fp8+inline_conds=true, fp8_ro+split_kv=false (decode attention on sdpa's kernel),
# fp8_ro+fusions=moe,gate_up,qkv,silu_mul (without gqa_attention).
VARIANTS = (
    "bf16",
    "bf16_inductor",
    "bf16_inductor_ro",
    "bf16_gqa",
    "bf16_gqa_ro",
    "fp8",
    "fp8_ro",
    "bf16_inductor_own",
    "fp8_own",
    "bf16_inductor_ro_own",
    "fp8_ro_own",
    "fp8_ro_release",
    "fp8_rowwise",
    "fp8_rowwise_ro",
    "torchao_rowwise_ro",
)
BATCHES = (1, 4, 16, 64)
PREFILL_BATCHES = (1, 4)  # sequences of `prefill` tokens each


def build(name: str, layers: int | None, device: str):
    """The model `name` with random weights, bf16, in eval mode, made on `device`."""
    import transformers

    model_cls, config_cls, fields = MODELS[name]
    config = getattr(transformers, config_cls)(
        **{**fields, **({"num_hidden_layers": layers} if layers else {})}
    )
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = getattr(transformers, model_cls)(config)
    finally:
        torch.set_default_dtype(default)
    model = model.to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None  # random weights: generate every step asked for
    model.generation_config.pad_token_id = 0
    return model


class StepClock:
    """A logits processor that timestamps every decode step (CUDA events on a GPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def __call__(self, input_ids, scores):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())
        return scores

    def ms_per_step(self) -> float:
        """Mean time of the steps after the first (the first one ends the eager prompt)."""
        if self.cuda:
            torch.cuda.synchronize()
            total = self.marks[0].elapsed_time(self.marks[-1])
        else:
            total = (self.marks[-1] - self.marks[0]) * 1e3
        return total / (len(self.marks) - 1)


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


@dataclasses.dataclass
class Variant:
    name: str
    backend: object  # None = eager
    mode: str | None = None
    own: bool = False  # decode through the user's own torch.compile of model.forward, not a CompileConfig
    # torch.compile's dynamic; False when sharded (tp.py: DTensor under automatic dynamic shapes fails)
    dynamic: bool | None = None

    def compile_config(self, device):
        from transformers.generation.configuration_utils import CompileConfig

        if self.backend is None or self.own:
            return None
        config = CompileConfig(backend=self.backend, mode=self.mode or "default", dynamic=self.dynamic)
        config._compile_all_devices = (
            device.type != "cuda"
        )  # transformers compiles generate() on GPUs only otherwise
        return config


def split_variant(name: str) -> tuple[str, dict]:
    """ "fp8_ro+large_m=1536+autotune=true" -> ("fp8_ro", {"large_m": 1536, "autotune": True}):
    a named variant and the Fp8Config options it runs with on top of its own (an A/B of an
    option in one run, on one host). Raises ValueError on an unknown variant or option."""
    base, *options = name.split("+")
    if base not in VARIANTS:
        raise ValueError(f"unknown variant {base!r}; valid: {', '.join(VARIANTS)}")
    if options and not base.startswith("fp8"):
        raise ValueError(
            f"{name!r}: +KEY=VALUE options set fp8compile's config; {base!r} is not an fp8 variant"
        )
    return base, dict(parse_option(option) for option in options)


def composition_recipes(names, recipe: str) -> list[str]:
    """The recipes whose unfused composition bounds these variants' calc_diff: `recipe` (the
    run's --recipe), then any other an fp8 variant runs (fp8_rowwise*, +recipe=...)."""
    found = [recipe]
    for name in names:
        base, options = split_variant(name)
        if base.startswith("fp8"):
            found.append(options.get("recipe") or ("rowwise" if base.startswith("fp8_rowwise") else recipe))
    return list(dict.fromkeys(found))


def _variant(name: str, recipe: str = "block"):
    """The Variant for a name (a named variant, with +KEY=VALUE options if an fp8 one), or None
    where it cannot run here (with the reason printed); the fp8 variants in `recipe`."""
    base, options = split_variant(name)
    if options:
        variant = _variant(base, recipe)
        if variant is None:
            return None
        config = variant.backend.config.replace(**options)
        return dataclasses.replace(variant, name=name, backend=fp8compile.backend(config))
    mode = "reduce-overhead" if "ro" in name.split("_") else None
    own = name.endswith(("_own", "_release"))
    if name == "bf16":
        return Variant(name, None)
    if name.startswith("bf16_inductor"):
        return Variant(name, "inductor", mode, own)
    if name.startswith("bf16_gqa"):
        return Variant(name, fp8compile.backend(fusions=("gqa_attention",), skip=("*",)), mode)
    if name.startswith("fp8_rowwise"):
        return Variant(name, fp8compile.backend(recipe="rowwise"), mode)
    if name.startswith("fp8"):
        release = name.endswith("_release")
        return Variant(name, fp8compile.backend(release_bf16_weights=release, recipe=recipe), mode, own)
    if name.startswith("torchao"):
        try:
            import torchao  # noqa: F401
        except ImportError:
            print(f"{name}: torchao is not importable, skipped")
            return None
        return Variant(name, "inductor", mode)
    raise ValueError(f"unknown variant {name!r}; valid: {', '.join(VARIANTS)}")


def _torchao_rowwise(model) -> None:
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))


# GPU kernel names -> what they compute, for the time split of a decode step (first match wins).
KERNEL_KINDS = (
    ("attention", re.compile(r"flash|fmha|attention|attn|sdpa|_gqa_decode", re.I)),
    (
        "moe",
        re.compile(r"moe|grouped|_route_|_topk_sum", re.I),
    ),  # expert GEMMs and our routing, before "gemm"
    (
        "linear",
        re.compile(
            r"gemm|nvjet|xmma|cutlass|splitk|_linear_small_m|_scaled_small_m|quant_act|quant_rows|deep_gemm|matmul",
            re.I,
        ),
    ),
)


def kernel_kind(name: str) -> str:
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), "other")


def _gpu_profile(fn) -> tuple[dict[str, float], dict[str, float]]:
    """One profiled run of fn: the GPU time of its kernels by kernel name, ms, and the GPU's idle
    time by where it falls, "previous kernel -> next kernel" (idle_between; the names cut to 50
    characters), ms."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None)
        if us is None:
            us = getattr(event, "self_cuda_time_total", 0.0)
        if us and event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.key] = totals.get(event.key, 0.0) + us / 1e3
    idle = idle_between(
        (event.time_range.start, event.time_range.end, event.name[:50])
        for event in prof.events()
        if event.device_type == torch.autograd.DeviceType.CUDA
    )
    return totals, idle


def idle_between(spans) -> dict[str, float]:
    """spans: (start us, end us, name) of GPU activities, in any order, overlapping or not ->
    the time no span covers, ms, by "name of the span that ended last -> name of the next"."""
    gaps: dict[str, float] = {}
    busy_until, last = None, None
    for start, end, name in sorted(spans):
        if busy_until is not None and start > busy_until:
            key = f"{last} -> {name}"
            gaps[key] = gaps.get(key, 0.0) + (start - busy_until) / 1e3
        if busy_until is None or end >= busy_until:
            busy_until, last = end, name
    return gaps


def by_kind(kernel_ms: dict[str, float]) -> dict[str, float]:
    """Kernel times summed by kind (KERNEL_KINDS, then "other")."""
    totals = dict.fromkeys([kind for kind, _ in KERNEL_KINDS] + ["other"], 0.0)
    for name, ms in kernel_ms.items():
        totals[kernel_kind(name)] += ms
    return totals


def static_cache(model, batch: int, max_len: int, device):
    """A transformers StaticCache for `batch` sequences of up to max_len tokens, its tensors made
    now, outside any compiled call: how a user who compiles model.forward (so the prompt runs
    compiled too) must hand generate() its cache. Left to generate(), the cache is filled first
    inside the compiled prompt: its position counter comes in as a CPU tensor (Inductor runs that
    graph without CUDA graphs) and its keys and values are made there, not marked as static
    addresses, so every decode step's graph takes them as ordinary inputs."""
    from transformers import StaticCache

    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    heads = tp_bench.sharded_kv_heads(model) or getattr(config, "num_key_value_heads", None)
    cache.early_initialization(batch, heads or config.num_attention_heads, head_dim, model.dtype, device)
    return cache


def decode(
    model,
    variant: Variant,
    batch: int,
    context: int,
    steps: int,
    device,
    profile: Path | None = None,
    repeat: int = 1,
) -> dict:
    """A generate() call at this batch size to warm up, then `repeat` timed ones: ms per step is
    their median (each run's in `ms_per_step_runs`: a lease's host moves a host-bound step between
    calls); if asked, one more under cProfile (host time by function, written to `profile`) and,
    on a GPU, the GPU time per step by kind of kernel (a generate() of `steps` steps minus one of
    a single step, which leaves the prompt out, over the steps between), and the GPU's idle
    time per step by the kernels it falls between (_gpu_profile, the prompt left out the same way)."""
    ids = torch.randint(0, model.config.vocab_size, (batch, context), device=device)
    kwargs = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=steps + 1,
        do_sample=False,
        compile_config=variant.compile_config(device),
        disable_compile=variant.backend is None or variant.own,
    )
    # Sharded (--tp), every variant decodes through a cache of this rank's KV heads (tp.py).
    own_cache = variant.own or tp_bench.sharded_kv_heads(model) is not None
    cache = static_cache(model, batch, context + steps + 1, device) if own_cache else None

    def generate(**more):
        if cache is None:
            return model.generate(ids, cache_implementation="static", **{**kwargs, **more})
        cache.reset()  # generate() does not reset a cache it is given
        return model.generate(ids, past_key_values=cache, **{**kwargs, **more})

    start = time.perf_counter()
    generate()
    _sync(device)
    first_s = time.perf_counter() - start
    graphs = _graphs()
    compile_peak_gb = None
    if (
        device.type == "cuda"
    ):  # the peak so far (weights, compile, first call) kept, then the timed call's own
        compile_peak_gb = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    runs, second_s = [], None
    for _ in range(max(1, repeat)):
        clock = StepClock(device)
        start = time.perf_counter()
        generate(logits_processor=[clock])
        _sync(device)
        second_s = second_s or time.perf_counter() - start
        runs.append(clock.ms_per_step())
    ms = statistics.median(runs)
    row = dict(
        kind="decode",
        batch=batch,
        context=context,
        steps=steps,
        ms_per_step=ms,
        ms_per_step_runs=runs,
        tokens_per_s=batch * 1e3 / ms,
        first_call_s=first_s,
        warm_call_s=second_s,
        recompiles=_graphs() - graphs,
    )
    if device.type == "cuda":  # after warm-up: the weights, the cache and this call's activations
        row["warm_peak_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        row["peak_before_gb"] = compile_peak_gb
    if profile is not None:
        profiled(generate, profile)
        if device.type == "cuda":
            every, every_idle = _gpu_profile(generate)
            prompt, prompt_idle = _gpu_profile(lambda: generate(max_new_tokens=1))
            _kernel_split(row, {name: ms - prompt.get(name, 0.0) for name, ms in every.items()}, steps)
            idle = {where: (ms - prompt_idle.get(where, 0.0)) / steps for where, ms in every_idle.items()}
            row["gpu_idle_ms_per_step"] = sum(idle.values())
            top = sorted(idle.items(), key=lambda item: -item[1])[:8]
            row["top_gpu_idle_ms_per_step"] = [[where, ms] for where, ms in top]
    return row


def _kernel_split(row: dict, kernel_ms: dict[str, float], steps: int) -> None:
    """row gets the GPU time per step by kernel kind and its top kernels by name."""
    per_step = {name: ms / steps for name, ms in kernel_ms.items()}
    row["kernel_ms_per_step"] = by_kind(per_step)
    top = sorted(per_step.items(), key=lambda item: -item[1])[:12]
    row["top_kernels_ms_per_step"] = [[name[:120], kernel_kind(name), ms] for name, ms in top]


def _time_ms(fn, device, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def prefill_and_accuracy(
    model,
    variant: Variant,
    tokens: int,
    device,
    eager_logits,
    ids_acc,
    profile: Path | None = None,
    batches=(1,),
) -> list[dict]:
    """Logits calc_diff against bf16 eager (64 tokens), then a prefill of `tokens` tokens at each
    of `batches`, timed (median of 5); if asked, one more of the first batch under cProfile
    (written to `profile`) and, on a GPU, its GPU time by kind of kernel."""
    compiled = (
        model
        if variant.backend is None
        else torch.compile(model, backend=variant.backend, mode=variant.mode, dynamic=variant.dynamic)
    )
    start = time.perf_counter()
    logits = compiled(ids_acc, use_cache=False).logits.float()
    _sync(device)
    acc = dict(
        kind="accuracy",
        calc_diff=fp8compile.calc_diff(logits, eager_logits),
        first_call_s=time.perf_counter() - start,
    )
    rows = [acc]
    for batch in batches:
        ids = torch.randint(0, model.config.vocab_size, (batch, tokens), device=device)

        def step():
            torch.compiler.cudagraph_mark_step_begin()
            compiled(ids, use_cache=False, logits_to_keep=1)

        for _ in range(2):
            step()
        ms = _time_ms(step, device, repeat=5)
        row = dict(kind="prefill", batch=batch, tokens=tokens, ms=ms, tokens_per_s=batch * tokens * 1e3 / ms)
        if profile is not None and batch == batches[0]:
            profiled(step, profile)
            if device.type == "cuda":
                _kernel_split(row, _gpu_profile(step)[0], 1)
        rows.append(row)
    return rows


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
    repeat: int = 3,
    prefill_batches=None,
) -> list[dict]:
    """steps: decode steps timed per point, 0 for none (accuracy and prefill only);
    recipe: the fp8 variants' Fp8Config.recipe (and the unfused composition's); tp: shard the
    model over this many ranks of the host (tp.py), one process each; repeat: timed generate()
    calls per decode point (their median is reported); prefill_batches: the prefills' batch
    sizes (default PREFILL_BATCHES)."""
    from tqdm import tqdm

    options = dict(models=models, layers=layers, batches=batches, context=context, steps=steps)
    options.update(prefill=prefill, variants=variants, profile=profile, recipe=recipe, repeat=repeat)
    options.update(prefill_batches=prefill_batches)
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
    with torch.no_grad(), _cold_compiles(), bar as progress:
        for model_name in models:
            model = build(model_name, layers, device)
            n_layers = model.config.num_hidden_layers
            released = MODELS[model_name][2]["num_hidden_layers"]
            say(
                f"{model_name}: {n_layers} layers ({released} in the released model), "
                f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, on {device_name}"
                + (f", sharded over {tp} ranks (tensor parallel)" if tp > 1 else "")
            )
            if tp > 1:
                tp_bench.shard(model, tp, device)
            ids_acc = torch.randint(0, model.config.vocab_size, (1, 64), device=device)
            eager_logits = model(ids_acc, use_cache=False).logits.float()
            base = dict(device=device_name, model=model_name, layers=n_layers, recipe=recipe, tp=tp)
            # The composition swaps nn.Linear forwards for the reference FP8 linear on whole weights:
            # one per recipe the fp8 variants run, each variant's calc_diff bound.
            if not getattr(model.config, "num_experts", None) and tp == 1:
                for r in composition_recipes(names, recipe):
                    with architectures.composition(model, r):
                        unfused = fp8compile.calc_diff(
                            model(ids_acc, use_cache=False).logits.float(), eager_logits
                        )
                    unfused_name = "fp8_unfused_eager" if r == recipe else f"fp8_{r}_unfused_eager"
                    rows.append(
                        dict(base, recipe=r, variant=unfused_name, kind="accuracy", calc_diff=unfused)
                    )
            ordered = sorted(names, key=lambda n: n.startswith("torchao"))  # torchao changes the model: last
            # and Inductor's config for the process (coordinate_descent_tuning): put back before each variant
            inductor_config = torch._inductor.config.get_config_copy()
            for index, name in enumerate(ordered):
                if tp > 1 and name.startswith("torchao"):
                    say(f"{name}: not run sharded (torchao quantizes whole weights in place)")
                    progress.update(len(batches) + 1)
                    continue
                variant = _variant(name, recipe)
                if variant is not None and tp > 1:
                    variant.dynamic = False
                if variant is None:
                    progress.update(len(batches) + 1)
                    continue
                # a row says the recipe its variant ran (fp8_rowwise's is its own, not --recipe's)
                fp8_backend = isinstance(variant.backend, fp8compile.Fp8Backend)
                own_base = dict(base, recipe=variant.backend.config.recipe) if fp8_backend else base
                # The variant before's graphs and FP8 weight copies go, so that no variant's
                # memory columns count another's (the copies live as long as the parameters).
                torch._dynamo.reset()
                torch._inductor.config.load_config(inductor_config)
                fp8compile.drop_fp8_weights()
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                if name.startswith("torchao"):
                    _torchao_rowwise(model)
                progress.set_postfix_str(f"{model_name} {name}")
                stem = re.sub(r"[^\w.-]", "_", f"profile_{model_name}_{name}")  # no + or = in file names
                path = out_dir / f"{stem}_prefill.txt" if profile else None
                for row in prefill_and_accuracy(
                    model, variant, prefill, device, eager_logits, ids_acc, path, prefill_batches
                ):
                    rows.append(dict(own_base, variant=name, **row))
                progress.update()
                if variant.own:
                    model.forward = torch.compile(
                        type(model).forward.__get__(model),
                        backend=variant.backend,
                        mode=variant.mode,
                        dynamic=variant.dynamic,
                    )
                try:
                    for batch in batches:
                        path = out_dir / f"{stem}_b{batch}.txt" if profile else None
                        rows.append(
                            dict(
                                own_base,
                                variant=name,
                                **decode(model, variant, batch, context, steps, device, path, repeat),
                            )
                        )
                        progress.update()
                finally:
                    if variant.own:
                        del model.forward
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
                if leader:  # a cut-off run (a lease's time limit) keeps its rows and its table so far
                    (out_dir / "bench_model.json").write_text(json.dumps(rows, indent=1))
                    if index + 1 < len(ordered) or model_name != models[-1]:
                        print(model_table(rows))
            del model
    if leader:
        print(model_table(rows))
        _plot(rows, out_dir / "bench_model.png")
    return rows


def _warm_up_compiler(device) -> None:
    """Pay the process's one-time compile costs (Inductor's imports, its compile workers, the
    first Triton build) before any variant, so that no variant's first call carries them (the
    first variant's first call took 20.5 s where the next, bf16 too, took 9.8: H100, 4 layers)."""
    x = torch.randn(64, 64, device=device)
    torch.compile(lambda t: torch.relu(t @ t) + 1, dynamic=False)(x)
    _sync(device)
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


def model_table(rows: list[dict]) -> str:
    """Per model: decode tokens/s per batch, prefill tokens/s, first call, peak memory, accuracy,
    recompiles; then fp8 over bf16 Inductor in the same mode."""
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        batches = sorted({r["batch"] for r in mine if r["kind"] == "decode"})
        prefills = sorted({r["batch"] for r in mine if r["kind"] == "prefill"}) or [1]
        prefill_names = ["prefill" if b == 1 else f"{b}x prefill" for b in prefills]
        variants = list(dict.fromkeys(r["variant"] for r in mine))
        get = {(r["variant"], r["kind"], r.get("batch")): r for r in mine}
        lines += [
            f"\n{model}, {mine[0]['layers']} layers, {mine[0]['device']}"
            + (f" x {mine[0]['tp']} (tensor parallel)" if mine[0].get("tp", 1) > 1 else "")
            + ": decode tokens/s (ms/step), "
            "prefill tokens/s, logits calc_diff vs bf16 eager",
            f"{'variant':<20}"
            + "".join(f"{'B=' + str(b):>18}" for b in batches)
            + "".join(f"{name:>11}" for name in prefill_names)
            + f"{'1st call s':>11}{'peak GB':>9}{'warm GB':>9}"
            + f"{'calc_diff':>10}{'recompiles':>11}",
        ]
        for v in variants:
            cells = ""
            for b in batches:
                r = get.get((v, "decode", b))
                cells += f"{r['tokens_per_s']:>9.1f} ({r['ms_per_step']:>5.2f})" if r else f"{'-':>18}"
            acc, mem = get.get((v, "accuracy", None)), get.get((v, "memory", None))
            first = max(
                (r["first_call_s"] for r in mine if r["variant"] == v and "first_call_s" in r), default=None
            )
            recompiles = sum(r.get("recompiles", 0) for r in mine if r["variant"] == v)
            for b in prefills:
                pre = get.get((v, "prefill", b))
                cells += f"{pre['tokens_per_s']:>11.0f}" if pre else f"{'-':>11}"
            cells += f"{first:>11.1f}" if first is not None else f"{'-':>11}"
            cells += (
                f"{mem['peak_gb']:>9.1f}"
                + (f"{mem['warm_peak_gb']:>9.1f}" if mem.get("warm_peak_gb") else f"{'-':>9}")
                if mem
                else f"{'-':>9}{'-':>9}"
            )
            cells += f"{acc['calc_diff']:>10.2e}" if acc else f"{'-':>10}"
            lines.append(f"{v:<20}{cells}{recompiles:>11}")
        for fp8, bf16 in (
            ("fp8", "bf16_inductor"),
            ("fp8_ro", "bf16_inductor_ro"),
            ("fp8_own", "bf16_inductor_own"),
            ("fp8_ro_own", "bf16_inductor_ro_own"),
            ("fp8_ro_release", "bf16_inductor_ro_own"),
            ("fp8_rowwise", "bf16_inductor"),
            ("fp8_rowwise_ro", "bf16_inductor_ro"),
            ("fp8_rowwise", "fp8"),
            ("fp8_rowwise_ro", "fp8_ro"),
            ("fp8_ro", "bf16_gqa_ro"),
            ("bf16_gqa_ro", "bf16_inductor_ro"),
            # a variant run with options: beside bf16 Inductor in its mode, and the variant it changes
            *(
                (v, "bf16_inductor_ro" if "ro" in v.split("+")[0].split("_") else "bf16_inductor")
                for v in variants
                if "+" in v
            ),
            *((v, v.split("+")[0]) for v in variants if "+" in v),
        ):
            if fp8 not in variants or bf16 not in variants:
                continue
            ratios = []
            for b in batches:
                a, z = get.get((fp8, "decode", b)), get.get((bf16, "decode", b))
                ratios.append(f"{a['tokens_per_s'] / z['tokens_per_s']:>18.2f}" if a and z else f"{'-':>18}")
            pre = ""
            for b in prefills:
                a, z = get.get((fp8, "prefill", b)), get.get((bf16, "prefill", b))
                pre += f"{a['tokens_per_s'] / z['tokens_per_s']:>11.2f}" if a and z else f"{'-':>11}"
            firsts = [
                max(
                    (r["first_call_s"] for r in mine if r["variant"] == v and "first_call_s" in r),
                    default=None,
                )
                for v in (fp8, bf16)
            ]
            first = f"{firsts[0] / firsts[1]:>11.2f}" if None not in firsts else f"{'-':>11}"
            lines.append(f"{fp8 + '/' + bf16:<20}" + "".join(ratios) + pre + first)
        split = [r for r in mine if r.get("kernel_ms_per_step")]
        if split:
            kinds = list(split[0]["kernel_ms_per_step"])
            lines.append(
                "GPU time per decode step (or prefill) by kernel kind, ms (--profile): " + ", ".join(kinds)
            )
            lines += [
                f"{r['variant']:<20}{_step_name(r):>8}"
                + "".join(f"{r['kernel_ms_per_step'][k]:>10.2f}" for k in kinds)
                for r in split
            ]
            for r in split:
                lines.append(
                    f"top kernels, {r['variant']} {_step_name(r)}, ms per step: "
                    + "; ".join(
                        f"{name[:60]} ({kind}) {ms:.3f}"
                        for name, kind, ms in r.get("top_kernels_ms_per_step", [])[:6]
                    )
                )
            for r in split:
                if "gpu_idle_ms_per_step" in r:
                    lines.append(
                        f"GPU idle, {r['variant']} {_step_name(r)}: {r['gpu_idle_ms_per_step']:.3f} ms per "
                        "step, most between: "
                        + "; ".join(f"{where} {ms:.3f}" for where, ms in r["top_gpu_idle_ms_per_step"][:4])
                    )
    return "\n".join(lines)


def _step_name(row: dict) -> str:
    return "prefill" if row["kind"] == "prefill" else f"B={row['batch']}"


def _plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        decode_rows = [r for r in rows if r["model"] == model and r["kind"] == "decode"]
        for v in dict.fromkeys(r["variant"] for r in decode_rows):
            pts = sorted((r["batch"], r["tokens_per_s"]) for r in decode_rows if r["variant"] == v)
            ax.plot(*zip(*pts), marker="o", lw=2.5 if v.startswith("fp8") else 1, label=v)
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="batch",
            ylabel="decode tokens/s",
            title=f"{model} ({decode_rows[0]['layers'] if decode_rows else '?'} layers)",
        )
        ax.set_xscale("log", base=2)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"fp8compile, whole models, {rows[0]['device'] if rows else ''}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
