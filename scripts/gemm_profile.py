"""Run one large-M GEMM a few times, for a profiler (Nsight Compute) to pick up:

    ncu --kernel-name regex:'_gemm_kernel|sm90_fp8_gemm' --launch-skip 3 --launch-count 1 \
        --section WarpStateStats python scripts/gemm_profile.py --kernel gluon --config '{"BLOCK_M": 192, "OVERLAP": false}'

--kernel gluon (fp8compile's Gluon GEMM, --config on top of gluon_gemm.CONFIG) or deep_gemm.
"""
import argparse
import json

import torch

from fp8compile.ops import gluon_gemm, reference, triton_quant


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", choices=("gluon", "deep_gemm"), default="gluon")
    p.add_argument("--config", type=json.loads, default={})
    p.add_argument("--m", type=int, default=4096)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--k", type=int, default=14336)
    p.add_argument("--runs", type=int, default=5)
    a = p.parse_args()
    x = torch.randn(a.m, a.k, device="cuda", dtype=torch.bfloat16)
    w8, ws = reference.quant_weight_block(torch.randn(a.n, a.k, device="cuda", dtype=torch.bfloat16) * 0.02)
    if a.kernel == "gluon":
        x8, xs = triton_quant.quant_act(x)
        cfg = {**gluon_gemm.CONFIG, **a.config}
        run = lambda: gluon_gemm.gemm(x8, xs, w8, ws, config=cfg)  # noqa: E731
    else:
        import deep_gemm
        q = triton_quant.quant_act(x, layout="mn_major")
        out = torch.empty(a.m, a.n, device="cuda", dtype=torch.bfloat16)
        run = lambda: deep_gemm.fp8_gemm_nt(q, (w8, ws), out, disable_ue8m0_cast=True)  # noqa: E731
    for _ in range(a.runs):
        run()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
