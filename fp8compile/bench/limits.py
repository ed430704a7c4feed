"""What a decode step must read, and so the least time it can take: `bench model`'s read limit.

A decode step reads every weight it multiplies by once (the linears, the experts its tokens are
routed to) and every live position of the KV cache; at batch sizes up to a few dozen that is
nearly all of its memory traffic, and a step cannot take less than those bytes over the GPU's read
rate. The rate is measured here, not taken from a data sheet: the plain read of bench/read.py (an
FP8 weight streamed once, as a decode GEMM must) over `READ_GB` of weights, the fastest of its
tilings; on an H200 it reaches 4.54-4.63 TB/s of the 4.8 peak (three processes, 2026-11-29;
before 8-warp tilings were among them, 3.29: BENCHMARKS.md, "The read limit, restated").
"""

from __future__ import annotations

import functools
import logging

import torch

from .. import architectures, tensor_parallel
from ..numerics import BLOCK

log = logging.getLogger(__name__)

READ_GB = 2.0  # enough weights that no L2 holds any part of them between reads


def step_bytes(model: torch.nn.Module, batch: int, context: int, fp8: bool) -> dict[str, float]:
    """The bytes (GB) one decode step at `batch` sequences of `context` positions must read:
    weights (the linears the linear pass takes in FP8 with their block scales where fp8, else in
    the model's dtype; the embedding's looked-up rows only, and an lm_head tied to it whole, as the
    linear it is; of experts stacked in one parameter, the expected share hit by batch x top-k
    uniform routings) and the KV cache's live positions (a sliding-window layer's window at most)."""
    config = model.config.get_text_config(decoder=True)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None) or 1
    hit = 1.0 if not experts else 1 - (1 - min(top_k, experts) / experts) ** batch
    # A tied lm_head shares the embedding's parameter but reads all of it: the two are counted
    # apart (when the embedding's rows stood for both, Gemma-3-12B's 1.0 GB lm_head was left out
    # of its step).
    linears: set[int] = set()
    embeddings: set[int] = set()
    weights = 0.0
    for module in model.modules():
        w = architectures._linear_weight(module)
        if w is not None and id(module.weight) not in linears:
            linears.add(id(module.weight))
            n, k = w.shape
            scales = -(-n // BLOCK) * -(-k // BLOCK) * 4
            weights += n * k + scales if fp8 else w.numel() * w.element_size()
        elif isinstance(module, torch.nn.Embedding) and id(module.weight) not in embeddings:
            embeddings.add(id(module.weight))
            weights += batch * module.weight.shape[1] * module.weight.element_size()
    for p in model.parameters():
        if id(p) in linears or id(p) in embeddings:
            continue
        share = hit if experts and p.dim() == 3 and p.shape[0] == experts else 1.0
        weights += share * p.numel() * p.element_size()
    return dict(weights_gb=weights / 1e9, kv_gb=kv_bytes(model, batch, context) / 1e9)


def kv_bytes(model: torch.nn.Module, batch: int, context: int) -> float:
    """Keys and values of every attention layer at `context` live positions (a sliding-window
    layer's window at most), in the model's dtype."""
    config = model.config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    window = getattr(config, "sliding_window", None)
    # Mistral's config has no layer_types: a window there is every layer's
    every = "sliding_attention" if window else "full_attention"
    layer_types = getattr(config, "layer_types", None) or [every] * config.num_hidden_layers
    window = window or context
    element = next(model.parameters()).element_size()
    positions = sum(min(window, context) if "sliding" in kind else context for kind in layer_types)
    return 2 * batch * positions * kv_heads * head_dim * element


@functools.cache
def read_rate_tbps(device: torch.device) -> float | None:
    """This GPU's plain read of FP8 weights, TB/s (module docstring), measured once a process;
    None off the GPU."""
    if device.type != "cuda":
        return None
    from . import harness
    from .read import READ_TILINGS, plain_read

    rows, cols = int(READ_GB * 1e9) // 8192, 8192
    w = torch.empty(rows, cols, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    times = [harness.time_us([lambda t=t: plain_read(w, *t)]) for t in READ_TILINGS]
    best = min(us for us in times if us is not None)
    return rows * cols / best / 1e6


def all_reduce_ms(model: torch.nn.Module, batches, device: torch.device, timer=None) -> dict[int, float]:
    """For a model sharded on local shards (fp8compile.tensor_parallel), the time a decode step's
    all-reduces take at each batch: one a row-sharded linear, each timed alone as `bench
    allreduce` times fp8compile::all_reduce (back to back in a CUDA graph), ms; the part of a
    sharded step's least time that is not reading. Empty for a model not so sharded, or off the
    GPU, or where the timing fails (said; the limit then goes without them). A collective: every
    rank calls it at the same point, before any graph is compiled (a capture of its own beside
    CUDA-graph trees' is not what `bench allreduce` measured). timer(batch, (group name, width),
    dtype, device) -> us: _time_all_reduce unless given."""
    sums = tensor_parallel.all_reduces(model)
    if not sums or device.type != "cuda":
        return {}
    timer = timer or _time_all_reduce
    dtype = next(model.parameters()).dtype
    kinds = list(dict.fromkeys(sums))
    try:  # one timing a kind of all-reduce and batch
        us = {(batch, kind): timer(batch, kind, dtype, device) for batch in batches for kind in kinds}
    except Exception as error:  # noqa: BLE001 - every rank alike: the bench goes on without them
        log.warning("bench model: the all-reduces were not timed (%s: %s)", type(error).__name__, error)
        return {}
    return {batch: sum(us[batch, kind] for kind in sums) / 1e3 for batch in batches}


def _time_all_reduce(batch: int, kind: tuple[str, int], dtype: torch.dtype, device: torch.device) -> float:
    """us per fp8compile::all_reduce of (batch, width) over the group, as `bench allreduce` times it."""
    from ..ops.collectives import op  # noqa: F401 - registers fp8compile::all_reduce
    from .allreduce import time_us

    group, width = kind
    x = torch.randn(batch, width, dtype=dtype, device=device)
    return time_us(lambda t: torch.ops.fp8compile.all_reduce(t, group), x)


def limit_columns(
    row: dict, step: dict[str, float], rate_tbps: float | None, all_reduces_ms: float | None = None
) -> None:
    """row (a decode point) gets the bytes its step must read, the read limit at rate_tbps, and
    the share of that limit its wall time reaches (its GPU time too, where profiled); for a
    sharded step, all_reduces_ms (all_reduce_ms's at its batch) added to the limit as well."""
    row["step_read_gb"] = step["weights_gb"] + step["kv_gb"]
    row["step_weights_gb"], row["step_kv_gb"] = step["weights_gb"], step["kv_gb"]
    if rate_tbps is None:
        return
    limit = row["step_read_gb"] / rate_tbps  # GB / (TB/s) = ms
    row["read_tbps"], row["read_limit_ms"] = rate_tbps, limit
    row["wall_of_limit"] = limit / row["ms_per_step"]
    if all_reduces_ms is not None:
        row["all_reduces_ms"] = all_reduces_ms
        row["limit_with_all_reduces_ms"] = limit + all_reduces_ms
        row["wall_of_limit_with_all_reduces"] = (limit + all_reduces_ms) / row["ms_per_step"]
    gpu = sum(row.get("kernel_ms_per_step", {}).values())
    if gpu:
        row["gpu_ms_per_step"] = gpu
        row["gpu_of_limit"] = limit / gpu
