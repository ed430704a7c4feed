"""Decode as a transformers user runs it: generate() with a static cache and the decode step
compiled through CompileConfig, ms per step from CUDA events in a logits processor, recompiles
counted; on request the GPU time per step by kind of kernel and the GPU's idle time."""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path

import torch

from .. import tensor_parallel
from ..lean_decode import LeanDecoder, static_cache_made_now
from . import limits
from . import tp as tp_bench
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


# GPU kernel names -> what they compute, for the time split of a decode step (first match wins).
KERNEL_KINDS = (
    # a sharded step's all-reduces and gathers: NCCL's kernels, symmetric memory's
    ("collective", re.compile(r"nccl|all_reduce|allreduce|all_gather|one_shot|two_shot", re.I)),
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


# Who holds the GPU idle: the host's work during each idle interval, by the innermost profiler
# range of the host thread at that instant that names an owner (first match, innermost out);
# anything else is the caller's own Python (transformers' generate() loop, or LeanDecoder's).
HOST_OWNERS = (
    ("cuda-graph replay", re.compile(r"cudaGraphLaunch|cudagraph|CUDAGraph", re.I)),
    ("compiled graph's wrappers", re.compile(r"CompiledFxGraph|CompiledFunction|AOTDispatcher|## ", re.I)),
    ("dynamo (frame and guards)", re.compile(r"Torch-Compiled Region|TorchDynamo", re.I)),
    ("wait for the GPU", re.compile(r"Synchronize|aten::item|_local_scalar_dense", re.I)),
)
CALLER = "caller's Python"


def gpu_profile(fn) -> dict:
    """One profiled run of fn (CPU and GPU activity): "kernels", the GPU time of its kernels by
    kernel name, ms; "calls", how many times each ran; "idle", the GPU's idle time by where it
    falls, "previous kernel -> next kernel" (idle_spans; the names cut to 50 characters), ms;
    "owners" and "host_ranges", that idle time by what the host thread was doing meanwhile
    (HOST_OWNERS; and by its innermost profiler range's name), ms. The profiler's own cost per
    host op lengthens the host's part."""
    from torch.profiler import ProfilerActivity, profile

    meet_ranks()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    calls: dict[str, int] = {}
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None)
        if us is None:
            us = getattr(event, "self_cuda_time_total", 0.0)
        if us and event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.key] = totals.get(event.key, 0.0) + us / 1e3
            calls[event.key] = calls.get(event.key, 0) + event.count
    events = prof.events()
    gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = idle_spans((e.time_range.start, e.time_range.end, e.name[:50]) for e in gpu)
    idle: dict[str, float] = {}
    for start, end, where in spans:
        idle[where] = idle.get(where, 0.0) + (end - start) / 1e3
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    owners, ranges = host_owners(
        [(start, end) for start, end, _ in spans],
        [(e.time_range.start, e.time_range.end, e.name, e.thread) for e in host],
    )
    return dict(kernels=totals, calls=calls, idle=idle, owners=owners, host_ranges=ranges)


