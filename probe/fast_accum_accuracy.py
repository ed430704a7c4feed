"""Rowwise _scaled_mm: calc_diff of fast accumulation against fp32 promotion, per K, against the
float64 product of the same FP8 operands (the GEMM's own error) and of the bf16 inputs."""

import json, os, torch
from fp8compile import calc_diff
from fp8compile.ops.reference_scaled import quant_weight_scaled, quant_act_scaled

rows = []
torch.manual_seed(0)
for m, n, k in [
    (4096, 4096, 4096),
    (4096, 4096, 14336),
    (4096, 3584, 18944),
    (64, 4096, 14336),
    (4096, 4096, 65536),
]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    w8, sw = quant_weight_scaled(w, "rowwise")
    x8, sx = quant_act_scaled(x, "rowwise")
    exact = (x8.double() * sx.double()[:, None]) @ (w8.double() * sw.double()[:, None]).t()
    full = x.double() @ w.double().t()
    r = dict(m=m, n=n, k=k)
    for fast in (False, True):
        out = torch._scaled_mm(
            x8,
            w8.t(),
            scale_a=sx.reshape(-1, 1),
            scale_b=sw.reshape(1, -1),
            out_dtype=torch.bfloat16,
            use_fast_accum=fast,
        )
        tag = "fast" if fast else "promote"
        r[f"{tag}_vs_fp8_exact"] = calc_diff(out, exact)
        r[f"{tag}_vs_bf16_exact"] = calc_diff(out, full)
    rows.append(r)
    print(r)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "fast_accum_accuracy.json"), "w"), indent=1)
