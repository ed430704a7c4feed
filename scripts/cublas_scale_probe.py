"""Probe (issue 20): torch._scaled_mm's 1x128 / 128x128 block scaling against the float64
reference as K/128 (the weight scale's leading dimension once transposed) varies, with the scale
as our weights hold it (w_scale.t(), strides (1, K/128)) and with its columns padded to a
multiple of 4 (strides (1, roundup(K/128, 4))). Writes $OUT/cublas_scale_probe.json."""

import json
import os

import torch

from fp8compile.numerics import calc_diff
from fp8compile.ops import reference, vendors

torch.manual_seed(0)
rows = []
for k in (128, 256, 384, 512, 640, 768, 896, 1024, 1152, 4864):
    for n in (256, 512, 640):
        for m in (8, 64, 128):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
            w_fp8, w_scale = reference.quant_weight_block(w)
            want = reference.linear_block(x, w_fp8, w_scale).float()
            row = {"m": m, "n": n, "k": k, "k_groups": k // 128}
            try:
                row["as_held"] = calc_diff(vendors.linear_cublas(x, w_fp8, w_scale).float(), want)
            except Exception as e:  # noqa: BLE001
                row["as_held"] = f"{type(e).__name__}: {str(e)[:200]}"
            g = k // 128
            g4 = (g + 3) // 4 * 4
            padded = torch.zeros(w_scale.shape[0], g4, device="cuda")
            padded[:, :g] = w_scale
            try:
                row["padded"] = calc_diff(vendors.linear_cublas(x, w_fp8, padded[:, :g]).float(), want)
            except Exception as e:  # noqa: BLE001
                row["padded"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(row, flush=True)
with open(os.path.join(os.environ.get("OUT", "."), "cublas_scale_probe.json"), "w") as f:
    json.dump(rows, f, indent=1)
