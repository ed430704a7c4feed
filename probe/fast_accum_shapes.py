"""Rowwise cuBLAS _scaled_mm at M = 4096 with and without fast accumulation, per MLP shape."""

import json, os, torch
from triton.testing import do_bench

rows = []
for n, k in [(37888, 3584), (18944, 3584), (3584, 18944), (28672, 4096), (14336, 4096), (4096, 14336)]:
    m = 4096
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    sa = torch.rand(m, 1, device="cuda") + 0.5
    sb = torch.rand(1, n, device="cuda") + 0.5
    r = {"n": n, "k": k, "m": m}
    for fast in (False, True):
        f = lambda: torch._scaled_mm(
            a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast
        )
        r["fast" if fast else "fp32_promote"] = do_bench(f, warmup=50, rep=200) * 1e3
    r["tflops_fast"] = 2 * m * n * k / r["fast"] / 1e6
    rows.append(r)
    print(r)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "fast_accum_shapes.json"), "w"), indent=1)
