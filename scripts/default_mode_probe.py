"""Probe (one session): where a default-mode Qwen3-MoE step spends its time, bf16 Inductor
against fp8. Per variant: prefill 2048 (CUDA-event wall, host time to return, torch.profiler
CPU + CUDA), decode steps through generate() with a static cache at two contexts (the same).
Writes $OUT/default_mode_probe.json and one profiler table per run."""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import fp8compile
from fp8compile.bench import model as bm

OUT = Path(os.environ.get("OUT", "/tmp/out"))
LAYERS = int(os.environ.get("LAYERS", "4"))
SYNC_NAMES = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpyAsync", "aten::item", "aten::_local_scalar_dense", "aten::nonzero")


def summarize(prof, name: str) -> dict:
    events = prof.key_averages()
    (OUT / f"table_{name}.txt").write_text(events.table(sort_by="self_cpu_time_total", row_limit=45,
                                                       max_name_column_width=90))
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    syncs = {e.key: [e.count, e.self_cpu_time_total] for e in events if e.key in SYNC_NAMES}
    launches = {e.key: [e.count, e.self_cpu_time_total] for e in events
                if "aunch" in e.key and e.device_type == torch.autograd.DeviceType.CPU}
    top = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
                 key=lambda e: -e.self_cpu_time_total)[:25]
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: -e.self_device_time_total)[:15]
    return dict(gpu_ms=gpu_us / 1e3, syncs=syncs, launches=launches,
                top_gpu=[[e.key[:90], e.count, round(e.self_device_time_total / 1e3, 3)] for e in kernels],
                top_cpu=[[e.key[:90], e.count, round(e.self_cpu_time_total / 1e3, 3)] for e in top])


def prefill(model, backend, name: str, tokens: int = 2048) -> dict:
    compiled = torch.compile(model, backend=backend)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device="cuda")
    for _ in range(3):
        compiled(ids, use_cache=False, logits_to_keep=1)
    torch.cuda.synchronize()
    walls, hosts = [], []
    for _ in range(7):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record()
        start = time.perf_counter()
        compiled(ids, use_cache=False, logits_to_keep=1)
        hosts.append((time.perf_counter() - start) * 1e3)
        end.record()
        torch.cuda.synchronize()
        walls.append(begin.elapsed_time(end))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        compiled(ids, use_cache=False, logits_to_keep=1)
        torch.cuda.synchronize()
    return dict(wall_ms=statistics.median(walls), host_ms=statistics.median(hosts),
                **summarize(prof, f"{name}_prefill"))


BATCH = int(os.environ.get("BATCH", "1"))
CONTEXTS = [int(c) for c in os.environ.get("CONTEXTS", "256,2048").split(",")]


def decode(model, backend, name: str, context: int, steps: int = 8) -> dict:
    variant = bm.Variant(name, backend)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, context), device="cuda")
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=steps + 1, do_sample=False,
                  compile_config=variant.compile_config(torch.device("cuda")), cache_implementation="static")
    model.generate(ids, **kwargs)
    clock = bm.StepClock(torch.device("cuda"))
    graphs = bm._graphs()
    model.generate(ids, logits_processor=[clock], **kwargs)
    ms = clock.ms_per_step()
    recompiles = bm._graphs() - graphs
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model.generate(ids, **kwargs)
        torch.cuda.synchronize()
    return dict(context=context, ms_per_step=ms, recompiles=recompiles, **summarize(prof, f"{name}_decode_{context}"))


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    which = sys.argv[1:] or ["bf16_inductor", "fp8"]
    model = bm.build("qwen3-30b-a3b", LAYERS, "cuda")
    results = {}
    for name in which:
        backend = "inductor" if name == "bf16_inductor" else fp8compile.backend()
        torch._dynamo.reset()
        row = dict(prefill=prefill(model, backend, name)) if "prefill" in os.environ.get("PARTS", "prefill") else {}
        torch._dynamo.reset()
        row["decode"] = [decode(model, backend, name, c) for c in CONTEXTS]
        results[name] = row
        (OUT / "default_mode_probe.json").write_text(json.dumps(results, indent=1))
        if "prefill" in row:
            print(name, "prefill", {k: row["prefill"][k] for k in ("wall_ms", "host_ms", "gpu_ms", "syncs")},
                  flush=True)
        for d in row["decode"]:
            print(name, "decode", {k: d[k] for k in ("context", "ms_per_step", "recompiles", "gpu_ms", "top_gpu")},
                  flush=True)


if __name__ == "__main__":
    with torch.no_grad():  # as bench model: a graph that needs gradients stays bf16
        main()
