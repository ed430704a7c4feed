"""Why the second MLP of a process (Qwen2.5-7B after Llama-3-8B) runs bf16 at M = 1 (throwaway)."""

import copy
import json
import os
import sys

import torch

import fp8compile
from fp8compile.bench import harness
from fp8compile.bench.mlp import _torchao_rowwise
from fp8compile.demo import GatedMLP

out = sys.argv[1]
order = sys.argv[2].split(",")  # which variants, in order
mlps = {"llama": (4096, 14336), "qwen": (3584, 18944)}
torchao = _torchao_rowwise()
rows = []
with torch.no_grad():
    for name, (h, i) in mlps.items():
        copies = [GatedMLP(h, i).to("cuda", torch.bfloat16) for _ in range(harness.copies(3 * h * i))]
        ref = copy.deepcopy(copies[0]).float()
        inputs = [(m, torch.randn(m, h, device="cuda", dtype=torch.bfloat16)) for m in (1, 16)]
        for v in order:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            be = "inductor" if v in ("bf16", "torchao") else fp8compile.backend(recipe=v)
            fns = [torch.compile(torchao(c) if v == "torchao" else c, backend=be) for c in copies]
            for m, x in inputs:
                us = harness.time_us([lambda f=f: f(x) for f in fns])
                got = fns[0](x).float()
                d = fp8compile.calc_diff(got, ref(x.float()))
                row = dict(
                    model=name,
                    variant=v,
                    m=m,
                    us=us,
                    calc_diff=d,
                    stats=dict(torch._dynamo.utils.counters["stats"]),
                    inductor={
                        k: c for k, c in torch._dynamo.utils.counters["inductor"].items() if "cache" in k
                    },
                )
                rows.append(row)
                print(json.dumps(row), flush=True)
            if v not in ("bf16", "torchao"):
                print(be.report, flush=True)
        copies = None
        ref = None
        torch.cuda.empty_cache()
json.dump(rows, open(os.path.join(out, "qwen_second.json"), "w"), indent=1)
