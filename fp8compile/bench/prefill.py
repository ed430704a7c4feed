"""A compiled forward's logits against bf16 eager (calc_diff pooled over the tokens, and the
median token's, the bound of a MoE model: architectures.py says why) and the timed prefill."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

import fp8compile

from ..architectures import median_token_diff
from .decode import sync
from .gpu_time import gpu_profile, kernel_split, summary
from .output import profiled
from .variants import Variant


def time_ms(fn, device, repeat: int) -> list[float]:
    """fn's time in ms, each of `repeat` calls (a host-bound call moves by the call)."""
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
    return times


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
    of `batches`, timed (the median of 5 calls, each kept in `ms_runs`); if asked, one more of
    the first batch under cProfile (written to `profile`) and, on a GPU, its GPU time by kind of
    kernel."""
    compiled = (
        model
        if variant.backend is None
        else torch.compile(model, backend=variant.backend, mode=variant.mode, dynamic=variant.dynamic)
    )
    start = time.perf_counter()
    logits = compiled(ids_acc, use_cache=False).logits.float()
    sync(device)
    acc = dict(
        kind="accuracy",
        calc_diff=fp8compile.calc_diff(logits, eager_logits),
        median_calc_diff=median_token_diff(logits, eager_logits),
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
        runs = time_ms(step, device, repeat=5)
        ms = statistics.median(runs)
        row = dict(kind="prefill", batch=batch, tokens=tokens, ms=ms, ms_runs=runs)
        row["tokens_per_s"] = batch * tokens * 1e3 / ms
        if profile is not None and batch == batches[0]:
            profiled(step, profile)
            if device.type == "cuda":
                part = summary(gpu_profile(step))
                kernel_split(row, part["kernels"], 1, part["calls"])
        rows.append(row)
    return rows
