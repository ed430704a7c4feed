"""Host time of a default-mode decode forward: the graph compiled for one M against the one compiled
for dynamic M (torch.cond per FP8 linear), fp8 against bf16 Inductor.

python scripts/dynamic_host_probe.py LAYERS  (writes dynamic_host_probe.json to $OUT; run with
TORCH_LOGS=output_code to keep the wrappers)
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

import fp8compile
from fp8compile.bench.model import build


def host_and_wall_us(fn, calls=200):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    enqueued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return (enqueued - start) * 1e6 / calls, (done - start) * 1e6 / calls


def main():
    layers = int(sys.argv[1])
    model = build("llama-3-8b", layers, "cuda")
    rows = []
    with torch.no_grad():
        for name in ("bf16_inductor", "fp8"):
            for dynamic in (False, True):
                torch._dynamo.reset()
                backend = "inductor" if name == "bf16_inductor" else fp8compile.backend()
                compiled = torch.compile(model, backend=backend, dynamic=dynamic)
                for batch in (1, 4, 16) if dynamic else (1,):
                    ids = torch.randint(0, 1000, (batch, 1), device="cuda")
                    host, wall = host_and_wall_us(lambda: compiled(ids, use_cache=False, logits_to_keep=1))
                    row = dict(variant=name, dynamic=dynamic, batch=batch, host_us=host, wall_us=wall)
                    print(row, flush=True)
                    rows.append(row)
    Path(os.environ.get("OUT", "."), "dynamic_host_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
