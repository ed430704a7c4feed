"""The Gluon GEMM (fp8compile/ops/gluon_gemm.py) on the GPU: checked, then timed against DeepGEMM
and our Triton GEMM in one run.

- check: against the float64 product of the same quantized operands (calc_diff), and bit for
  bit against triton_gemm.gemm_large_m, over shapes that include N = 2112 (not a multiple of
  128), K = 512, M = 1 and M not a multiple of 128, with and without bias.
- time: CUDA-graph replay over weight copies past L2 (fp8compile.bench's harness), GEMM alone on
  pre-quantized activations; DeepGEMM gets its MN-major scales, each kernel its own best.
  `vs_dg` = DeepGEMM time / ours (> 1: ours faster).

    source .whl/prelude.sh && python scripts/gluon_probe.py [--parts check,time] [--out DIR]
"""
import argparse
import itertools
import json
import os
from pathlib import Path

import torch

import fp8compile
from fp8compile import bench
from fp8compile.ops import gluon_gemm, reference, triton_gemm, triton_quant, vendors

CHECK_SHAPES = [(4096, 7168), (2112, 7168), (320, 512), (24576, 1536), (256, 128), (512, 384), (384, 640)]
CHECK_MS = [1, 7, 128, 1000, 4096]
CONFIGS = {  # name: gluon_gemm config (on top of gluon_gemm.CONFIG)
    "plain_pair_s2": dict(),  # CONFIG itself: two K groups per buffer, 2 buffers
    "plain_pair_s2_g8": dict(GROUP_M=8),
    "ovl_pair_s3": dict(OVERLAP=True, STAGES=3),
    "plain_s4": dict(STAGE_GROUPS=1, STAGES=4),  # one K group per buffer
    "m192_pair_s2": dict(BLOCK_M=192),  # TALL_CONFIG
    "m192_pair_s2_g8": dict(BLOCK_M=192, GROUP_M=8),
    "m192_s4": dict(BLOCK_M=192, STAGE_GROUPS=1, STAGES=4),
}
# The Triton kernel itself: gemm_large_m's default hands M > 512 to the Gluon kernel on sm_90.
TRITON_CONFIG = triton_gemm.LARGE_M_CONFIG
MN_SCALES = ("plain_pair_s2",)  # also timed with DeepGEMM's MN-major activation scales


def check() -> list[dict]:
    rows = []
    for (n, k), m, bias in itertools.product(CHECK_SHAPES, CHECK_MS, (False, True)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w8, ws = reference.quant_weight_block(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
        x8, xs = triton_quant.quant_act(x)
        tri = triton_gemm.gemm_large_m(x8, xs, w8, ws, b, config=TRITON_CONFIG)
        exact = reference.gemm_block(x8, xs, w8, ws, b, out_dtype=torch.float64)
        row = dict(n=n, k=k, m=m, bias=bias, triton_calc_diff=fp8compile.calc_diff(tri, exact), calc_diff={},
                   same_bits_as_triton={})
        for name, cfg in CONFIGS.items():
            ours = gluon_gemm.gemm(x8, xs, w8, ws, b, config={**gluon_gemm.CONFIG, **cfg})
            row["calc_diff"][name] = fp8compile.calc_diff(ours, exact)
            row["same_bits_as_triton"][name] = torch.equal(ours, tri)
        rows.append(row)
        print(f"  check N={n} K={k} M={m} bias={bias}: calc_diff max {max(row['calc_diff'].values()):.2e} "
              f"(triton {row['triton_calc_diff']:.2e}), same bits as triton: "
              f"{' '.join(name for name, same in row['same_bits_as_triton'].items() if same)}", flush=True)
    return rows


def time(ms=(1024, 2048, 4096), shapes=bench.SHAPES) -> list[dict]:
    rows = []
    for n, k in shapes:
        w8 = [reference.quant_weight_block(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
              for _ in range(bench._copies(n * k))]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row_q = triton_quant.quant_act(x)
            mn_q = triton_quant.quant_act(x, layout="mn_major")
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            us = {}
            if vendors.import_error("deep_gemm") is None:
                import deep_gemm
                us["deep_gemm"] = bench._time_us([lambda q=q: deep_gemm.fp8_gemm_nt(mn_q, q, out, disable_ue8m0_cast=True)
                                                  for q in w8])
            us["triton"] = bench._time_us([lambda q=q: triton_gemm.gemm_large_m(*row_q, *q, config=TRITON_CONFIG)
                                           for q in w8])
            for name, cfg in CONFIGS.items():
                for layout, q in (("row", row_q), ("mn", mn_q)):
                    if layout == "row" or name in MN_SCALES:
                        us[f"gluon_{name}_{layout}"] = bench._time_us(
                            [lambda w=w: gluon_gemm.gemm(*q, *w, config={**gluon_gemm.CONFIG, **cfg}) for w in w8])
            dg = us.get("deep_gemm")
            row = dict(n=n, k=k, m=m, us=us, vs_dg={key: dg and t and dg / t for key, t in us.items()})
            rows.append(row)
            best = min((t, key) for key, t in us.items() if key.startswith("gluon") and t)
            print(f"  N={n} K={k} M={m}: DeepGEMM {dg or 0:.1f} us, triton {us['triton'] or 0:.1f} "
                  f"({row['vs_dg']['triton'] or 0:.2f}x), best gluon {best[1]} {best[0]:.1f} "
                  f"({row['vs_dg'][best[1]] or 0:.2f}x); " +
                  " ".join(f"{key[6:]}={row['vs_dg'][key] or 0:.2f}" for key in us if key.startswith("gluon")),
                  flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="check,time")
    p.add_argument("--ms", default="1024,2048,4096")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args()
    result = {"device": torch.cuda.get_device_name(), "configs": CONFIGS}
    with torch.no_grad():
        if "check" in a.parts:
            result["check"] = check()
        if "time" in a.parts:
            result["time"] = time(tuple(int(m) for m in a.ms.split(",")))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gluon_probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
