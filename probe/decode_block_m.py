"""The traced scaled decode kernel at M <= 16: tiles 16 rows high (max_m = 16) or 32 (max_m = 32, what a
graph of dynamic M gets for its M <= 32 side), kernel alone (throwaway)."""

import json
import os
import sys

import torch

from fp8compile.bench import harness
from fp8compile.ops import reference_scaled as rs
from fp8compile.ops.triton_scaled import linear_scaled_decode

SHAPES = [
    (6144, 4096),
    (4096, 4096),
    (28672, 4096),
    (4096, 14336),
    (4608, 3584),
    (3584, 3584),
    (37888, 3584),
    (3584, 18944),
]
rows = []
for n, k in SHAPES:
    weights = [
        rs.quant_weight_scaled(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, "rowwise")
        for _ in range(harness.copies(n * k))
    ]
    for m in (2, 8, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        scale = torch.tensor(0.01, device="cuda")
        outs = {}
        for max_m in (16, 32, 16, 32):
            fns = [
                lambda w=w, s=s, max_m=max_m: linear_scaled_decode(
                    x, w, s, None, scale, "rowwise", max_m=max_m
                )
                for w, s in weights
            ]
            outs[max_m] = fns[0]()
            us = harness.time_us(fns)
            row = dict(n=n, k=k, m=m, max_m=max_m, us=us, tbps=n * k / us / 1e6)
            rows.append(row)
            print(json.dumps(row), flush=True)
        print(n, k, m, "same bits", torch.equal(outs[16], outs[32]), flush=True)
json.dump(rows, open(os.path.join(sys.argv[1], "decode_block_m.json"), "w"), indent=1)
