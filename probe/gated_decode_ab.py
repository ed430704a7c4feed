"""A/B of the rowwise gated down projection at decode sizes (throwaway; numbers go to BENCHMARKS.md):
act(gate, up) quantized first by triton_quant_rows (QUANTIZE_GATED_FIRST) against act computed in
every GEMM program, on the whole compiled MLP, beside the block recipe, torchao rowwise and bf16."""

import json
import os
import sys

import torch

import fp8compile
from fp8compile.bench import harness
from fp8compile.bench.mlp import MLPS, _torchao_rowwise
from fp8compile.demo import GatedMLP
from fp8compile.ops import triton_scaled

out = {}
torchao = _torchao_rowwise()
with torch.no_grad():
    for name, (h, i) in MLPS.items():
        copies = [GatedMLP(h, i).to("cuda", torch.bfloat16) for _ in range(harness.copies(3 * h * i))]
        xs = {m: torch.randn(m, h, device="cuda", dtype=torch.bfloat16) for m in (1, 16)}
        ref = {m: copies[0].float()(x.float()) for m, x in xs.items()}
        copies[0].bfloat16()

        def run(label, make):
            torch._dynamo.reset()
            fns = make()
            for m, x in xs.items():
                us = harness.time_us([lambda f=f: f(x) for f in fns])
                diff = fp8compile.calc_diff(fns[0](x).float(), ref[m])
                out[f"{name} M={m} {label}"] = dict(us=us, calc_diff=diff)
                print(f"{name} M={m} {label}: {us:.1f} us, calc_diff {diff:.3e}", flush=True)

        for first in (False, True):
            triton_scaled.QUANTIZE_GATED_FIRST = first
            backend = fp8compile.backend(recipe="rowwise")
            run(
                f"fp8_rowwise quantize_first={first}",
                lambda: [torch.compile(c, backend=backend) for c in copies],
            )
        triton_scaled.QUANTIZE_GATED_FIRST = True
        backend = fp8compile.backend()
        run("fp8_block", lambda: [torch.compile(c, backend=backend) for c in copies])
        if torchao is not None:
            run("torchao_rowwise", lambda: [torch.compile(torchao(c)) for c in copies])
        run("bf16_inductor", lambda: [torch.compile(c) for c in copies])
        copies = None
        torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "gated_decode_ab.json"), "w"), indent=1)
print(torch.cuda.get_device_name(0), torch.__version__, file=sys.stderr)
