"""Where a first call's compile time goes, bf16 Inductor against fp8compile, both modes (seventeenth session).

Llama-3-8B widths, 4 layers, random weights; a 64-token forward (static) then an 80-token one
(Dynamo recompiles with a dynamic length); per call: wall time, our passes, the make_fx traces,
Inductor's compile_fx_inner, lowering and codegen. Run with TORCHINDUCTOR_FX_GRAPH_CACHE=0
TORCHINDUCTOR_AUTOGRAD_CACHE=0 so that no variant hits what an earlier one compiled.
"""
import collections
import os
import time

import torch

import fp8compile
import fp8compile.passes
import fp8compile.passes.trace as trace
import torch._inductor.async_compile as async_compile
import torch._inductor.compile_fx as compile_fx
import torch._inductor.graph as inductor_graph
from fp8compile.bench.model import _warm_up_compiler, build

T = collections.defaultdict(float)


def timed(owner, name, label):
    real = getattr(owner, name)

    def wrapper(*a, **k):
        start = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            T[label] += time.perf_counter() - start
    setattr(owner, name, wrapper)


timed(fp8compile.passes, "run_passes", "our passes")
timed(compile_fx, "compile_fx_inner", "compile_fx_inner (Inductor)")
timed(trace, "_trace", "make_fx traces")
timed(inductor_graph.GraphLowering, "codegen", "GraphLowering.codegen")
timed(inductor_graph.GraphLowering, "run", "GraphLowering.run")
timed(async_compile.AsyncCompile, "wait", "AsyncCompile.wait")


def log(*a):
    print(*a)
    with open(os.environ.get("OUT", ".") + "/probe.txt", "a") as f:
        print(*a, file=f)


device = torch.device("cuda")
model = build("llama-3-8b", 4, device)
_warm_up_compiler(device)
with torch.no_grad():
    for name, backend, mode in (("bf16", "inductor", None), ("fp8", fp8compile.backend(), None),
                                ("bf16 ro", "inductor", "reduce-overhead"),
                                ("fp8 ro", fp8compile.backend(), "reduce-overhead")):
        torch._dynamo.reset()
        T.clear()
        compiled = torch.compile(model, backend=backend, mode=mode)
        for shape in ((1, 64), (1, 80)):
            ids = torch.randint(0, 1000, shape, device=device)
            start = time.perf_counter()
            compiled(ids, use_cache=False)
            torch.cuda.synchronize()
            log(name, shape, "first call", round(time.perf_counter() - start, 2), "s",
                {k: round(v, 2) for k, v in sorted(T.items())})
            T.clear()
        log(torch._dynamo.utils.compile_times(repr="str", aggregate=True))
