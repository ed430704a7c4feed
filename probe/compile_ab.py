"""First call with split_kv on and off, by phase: generate()'s first call at B=1, then B=4 (the
dynamic recompile), under cProfile, with Dynamo's compile_times() table and a count of the
Triton kernels Inductor submits. Throwaway probe."""

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

from fp8compile.bench import model as bm
import torch._inductor.async_compile as ac
import torch._inductor.compile_fx as cfx
import torch._inductor.graph as igraph

torch._inductor.config.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False
T = collections.defaultdict(float)
N = collections.Counter()
SUBMITTED = []


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


_orig_triton = ac.AsyncCompile.triton


def submit(self, kernel_name, source_code, *a, **k):
    SUBMITTED.append((kernel_name, len(source_code), "_gqa_decode_kernel" in source_code))
    return _orig_triton(self, kernel_name, source_code, *a, **k)


ac.AsyncCompile.triton = submit
timed(cfx, "compile_fx_inner", "compile_fx_inner")
timed(igraph.GraphLowering, "run", "GraphLowering.run")
timed(igraph.GraphLowering, "codegen", "GraphLowering.codegen")
timed(igraph.GraphLowering, "compile_to_module", "compile_to_module")
timed(ac.AsyncCompile, "wait", "AsyncCompile.wait")

layers = int(sys.argv[1])
names = sys.argv[2:]
out = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
model = bm.build("llama-3-8b", layers, "cuda")
bm._warm_up_compiler(dev)
rows = []
for name in names:
    torch._dynamo.reset()
    variant = bm._variant(name)
    for batch in (1, 4):
        T.clear()
        N.clear()
        SUBMITTED.clear()
        ids = torch.randint(0, 1000, (batch, 256), device=dev)
        pr = cProfile.Profile()
        t = time.perf_counter()
        pr.enable()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=4,
            do_sample=False,
            cache_implementation="static",
            compile_config=variant.compile_config(dev),
        )
        torch.cuda.synchronize()
        pr.disable()
        s = time.perf_counter() - t
        for order in ("cumulative", "tottime"):
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats(order).print_stats(70)
            open(f"{out}/{name}_b{batch}_{order}.txt", "w").write(buf.getvalue())
        row = dict(
            variant=name,
            layers=layers,
            batch=batch,
            first_call_s=round(s, 2),
            phases={k: [round(v, 2), N[k]] for k, v in T.items()},
            kernels_submitted=len(SUBMITTED),
            attention_kernels_submitted=sum(x[2] for x in SUBMITTED),
            compile_times=torch._dynamo.utils.compile_times(repr="str"),
        )
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "compile_times"}), flush=True)
json.dump(rows, open(f"{out}/compile_ab.json", "w"), indent=1)
