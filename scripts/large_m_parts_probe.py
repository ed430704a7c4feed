"""Where the compiled linear's time goes at large M, part by part, in one run (same harness as
`bench gemm`: CUDA-graph replay over weight copies past L2):

- quant: our activation quantization alone (MN-major scales, what DeepGEMM reads);
- deep_gemm: DeepGEMM's GEMM alone on pre-quantized activations (bench gemm's anchor);
- quant+deep_gemm: both, called from Python one after the other (what the op does);
- op: the fp8compile::linear op body for the DeepGEMM backend (vendors.linear_deep_gemm);
- compiled: an nn.Linear compiled with backend="fp8" (bench gemm's `fp8compile`), whose GPU
  kernels (names, us) are also listed from one profiled call.

    source .whl/prelude.sh && python scripts/large_m_parts_probe.py [--out DIR]
"""
import argparse
import json
import os
from pathlib import Path

import torch

import fp8compile
from fp8compile.bench import kernels as bench
from fp8compile.ops import triton_quant, vendors

SHAPES = [(4096, 7168), (7168, 2048), (4096, 14336)]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, default=4096)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args()
    import deep_gemm

    rows = []
    with torch.no_grad():
        for n, k in SHAPES:
            shape = bench._Shape(n, k)
            x = torch.randn(a.m, k, device="cuda", dtype=torch.bfloat16)
            q = triton_quant.quant_act(x, layout="mn_major")
            out = torch.empty(a.m, n, device="cuda", dtype=torch.bfloat16)

            def quant_dg(w):
                xq = triton_quant.quant_act(x, layout="mn_major")
                deep_gemm.fp8_gemm_nt(xq, w, out, disable_ue8m0_cast=True)

            us = {
                "quant": bench._time_us([lambda: triton_quant.quant_act(x, layout="mn_major")]),
                "deep_gemm": bench._time_us([lambda w=w: deep_gemm.fp8_gemm_nt(q, w, out, disable_ue8m0_cast=True)
                                             for w in shape.w8]),
                "quant+deep_gemm": bench._time_us([lambda w=w: quant_dg(w) for w in shape.w8]),
                "op": bench._time_us([lambda w=w: vendors.linear_deep_gemm(x, *w) for w in shape.w8]),
                "compiled": bench._time_us([lambda f=f: f(x) for f in shape.linears]),
            }
            ref = torch.nn.functional.linear(x, shape.w16[0])
            compiled_diff = fp8compile.calc_diff(shape.linears[0](x), ref)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                shape.linears[0](x)
                torch.cuda.synchronize()
            kernels = [(e.name[:80], round(e.device_time, 1)) for e in prof.events() if e.device_time > 0]
            rows.append(dict(n=n, k=k, m=a.m, us=us, copies=len(shape.w8), compiled_calc_diff_vs_bf16=compiled_diff,
                             compiled_kernels=kernels))
            print(f"  compiled kernels: {kernels}")
            print(f"N={n} K={k} M={a.m}: " + ", ".join(f"{key} {t:.1f}" for key, t in us.items() if t)
                  + f"; compiled calc_diff vs bf16 {compiled_diff:.2e}", flush=True)
            del shape
            torch.cuda.empty_cache()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "large_m_parts_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
