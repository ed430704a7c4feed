"""Decode kernel tiles for plain and gated linears: (BLOCK_N 128, 2 programs per SM) against
(BLOCK_N 256, 1 program per SM), M = 1 and 16, on the benchmark shapes and two gated-MLP shapes.
The gated kernel (act(x, b) fused) loads two activation tiles, computes the activation and
quantizes it for every weight tile; 256-row weight tiles halve that work per weight byte.
Behind SMALL_M_GATED_* in fp8compile/ops/triton_gemm.py. Run on the GPU:
source .whl/prelude.sh && python scripts/decode_tiles_probe.py
"""
import torch

from fp8compile import bench
from fp8compile.ops import reference, triton_gemm

torch.manual_seed(0)
device = torch.device("cuda")
with torch.no_grad():
    for n, k in bench.SHAPES + [(3584, 18944), (28672, 4096)]:
        w8 = [reference.quant_weight_block(torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02)
              for _ in range(bench._copies(n * k))]
        for gated in (False, True):
            for m in (1, 16):
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                b = torch.randn(m, k, device=device, dtype=torch.bfloat16) if gated else None
                t = {}
                for block_n, per_sm in ((128, 2), (256, 1)):
                    split = triton_gemm.small_m_split(n, k, device, block_n, per_sm)
                    t[block_n] = bench._time_us([lambda q=q: triton_gemm.linear_small_m(x, *q, b=b, split_k=split,
                                                                                        block_n=block_n) for q in w8])
                print(f"N={n:6d} K={k:6d} gated={gated:d} M={m:2d}: 128/2 {t[128]:6.1f} us  256/1 {t[256]:6.1f} us"
                      f"  gain {t[128] / t[256]:.3f}")
