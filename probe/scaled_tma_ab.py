"""The scaled decode kernel's weight through TMA or pointer loads, kernel alone (throwaway)."""

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
    for m in (1, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        scale = torch.tensor(0.01, device="cuda")
        outs = {}
        for tma in (False, True, False, True):
            fns = [
                lambda w=w, s=s, tma=tma: linear_scaled_decode(
                    x, w, s, None, scale, "rowwise", max_m=m, tma=tma
                )
                for w, s in weights
            ]
            outs[tma] = fns[0]()
            us = harness.time_us(fns)
            row = dict(n=n, k=k, m=m, tma=tma, us=us, tbps=n * k / us / 1e6)
            rows.append(row)
            print(json.dumps(row), flush=True)
        assert torch.equal(outs[False], outs[True]), (n, k, m)
json.dump(rows, open(os.path.join(sys.argv[1], "scaled_tma_ab.json"), "w"), indent=1)
