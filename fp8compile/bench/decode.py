"""Decode as a transformers user runs it: generate() with a static cache and the decode step
compiled through CompileConfig, ms per step from CUDA events in a logits processor, recompiles
counted; on request the GPU time per step by kind of kernel and the GPU's idle time."""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path

import torch

from . import tp as tp_bench
from .output import profiled
from .variants import Variant


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


def graph_count() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


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


def gpu_profile(fn) -> tuple[dict[str, float], dict[str, float]]:
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
    time per step by the kernels it falls between (gpu_profile, the prompt left out the same way)."""
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
    sync(device)
    first_s = time.perf_counter() - start
    graphs = graph_count()
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
        sync(device)
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
        recompiles=graph_count() - graphs,
    )
    if device.type == "cuda":  # after warm-up: the weights, the cache and this call's activations
        row["warm_peak_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        row["peak_before_gb"] = compile_peak_gb
    if profile is not None:
        profiled(generate, profile)
        if device.type == "cuda":
            every, every_idle = gpu_profile(generate)
            prompt, prompt_idle = gpu_profile(lambda: generate(max_new_tokens=1))
            kernel_split(row, {name: ms - prompt.get(name, 0.0) for name, ms in every.items()}, steps)
            idle = {where: (ms - prompt_idle.get(where, 0.0)) / steps for where, ms in every_idle.items()}
            row["gpu_idle_ms_per_step"] = sum(idle.values())
            top = sorted(idle.items(), key=lambda item: -item[1])[:8]
            row["top_gpu_idle_ms_per_step"] = [[where, ms] for where, ms in top]
    return row


def kernel_split(row: dict, kernel_ms: dict[str, float], steps: int) -> None:
    """row gets the GPU time per step by kernel kind and its top kernels by name."""
    per_step = {name: ms / steps for name, ms in kernel_ms.items()}
    row["kernel_ms_per_step"] = by_kind(per_step)
    top = sorted(per_step.items(), key=lambda item: -item[1])[:12]
    row["top_kernels_ms_per_step"] = [[name[:120], kernel_kind(name), ms] for name, ms in top]
