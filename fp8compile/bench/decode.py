"""Decode as a transformers user runs it: generate() with a static cache and the decode step
compiled through CompileConfig, ms per step from CUDA events in a logits processor, recompiles
counted; on request the GPU time per step by kind of kernel and the GPU's idle time."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from .. import tensor_parallel
from ..lean_decode import LeanDecoder, static_cache_made_now
from . import limits
from . import tp as tp_bench
from .gpu_time import decode_steps, gpu_profile, kernel_split
from .output import profiled
from .variants import Variant


class StepClock:
    """A logits processor that timestamps every decode step (CUDA events on a GPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def __call__(self, input_ids, scores):
        self.mark()
        return scores

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

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


def static_cache(model, batch: int, max_len: int, device):
    """A transformers StaticCache for `batch` sequences of up to max_len tokens, its tensors made
    now, outside any compiled call: how a user who compiles model.forward (so the prompt runs
    compiled too) must hand generate() its cache. Left to generate(), the cache is filled first
    inside the compiled prompt: its position counter comes in as a CPU tensor (Inductor runs that
    graph without CUDA graphs) and its keys and values are made there, not marked as static
    addresses, so every decode step's graph takes them as ordinary inputs."""
    return static_cache_made_now(model, batch, max_len, device, tp_bench.sharded_kv_heads(model))


def decode(
    model,
    variant: Variant,
    batch: int,
    context: int,
    steps: int,
    device,
    profile: Path | None = None,
    repeat: int = 1,
    all_reduces_ms: float | None = None,
) -> dict:
    """A generate() call at this batch size to warm up, then `repeat` timed ones (a *_lean variant:
    LeanDecoder.generate(), lean_decode.py, in its place): ms per step is
    their median (each run's in `ms_per_step_runs`: a lease's host moves a host-bound step between
    calls); if asked, one more under cProfile (host time by function, written to `profile`) and,
    on a GPU, the GPU time per step by kind of kernel, and the GPU's idle time per step by the
    kernels it falls between and by what the host did meanwhile (gpu_time.py: in a generate() of
    `steps` steps, what follows the kernels of a generate() of the prompt alone, over the steps).
    Every point gets the bytes its step must read and, on a GPU, their read limit and the share
    of it the step reaches (limits.py); a sharded step's with all_reduces_ms, its all-reduces'
    time alone, added."""
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

    def generate_call(**more):
        if cache is None:
            return model.generate(ids, cache_implementation="static", **{**kwargs, **more})
        cache.reset()  # generate() does not reset a cache it is given
        return model.generate(ids, past_key_values=cache, **{**kwargs, **more})

    generate = _lean_generate(model, variant, ids, steps) if variant.lean else generate_call
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
            every = gpu_profile(generate)
            prompt = gpu_profile(lambda: generate(max_new_tokens=1))
            part, row["gpu_profile_steps"] = decode_steps(every, prompt, steps)
            kernel_split(row, part["kernels"], 1, part["calls"])
            row["gpu_idle_ms_per_step"] = sum(part["idle"].values())
            top = sorted(part["idle"].items(), key=lambda item: -item[1])[:8]
            row["top_gpu_idle_ms_per_step"] = [[where, ms] for where, ms in top]
            row["gpu_idle_ms_per_step_by_owner"] = part["owners"]
            ranges = sorted(part["host_ranges"].items(), key=lambda item: -item[1])[:10]
            row["top_host_ranges_during_idle_ms_per_step"] = [[name, ms] for name, ms in ranges]
    # the mean step's live cache: the prompt and half the new tokens
    fp8 = variant.name.startswith(("fp8", "torchao"))
    limits.limit_columns(
        row,
        limits.step_bytes(model, batch, context + steps // 2, fp8),
        limits.read_rate_tbps(device),
        all_reduces_ms,
    )
    return row


def _lean_generate(model, variant: Variant, ids, steps: int):
    """generate()'s stand-in for a *_lean variant: LeanDecoder's loop, its steps marked on the
    clocks passed as logits processors."""
    if tp_bench.sharded_kv_heads(model) is not None and tensor_parallel.local_kv_heads(model) is None:
        raise ValueError(f"{variant.name}: the lean decode loop runs local shards (--tp-shards local)")
    decoder = LeanDecoder(model, backend=variant.backend, mode=variant.mode, dynamic=variant.dynamic)

    def generate(max_new_tokens=steps + 1, logits_processor=()):
        marks = [clock.mark for clock in logits_processor]
        on_step = (lambda: [m() for m in marks]) if marks else None
        # one cache length for every call: the prompt-only call that the profile sets apart too
        return decoder.generate(ids, max_new_tokens, on_step=on_step, cache_length=ids.shape[1] + steps + 1)

    return generate
