"""Where a first call's time goes, by phase: generate()'s first call at B=1, then B=4 (the
dynamic recompile), per variant, with wall-clock timers around our passes, Inductor's inner
compile, its lowering and codegen, and its waits on the compile workers. Throwaway probe."""

import cProfile
import collections
import functools
import io
import json
import os
import pstats
import sys
import time

import torch

from fp8compile import kernel_analysis
from fp8compile.bench import model as bm
import fp8compile.passes as P
import torch._inductor.compile_fx as cfx
import torch._inductor.graph as igraph
import torch._inductor.async_compile as ac

T = collections.defaultdict(float)
N = collections.Counter()


def timed(owner, attr, key):
    fn = getattr(owner, attr)

    @functools.wraps(fn)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            T[key] += time.perf_counter() - t
            N[key] += 1

    setattr(owner, attr, wrapper)


PROF = {}
_orig_passes = P.run_passes


def profiled_passes(ctx):
    pr = cProfile.Profile()
    t = time.perf_counter()
    pr.enable()
    try:
        return _orig_passes(ctx)
    finally:
        pr.disable()
        T["fp8 passes"] += time.perf_counter() - t
        N["fp8 passes"] += 1
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(45)
        PROF.setdefault("passes", []).append(buf.getvalue())


P.run_passes = profiled_passes
timed(cfx, "compile_fx_inner", "compile_fx_inner")
timed(igraph.GraphLowering, "run", "GraphLowering.run (lowering, incl. subgraphs)")
timed(igraph.GraphLowering, "codegen", "GraphLowering.codegen")
timed(igraph.GraphLowering, "compile_to_module", "compile_to_module")
timed(ac.AsyncCompile, "wait", "AsyncCompile.wait")
timed(ac.AsyncCompile, "triton", "AsyncCompile.triton (submit)")

layers = int(sys.argv[1])
names = sys.argv[2:]
out = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
model = bm.build("llama-3-8b", layers, "cuda")
rows = []
for name in names:
    torch._dynamo.reset()
    variant = bm._variant(name)
    for batch in (1, 4):
        T.clear()
        N.clear()
        ids = torch.randint(0, 1000, (batch, 256), device=dev)
        t = time.perf_counter()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=4,
            do_sample=False,
            cache_implementation="static",
            compile_config=variant.compile_config(dev),
        )
        torch.cuda.synchronize()
        s = time.perf_counter() - t
        stats = dict(kernel_analysis.stats)
        kernel_analysis.stats.update(asked=0, answered=0)
        row = dict(
            kernel_analysis=stats,
            variant=name,
            layers=layers,
            batch=batch,
            first_call_s=s,
            phases={k: [round(v, 2), N[k]] for k, v in T.items()},
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
for i, text in enumerate(PROF.get("passes", [])):
    open(f"{out}/passes_profile_{i}.txt", "w").write(text)
json.dump(rows, open(f"{out}/compile_phases.json", "w"), indent=1)
