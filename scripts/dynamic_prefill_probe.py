"""Probe (one session): why a dynamic-shape default-mode fp8 prefill takes more host time than a
static one (Qwen3-MoE, 4 layers, 2048 tokens): syncs, GPU time and top ops under torch.profiler,
each graph. Writes $OUT/dynamic_prefill_probe.json."""
import json
import os
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import fp8compile
from fp8compile.bench import model as bm

OUT = Path(os.environ.get("OUT", "/tmp/out"))
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync", "cudaMemcpy",
         "aten::item", "aten::_local_scalar_dense", "cudaStreamWaitEvent")


def run(model, name, backend, dynamic_first):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    if dynamic_first:
        compiled(torch.randint(0, 1000, (1, 64), device="cuda"), use_cache=False)
    ids = torch.randint(0, 1000, (1, 2048), device="cuda")
    for _ in range(3):
        compiled(ids, use_cache=False, logits_to_keep=1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        compiled(ids, use_cache=False, logits_to_keep=1)
        torch.cuda.synchronize()
    ev = prof.key_averages()
    cpu = [e for e in ev if e.device_type == torch.autograd.DeviceType.CPU]
    gpu = [e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA]
    return dict(
        syncs={e.key: [e.count, round(e.self_cpu_time_total, 1)] for e in cpu if e.key in SYNCS},
        gpu_ms=sum(e.self_device_time_total for e in gpu) / 1e3,
        top_gpu=[[e.key[:80], e.count, round(e.self_device_time_total, 1)] for e in
                 sorted(gpu, key=lambda e: -e.self_device_time_total)[:14]],
        top_cpu=[[e.key[:80], e.count, round(e.self_cpu_time_total, 1)] for e in
                 sorted(cpu, key=lambda e: -e.self_cpu_time_total)[:20]])


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    model = bm.build("qwen3-30b-a3b", 4, "cuda")
    res = {}
    for name, backend in (("fp8", fp8compile.backend()), ("bf16_inductor", "inductor")):
        for dyn in (False, True):
            key = f"{name}_{'dynamic' if dyn else 'static'}"
            res[key] = run(model, key, backend, dyn)
            print(key, json.dumps({k: res[key][k] for k in ("syncs", "gpu_ms")}), flush=True)
    (OUT / "dynamic_prefill_probe.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    with torch.no_grad():
        main()
