"""Kernel choice by measurement, at compile time (Fp8Config(autotune=True)).

The registry's default order ranks the backends from five benchmark shapes, but the vendor
kernels have cliffs that depend on M and the shape together (BENCHMARKS.md, H200: DeepGEMM is
1.8x faster than cuBLAS at M = 128 and 2.5x slower at M = 1024 for N = 4096, K = 7168, and 2.3x
slower at M = 128 for N = 24576, K = 1536). No fixed order follows that. Here, for one call
site's op and weight shape, every backend that serves M is timed on this GPU at each M of a
ladder, and M is split into ranges where one kernel wins; the M dispatch then has one
torch.cond per change of kernel. Times are cached per (op, backend, N, K, M), so the layers of
a model that share a shape are measured once.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from . import registry
from .numerics import BLOCK, FP8_DTYPE, ceil_div

log = logging.getLogger("fp8compile")

TUNED_OPS = ("linear", "gated_linear")  # moe: its kernels' cost depends on the routing too
# Rows at which kernels are timed; a measured M stands for the rows above the previous one.
TUNE_MS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
# A kernel takes over from the current one only where it is this much faster: each change of
# kernel costs a torch.cond, and timings this close are within run-to-run noise.
MIN_GAIN = 1.05

_TIMES: dict[tuple, float | None] = {}


def can_tune(device: torch.device) -> bool:
    return device.type == "cuda"


def time_us(op: str, backend: str, n: int, k: int, m: int, device: torch.device, e8m0: bool) -> float | None:
    """Median us of backend's op kernel for (M, K) x (N, K) on this GPU, None if it fails there."""
    key = (op, backend, n, k, m, str(device), e8m0)
    if key not in _TIMES:
        _TIMES[key] = _measure(op, backend, n, k, m, device, e8m0)
    return _TIMES[key]


def _measure(op: str, backend: str, n: int, k: int, m: int, device: torch.device, e8m0: bool) -> float | None:
    """Timed as `bench gemm` times (BENCHMARKS.md): CUDA-graph replay, so the launch cost of a
    Python launcher does not count (serving runs decode under CUDA graphs), over as many weight
    copies as make 4x the L2 cache, so every call streams its weight from HBM."""
    import triton.testing
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.no_grad(), torch.cuda.device(device):
        x, b = (torch.randn(m, k, device=device, dtype=torch.bfloat16) for _ in range(2))
        copies = max(1, min(8, ceil_div(4 * torch.cuda.get_device_properties(device).L2_cache_size, n * k)))
        weights = [(torch.randn(n, k, device=device) * 64).to(FP8_DTYPE) for _ in range(copies)]
        w_scale = torch.full((ceil_div(n, BLOCK), k // BLOCK), 1e-3, device=device)
        kernel = registry.implementation(op, backend)
        if op == "linear":
            calls = [lambda w=w: kernel(x, w, w_scale, None, e8m0) for w in weights]
        else:
            calls = [lambda w=w: kernel(x, b, w, w_scale, None, e8m0, "silu", 1.702, 7.0) for w in weights]
        try:
            for call in calls:
                call()
            torch.cuda.synchronize(device)
            ms = triton.testing.do_bench_cudagraph(
                lambda: [call() for call in calls], rep=10, return_mode="median"
            )
            return 1000 * ms / copies
        except Exception as e:  # a kernel that cannot run (or be captured) here does not compete
            log.info("fp8compile autotune: %s %s M=%d N=%d K=%d failed: %s", backend, op, m, n, k, e)
            torch.cuda.synchronize(device)
            return None


def tuned_ranges(
    base: registry.Request,
    order: tuple[str, ...],
    time: Callable[[str, int], float | None],
    static_m: int | None = None,
) -> list[tuple[int, int | None, str]]:
    """[(m_min, m_max or None, backend)] covering every M (or static_m alone): in each step
    (previous ladder M, this one] the fastest backend at this M that serves the whole step,
    unless the kernel of the step before is within MIN_GAIN of it there."""
    steps = (
        [(static_m, static_m, static_m)]
        if static_m is not None
        else [
            (lo + 1, None if i == len(TUNE_MS) - 1 else hi, hi)
            for i, (lo, hi) in enumerate(zip((0, *TUNE_MS), TUNE_MS))
        ]
    )
    chosen: list[tuple[int, int | None, str]] = []
    for lo, hi, m in steps:
        request = dataclasses.replace(base, m_min=lo, m_max=hi)
        serving = [name for name in order if registry.why_not(name, request) is None]
        # the reference is the fallback, never a contender: its float64 sums are not meant to be fast
        times = {name: t for name in serving if name != "reference" and (t := time(name, m)) is not None}
        if not times:
            if "reference" not in serving:
                registry.choose(request, order)  # raises, naming every backend's reason
                raise RuntimeError(
                    f"every backend that serves {request.m_range} failed to run on {base.device}"
                )
            times = {"reference": 0.0}
        best = min(times, key=times.get)
        current = chosen[-1][2] if chosen else None
        if current in times and times[current] <= MIN_GAIN * times[best]:
            best = current
        if best == current:
            chosen[-1] = (chosen[-1][0], hi, best)
        else:
            chosen.append((lo, hi, best))
    return chosen


def plan(
    base: registry.Request, order: tuple[str, ...] | None, static_m: int | None
) -> list[tuple[int, int | None, str]]:
    """tuned_ranges for one call site, timing with this GPU (order: Fp8Config.backends, or every
    backend but the reference, which stays the fallback)."""
    default = order is None
    if default:
        order = (*(name for name in registry.names() if name != "reference"), "reference")
    log.info("fp8compile autotune: %s N=%d K=%d", base.op, base.n, base.k)
    chosen = tuned_ranges(
        base,
        order,
        lambda name, m: time_us(base.op, name, base.n, base.k, m, base.device, base.e8m0),
        static_m,
    )
    fallback = [(lo, hi) for lo, hi, name in chosen if name == "reference"]
    if default and fallback and base.device.type == "cuda":  # as registry.choose's default order
        lo, hi = fallback[0]
        request = dataclasses.replace(base, m_min=lo, m_max=hi)
        raise registry.NoGpuKernel(
            f"no FP8 kernel ran {base.op} ({request.m_range}) on this GPU while autotuning: kept "
            "bf16; Fp8Config(backends=[..., 'reference']) runs the float64 reference kernels instead"
        )
    return chosen
