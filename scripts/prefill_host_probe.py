"""Probe (one session): default-mode Qwen3-MoE prefill at 16 layers, dynamic graph (64 tokens first, as
bench model does) and static: wall and host ms, torch.profiler CPU self time by op and CUDA runtime
calls, device allocations per call. Writes $OUT/prefill_host_probe.json."""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

import fp8compile
from fp8compile.bench import model as bm

OUT = Path(os.environ.get("OUT", "/tmp/out"))
LAYERS = int(os.environ.get("LAYERS", "16"))
RESULT = {}


def timed(fn, repeat=7):
    walls, hosts = [], []
    for _ in range(repeat):
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        start = time.perf_counter()
        fn()
        hosts.append((time.perf_counter() - start) * 1e3)
        end.record()
        torch.cuda.synchronize()
        walls.append(begin.elapsed_time(end))
    return dict(wall_ms=statistics.median(walls), host_ms=statistics.median(hosts))


def profiled(fn):
    from torch.profiler import ProfilerActivity, profile
    stats0 = torch.cuda.memory_stats()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    stats1 = torch.cuda.memory_stats()
    events = prof.key_averages()
    cpu = sorted(((e.key[:100], e.count, e.self_cpu_time_total) for e in events if e.self_cpu_time_total > 0),
                 key=lambda r: -r[2])[:40]
    gpu = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    launches = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    allocs = {k: stats1.get(k, 0) - stats0.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries",
                                                              "num_sync_all_streams")}
    return dict(cpu_self_us=cpu, gpu_kernel_ms=gpu / 1e3, gpu_launches=launches, allocator=allocs)


def run(model, name, backend, dynamic_first):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    if dynamic_first:
        compiled(torch.randint(0, 1000, (1, 64), device="cuda"), use_cache=False)
    ids = torch.randint(0, model.config.vocab_size, (1, 2048), device="cuda")

    def step():
        compiled(ids, use_cache=False, logits_to_keep=1)

    for _ in range(3):
        step()
    key = f"{name}_{'dynamic' if dynamic_first else 'static'}"
    RESULT[key] = dict(timed(step), **profiled(step))
    RESULT[key]["again"] = timed(step)
    print(key, RESULT[key]["wall_ms"], RESULT[key]["host_ms"], RESULT[key]["gpu_kernel_ms"], RESULT[key]["allocator"],
          flush=True)
    (OUT / "prefill_host_probe.json").write_text(json.dumps(RESULT, indent=1))


with torch.no_grad():
    model = bm.build("qwen3-30b-a3b", LAYERS, "cuda")
    bm._warm_up_compiler(torch.device("cuda"))
    for dyn in (True, False):
        run(model, "fp8", fp8compile.backend(), dyn)
        run(model, "bf16_inductor", "inductor", dyn)
