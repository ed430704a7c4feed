"""Why the compiled Qwen2.5-7B MLP runs bf16 at M = 1 on the GPU (throwaway)."""

import torch

import fp8compile
from fp8compile.demo import GatedMLP

for h, i in ((3584, 18944), (4096, 14336)):
    mlp = GatedMLP(h, i).to("cuda", torch.bfloat16)
    for recipe in ("rowwise", "block"):
        torch._dynamo.reset()
        backend = fp8compile.backend(recipe=recipe)
        fn = torch.compile(mlp, backend=backend)
        with torch.no_grad():
            x = torch.randn(1, h, device="cuda", dtype=torch.bfloat16)
            got = fn(x)
            print(h, i, recipe, "calc_diff vs bf16", fp8compile.calc_diff(got.float(), mlp(x).float()))
        print(backend.report, flush=True)
        print(torch._dynamo.utils.counters["stats"], dict(torch._dynamo.utils.counters["graph_break"]))