def meet_ranks() -> None:
    """Under torch.distributed, every rank here before any goes on, its GPU idle. A profiled call
    right after a rank's own host work (a cProfile run, the last profile's analysis) otherwise
    starts with its first collective waiting for the slower rank, and that wait counts as the
    collective's GPU time: on two H200s a TP2 step's collective time came out at -43 ms, the
    prompt-only call's collectives 1.4 s longer than the whole call's, which only such a wait
    explains (2026-11-29, efcd642)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()


def idle_spans(spans) -> list[tuple[float, float, str]]:
    """spans: (start us, end us, name) of GPU activities, in any order, overlapping or not ->
    the intervals no span covers, (start us, end us, "name of the span that ended last -> name
    of the next")."""
    gaps = []
    busy_until, last = None, None
    for start, end, name in sorted(spans):
        if busy_until is not None and start > busy_until:
            gaps.append((busy_until, start, f"{last} -> {name}"))
        if busy_until is None or end >= busy_until:
            busy_until, last = end, name
    return gaps


def host_owners(gaps, ranges, resolution_us: float = 1.0) -> tuple[dict[str, float], dict[str, float]]:
    """gaps: (start us, end us) the GPU idles; ranges: (start us, end us, name, thread) of the
    host's profiler ranges -> ms of idle by owner (HOST_OWNERS, else CALLER) and by the innermost
    range's name ("-" where none is open), sampled every resolution_us on the thread that opens
    the most ranges (the one that launches the work; others are compile workers and the like)."""
    by_thread: dict = {}
    for start, end, name, thread in ranges:
        by_thread.setdefault(thread, []).append((start, -end, name))
    owners: dict[str, float] = {}
    names: dict[str, float] = {}
    if not gaps:
        return owners, names
    main = max(by_thread, key=lambda t: len(by_thread[t])) if by_thread else None
    opened = sorted(by_thread.get(main, []))
    stack: list[tuple[float, str]] = []  # (end, name), innermost last
    i = 0
    step_ms = resolution_us / 1e3
    for gap_start, gap_end in sorted(gaps):
        t = gap_start + resolution_us / 2
        while t < gap_end:
            while i < len(opened) and opened[i][0] <= t:
                start, neg_end, name = opened[i]
                while stack and stack[-1][0] <= start:
                    stack.pop()
                stack.append((-neg_end, name))
                i += 1
            while stack and stack[-1][0] <= t:
                stack.pop()
            owner = next(
                (
                    kind
                    for _, name in reversed(stack)
                    for kind, pattern in HOST_OWNERS
                    if pattern.search(name)
                ),
                CALLER,
            )
            owners[owner] = owners.get(owner, 0.0) + step_ms
            name = stack[-1][1][:60] if stack else "-"
            names[name] = names.get(name, 0.0) + step_ms
            t += resolution_us
    return owners, names


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
) -> dict:
    """A generate() call at this batch size to warm up, then `repeat` timed ones (a *_lean variant:
    LeanDecoder.generate(), lean_decode.py, in its place): ms per step is
    their median (each run's in `ms_per_step_runs`: a lease's host moves a host-bound step between
    calls); if asked, one more under cProfile (host time by function, written to `profile`) and,
    on a GPU, the GPU time per step by kind of kernel (a generate() of `steps` steps minus one of
    a single step, which leaves the prompt out, over the steps between), and the GPU's idle
    time per step by the kernels it falls between and by what the host did meanwhile (gpu_profile,
    the prompt left out the same way). Every point gets the bytes its step must read and, on a
    GPU, their read limit and the share of it the step reaches (limits.py)."""
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

            def per_step(key):  # the steps' share: the whole call's less the prompt's, over the steps
                return {k: (ms - prompt[key].get(k, 0.0)) / steps for k, ms in every[key].items()}

            kernel_split(
                row,
                {name: ms * steps for name, ms in per_step("kernels").items()},
                steps,
                {name: n * steps for name, n in per_step("calls").items()},
            )
            idle = per_step("idle")
            row["gpu_idle_ms_per_step"] = sum(idle.values())
            top = sorted(idle.items(), key=lambda item: -item[1])[:8]
            row["top_gpu_idle_ms_per_step"] = [[where, ms] for where, ms in top]
            row["gpu_idle_ms_per_step_by_owner"] = per_step("owners")
            ranges = sorted(per_step("host_ranges").items(), key=lambda item: -item[1])[:10]
            row["top_host_ranges_during_idle_ms_per_step"] = [[name, ms] for name, ms in ranges]
    # the mean step's live cache: the prompt and half the new tokens
    fp8 = variant.name.startswith(("fp8", "torchao"))
    limits.limit_columns(
        row, limits.step_bytes(model, batch, context + steps // 2, fp8), limits.read_rate_tbps(device)
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
        # one cache length for every call: the prompt-only call that the profile subtracts too
        return decoder.generate(ids, max_new_tokens, on_step=on_step, cache_length=ids.shape[1] + steps + 1)

    return generate


def kernel_split(
    row: dict, kernel_ms: dict[str, float], steps: int, calls: dict[str, float] | None = None
) -> None:
    """row gets the GPU time per step by kernel kind and its top kernels by name: [name, kind, ms
    per step, launches per step] (calls: launches by name over the steps; the count tells a slow
    kernel from one that runs more often than the model has layers)."""
    per_step = {name: ms / steps for name, ms in kernel_ms.items()}
    row["kernel_ms_per_step"] = by_kind(per_step)
    top = sorted(per_step.items(), key=lambda item: -item[1])[:12]
    row["top_kernels_ms_per_step"] = [
        [name[:120], kernel_kind(name), ms, (calls or {}).get(name, 0) / steps] for name, ms in top
    ]
