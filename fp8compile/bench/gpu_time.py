"""Where a profiled call's GPU time goes: its kernels by name and kind, its idle time by the
kernels it falls between and by what the host did meanwhile (`bench model --profile`)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import torch


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
# A gap this short lies between two kernels the GPU already had (one CUDA graph's, or a stream the
# host keeps ahead of it): the GPU's own time from one kernel to the next, whatever the host was
# doing meanwhile. In the TP decode profiles of 2026-11-29 the gaps at the kernel boundaries of a
# layer came to 0.85-0.87 us each (2 and 4 x H200, LeanDecoder, every step one CUDA graph); their
# host owner had been read as "caller's Python", which it was not.
BOUNDARY_US = 4.0
BOUNDARY = f"kernel boundaries (gaps under {BOUNDARY_US:g} us)"


@dataclass
class GpuProfile:
    """One profiled call's timeline: the GPU's own work, (start us, end us, name) by start
    (gpu_activities), and the host's profiler ranges, (start us, end us, name, thread)."""

    activities: list[tuple[float, float, str]]
    host: list[tuple[float, float, str, int]]


def gpu_profile(fn) -> GpuProfile:
    """One profiled run of fn, CPU and GPU activity (summary() and decode_steps() read it). The
    profiler's own cost per host op lengthens the host's part."""
    from torch.profiler import ProfilerActivity, profile

    meet_ranks()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.events()
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    return GpuProfile(
        gpu_activities(
            (e.time_range.start, e.time_range.end, e.name, bool(getattr(e, "is_user_annotation", False)))
            for e in events
            if e.device_type == cuda
        ),
        [(e.time_range.start, e.time_range.end, e.name, e.thread) for e in events if e.device_type == cpu],
    )


def gpu_activities(events) -> list[tuple[float, float, str]]:
    """events: (start us, end us, name, is a user annotation) on the GPU's timeline -> its own
    work, kernels, copies and sets, (start, end, name) by start. Not the ranges that annotations
    draw over the kernels they name (NCCL's "nccl:all_reduce" over its ncclDevKernel): counted,
    they gave a collective its time twice (4 x H200, 2026-11-29, 56db848)."""
    return sorted((start, end, name) for start, end, name, annotation in events if not annotation)


def summary(profile: GpuProfile, skip: int = 0) -> dict:
    """The profile's GPU work past its first `skip` activities: "kernels", GPU time by name, ms;
    "calls", launches by name; "idle", the GPU's idle time by where it falls, "previous ->
    next" (idle_spans, the names cut to 50 characters; the gap after the last activity skipped
    counts), ms; "owners", that idle time by what the host thread was doing meanwhile
    (host_owners), gaps under BOUNDARY_US as BOUNDARY, and "host_ranges", the longer gaps by the
    host's innermost range, ms."""
    kept = profile.activities[skip:]
    kernels: dict[str, float] = {}
    calls: dict[str, int] = {}
    for start, end, name in kept:
        kernels[name] = kernels.get(name, 0.0) + (end - start) / 1e3
        calls[name] = calls.get(name, 0) + 1
    before = profile.activities[max(skip - 1, 0) : skip]
    spans = idle_spans((start, end, name[:50]) for start, end, name in before + kept)
    idle: dict[str, float] = {}
    for start, end, where in spans:
        idle[where] = idle.get(where, 0.0) + (end - start) / 1e3
    waits = [(start, end) for start, end, _ in spans if end - start >= BOUNDARY_US]
    owners, ranges = host_owners(waits, profile.host)
    boundaries = sum(end - start for start, end, _ in spans if end - start < BOUNDARY_US)
    if boundaries:
        owners[BOUNDARY] = boundaries / 1e3
    return dict(kernels=kernels, calls=calls, idle=idle, owners=owners, host_ranges=ranges)


def decode_steps(every: GpuProfile, prompt: GpuProfile, steps: int) -> tuple[dict, str]:
    """The decode steps' part of a call profiled whole (every: the prompt, then `steps` steps),
    per step (summary()'s keys), from a profile of the same call on the prompt alone; and how it
    was taken. "window": where every's first activities are the prompt call's (the same kernels,
    in any order), what follows them. A sharded prompt's collectives wait on their peers for as
    long as the ranks' eager Python differs, another time each call, so "subtracted", every's
    summary less the prompt's, is the fallback: on 4 x H200 it left 2.8 ms a step of NCCL
    kernels that no step launched (2026-11-29, 56db848)."""
    n = len(prompt.activities)
    names = Counter(name for _, _, name in prompt.activities)
    if Counter(name for _, _, name in every.activities[:n]) == names:
        part, method = summary(every, skip=n), "window"
    else:
        whole, alone = summary(every), summary(prompt)
        part = {key: {k: v - alone[key].get(k, 0) for k, v in whole[key].items()} for key in whole}
        method = "subtracted"
    return {key: {k: v / steps for k, v in values.items()} for key, values in part.items()}, method


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
