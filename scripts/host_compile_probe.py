"""Probe (one session): where the fp8 model's extra first-call time and its default-mode prefill
host time go, Qwen3-30B-A3B widths.

compile: a 64-token forward then an 80-token one (Dynamo recompiles dynamic), bf16 Inductor then
fp8 (bench model's order, after its compiler warm-up), cold caches; timers on our passes, the
make_fx traces, Inductor's compile_fx_inner, AsyncCompile.wait, Triton compiles in this process,
compile-worker shutdowns. prefill: 2048 tokens, default mode, cProfile of one call per variant
(top functions by own time) and the Inductor wrapper modules. Writes $OUT/<part>_*.json.
"""

from __future__ import annotations

import collections
import cProfile
import io
import json
import os
import pstats
import shutil
import sys
import time
from pathlib import Path

import torch
import torch._inductor.async_compile as async_compile
import torch._inductor.compile_fx as compile_fx
import triton.compiler as triton_compiler

import fp8compile
import fp8compile.passes
import fp8compile.passes.trace as trace
from fp8compile.bench import model as bm

OUT = Path(os.environ.get("OUT", "/tmp/out"))
PART, LAYERS = sys.argv[1], int(sys.argv[2])
T: dict[str, float] = collections.defaultdict(float)
N: dict[str, int] = collections.defaultdict(int)


def timed(owner, name, label):
    real = getattr(owner, name)

    def wrapper(*a, **k):
        start = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            T[label] += time.perf_counter() - start
            N[label] += 1

    setattr(owner, name, wrapper)


def compile_part(model):
    timed(fp8compile.passes, "run_passes", "our passes")
    timed(trace, "_trace", "make_fx traces")
    timed(compile_fx, "compile_fx_inner", "compile_fx_inner")
    timed(async_compile.AsyncCompile, "wait", "AsyncCompile.wait")
    timed(triton_compiler, "compile", "triton compile in this process")
    timed(async_compile, "shutdown_compile_workers", "compile worker shutdown")
    result = {}
    for name, backend in (("bf16", "inductor"), ("fp8", fp8compile.backend())):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend)
        for shape in ((1, 64), (1, 80)):
            T.clear()
            N.clear()
            ids = torch.randint(0, 1000, shape, device="cuda")
            start = time.perf_counter()
            compiled(ids, use_cache=False)
            torch.cuda.synchronize()
            row = dict(wall_s=time.perf_counter() - start, **{k: [v, N[k]] for k, v in T.items()})
            result[f"{name}_{shape[1]}"] = row
            print(name, shape, json.dumps(row), flush=True)
        if name == "fp8":
            rep = fp8compile.last_report()
            result["fp8_counts"] = rep.counts() if rep else None
    return result


def prefill_part(model):
    result = {}
    ids = torch.randint(0, model.config.vocab_size, (1, 2048), device="cuda")
    for name, backend in (("fp8", fp8compile.backend()), ("bf16", "inductor")):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend)
        compiled(torch.randint(0, 1000, (1, 64), device="cuda"), use_cache=False)

        def step():
            compiled(ids, use_cache=False, logits_to_keep=1)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        hosts = []
        for _ in range(7):
            torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            hosts.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        step()
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(60)
        stats.sort_stats("cumulative").print_stats(60)
        import gc

        from torch._inductor.runtime.triton_heuristics import CachingAutotuner

        launchers = {}
        for obj in gc.get_objects():
            try:
                tuner = isinstance(obj, CachingAutotuner)
            except ReferenceError:
                continue
            if tuner:
                kernel = obj.inductor_meta.get("kernel_name") or getattr(obj.fn, "__name__", "?")
                launchers[kernel] = [bool(getattr(lau, "_is_static", False)) for lau in obj.launchers]
        result[name] = dict(host_ms=sorted(hosts), profile=text.getvalue(), static=launchers)
        print(name, sorted(hosts), flush=True)
    wrappers = OUT / "wrappers"
    wrappers.mkdir(exist_ok=True)
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    root = Path(cache_dir())
    for path in root.rglob("*.py"):
        text = path.read_text(errors="replace")
        if "def call(" in text and len(text) > 20000:
            shutil.copy(path, wrappers / path.name)
    return result


with torch.no_grad():
    model = bm.build("qwen3-30b-a3b", LAYERS, "cuda")
    bm._warm_up_compiler(torch.device("cuda"))
    with bm._cold_compiles():
        result = compile_part(model) if PART == "compile" else prefill_part(model)
tag = os.environ.get("TAG", "")
(OUT / f"{PART}{tag}_{LAYERS}.json").write_text(json.dumps(result, indent=1))
