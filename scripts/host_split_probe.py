"""Probe (one session): where default-mode Qwen3-MoE host time goes, static against dynamic
graphs. Per variant (bf16_inductor, fp8): prefill 2048 compiled static and compiled after a
64-token call (dynamic, as bench model does), decode generate() at batch 1 then 16 (16 is then
dynamic), each: wall (CUDA events) and host time to return; cProfile of the fp8 runs.
Writes $OUT/host_split_probe.json and host_split_profiles.json (cProfile, us per call or per step)."""
from __future__ import annotations

import cProfile
import json
import os
import pstats
import statistics
import time
from pathlib import Path

import torch

import fp8compile
from fp8compile.bench import model as bm

OUT = Path(os.environ.get("OUT", "/tmp/out"))
LAYERS = int(os.environ.get("LAYERS", "4"))


PROFILES = {}


def write_profile(fn, name, divide=1):
    """cProfile of fn: per function, calls, own and cumulative us (divided by `divide`), top 60 each way."""
    prof = cProfile.Profile()
    prof.runcall(fn)
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats
    rows = [(f"{Path(file).name}:{line}({func})", nc / divide, tt * 1e6 / divide, ct * 1e6 / divide)
            for (file, line, func), (cc, nc, tt, ct, callers) in stats.items()]
    PROFILES[name] = dict(own=sorted(rows, key=lambda r: -r[2])[:60], cumulative=sorted(rows, key=lambda r: -r[3])[:90])


def kernel_counts(fn_all, fn_one, steps):
    """Kernel launches per decode step by name (a generate of steps + 1 tokens minus one of 1)."""
    from torch.profiler import ProfilerActivity, profile

    def counts(fn):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return {e.key: e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA}

    every, one = counts(fn_all), counts(fn_one)
    per = {k[:100]: (v - one.get(k, 0)) / steps for k, v in every.items()}
    return dict(sorted(((k, v) for k, v in per.items() if v), key=lambda kv: -kv[1]))


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


def prefill(model, backend, name, dynamic_first: bool):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    if dynamic_first:
        compiled(torch.randint(0, 1000, (1, 64), device="cuda"), use_cache=False)
    ids = torch.randint(0, model.config.vocab_size, (1, 2048), device="cuda")

    def step():
        compiled(ids, use_cache=False, logits_to_keep=1)

    for _ in range(3):
        step()
    row = timed(step)
    write_profile(step, f"{name}_prefill_{'dynamic' if dynamic_first else 'static'}")
    return row


def decode(model, backend, name):
    torch._dynamo.reset()
    rows = {}
    for batch in (1, 16):
        variant = bm.Variant(name, backend)
        ids = torch.randint(0, model.config.vocab_size, (batch, 256), device="cuda")
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=17, do_sample=False,
                      compile_config=variant.compile_config(torch.device("cuda")), cache_implementation="static")
        model.generate(ids, **kwargs)
        clock = bm.StepClock(torch.device("cuda"))
        start = time.perf_counter()
        model.generate(ids, logits_processor=[clock], **kwargs)
        torch.cuda.synchronize()
        rows[batch] = dict(ms_per_step=clock.ms_per_step(), call_s=time.perf_counter() - start)
        write_profile(lambda: model.generate(ids, **kwargs), f"{name}_decode_b{batch}", divide=17)
        one = {**kwargs, "max_new_tokens": 1}
        rows[batch]["kernels_per_step"] = kernel_counts(lambda: model.generate(ids, **kwargs),
                                                        lambda: model.generate(ids, **one), 16)
    return rows


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    model = bm.build("qwen3-30b-a3b", LAYERS, "cuda")
    results = {}
    for name in ("bf16_inductor", "fp8"):
        backend = "inductor" if name == "bf16_inductor" else fp8compile.backend()
        results[name] = dict(prefill_static=prefill(model, backend, name, False),
                             prefill_dynamic=prefill(model, backend, name, True),
                             decode=decode(model, backend, name) if os.environ.get("DECODE", "1") == "1" else {})
        print(name, json.dumps(results[name]), flush=True)
        (OUT / "host_split_probe.json").write_text(json.dumps(results, indent=1))
        (OUT / "host_split_profiles.json").write_text(json.dumps(PROFILES, indent=0))


if __name__ == "__main__":
    with torch.no_grad():
        main()
