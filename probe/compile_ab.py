"""First call of one variant in a fresh process with cold Triton and Inductor caches (run it
once per variant): generate()'s first call at B=1, then B=4 (the dynamic recompile), timed by
phase; then the steady decode of 64 tokens at B=1 and B=4. Throwaway probe."""

import collections
import functools
import json
import os
import sys
import time

import torch

from fp8compile.bench import model as bm
import torch._inductor.compile_fx as cfx
import torch._inductor.graph as igraph

torch._inductor.config.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False
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


timed(cfx, "compile_fx_inner", "compile_fx_inner")
timed(igraph.GraphLowering, "run", "GraphLowering.run")
timed(igraph.GraphLowering, "codegen", "GraphLowering.codegen")
timed(igraph.GraphLowering, "compile_to_module", "compile_to_module")

layers, name = int(sys.argv[1]), sys.argv[2]
out = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
model = bm.build("llama-3-8b", layers, "cuda")
bm._warm_up_compiler(dev)
variant = bm._variant(name)
row = dict(variant=name, layers=layers)


def generate(batch, new):
    ids = torch.randint(0, 1000, (batch, 256), device=dev)
    torch.cuda.synchronize()
    t = time.perf_counter()
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        cache_implementation="static",
        compile_config=variant.compile_config(dev),
    )
    torch.cuda.synchronize()
    return time.perf_counter() - t


for batch in (1, 4):
    T.clear()
    N.clear()
    row[f"first_call_b{batch}_s"] = round(generate(batch, 4), 2)
    row[f"phases_b{batch}"] = {k: [round(v, 2), N[k]] for k, v in T.items()}
for batch in (1, 4) if "steady" in sys.argv[3:] else ():
    generate(batch, 64)
    row[f"generate64_b{batch}_s"] = round(min(generate(batch, 64) for _ in range(3)), 4)
row["compile_times"] = torch._dynamo.utils.compile_times(repr="str")
print(json.dumps({k: v for k, v in row.items() if k != "compile_times"}), flush=True)
json.dump(row, open(f"{out}/compile_ab_{name}.json", "w"), indent=1)
