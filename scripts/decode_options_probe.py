"""Decode kernel launch and load options, side by side in one run on the GPU:
- ACT_TMA (on by default): a plain kernel's activation tiles come through TMA, pipelined with
  the weight tiles, instead of plain loads at the start of each group (only where the weight
  comes through TMA: in a CUDA graph). Gated kernels keep plain loads.
- PDL (programmatic dependent launch, on by default with 1 group prefetched): every decode
  kernel lets the next launch as soon as it starts, and gated kernels launch as dependents: they start
  while the previous kernel drains, pull their first `prefetch` weight groups into L2, and wait
  for it before touching anything else. "all_dependent": every kernel a dependent.
Each variant is timed (CUDA-graph replay, weights past L2) on plain and gated linears back to
back and on the two gated MLPs' decode pair (merged gate|up, then the gated down projection),
and checked bit for bit against "default" on a chain where every kernel reads its
predecessor's output. Ratios are against "default" (> 1: the variant is faster). "default" is
the base the options were measured from (PDL off); what ships is "pdl_prefetch1". Behind
ACT_TMA, USE_PDL and SMALL_M_PDL_PREFETCH in fp8compile/ops/triton_gemm.py. Run on the GPU:
source .whl/prelude.sh && python scripts/decode_options_probe.py [--parts bits,plain,gated,mlp] [--out DIR]
"""
import argparse
import json
from pathlib import Path

import torch

from fp8compile import bench
from fp8compile.ops import reference, triton_gemm

VARIANTS = {  # name: (ACT_TMA, USE_PDL, pdl argument, prefetch)
    "default": (True, False, None, 4),
    "no_act_tma": (False, False, None, 4),
    "pdl": (True, True, None, 4),
    "pdl_prefetch1": (True, True, None, 1),
    "all_dependent": (True, True, True, 4),
}
LINEARS = bench.SHAPES + [(28672, 4096), (3584, 18944)]
GATED = [(4096, 14336), (3584, 18944), (4096, 7168), (14336, 4096)]


def run(fn, variant):
    defaults = triton_gemm.ACT_TMA, triton_gemm.USE_PDL
    triton_gemm.ACT_TMA, triton_gemm.USE_PDL, pdl, prefetch = VARIANTS[variant]
    try:
        return fn(pdl=pdl, prefetch=prefetch)
    finally:
        triton_gemm.ACT_TMA, triton_gemm.USE_PDL = defaults


def time_variants(make_calls, rows, **key):
    """make_calls(variant) -> list of zero-arg callables (one per weight copy)."""
    t = {v: bench._time_us(make_calls(v)) for v in VARIANTS}
    rows.append(dict(key, **{f"{v}_us": t[v] for v in VARIANTS}))
    base = t["default"]
    print(" ".join(f"{k}={v}" for k, v in key.items()).ljust(40)
          + " ".join(f"{v} {t[v]:.1f} ({base / t[v]:.3f})" for v in VARIANTS), flush=True)


def mlp_pair(x, w13, w2, **kw):
    h = triton_gemm.linear_small_m(x, *w13, **kw)
    a, b = h.chunk(2, dim=-1)
    return triton_gemm.linear_small_m(a, *w2, b=b, **kw)


def chain(x, layers, variant):
    for w13, w2 in layers:
        x = run(lambda **kw: mlp_pair(x, w13, w2, **kw), variant)
    return x


def check_bits(device):
    """Four gated-MLP layers back to back, eagerly and replayed from a CUDA graph: every variant
    must give the plain launches' bits (a missing wait would read a half-written input)."""
    hidden, inter = 4096, 14336
    layers = [(reference.quant_weight_block(torch.randn(2 * inter, hidden, device=device, dtype=torch.bfloat16) * 0.02),
               reference.quant_weight_block(torch.randn(hidden, inter, device=device, dtype=torch.bfloat16) * 0.02))
              for _ in range(4)]
    for m in (1, 16, 32):
        x = torch.randn(m, hidden, device=device, dtype=torch.bfloat16)
        want = chain(x, layers, "default")
        for v in VARIANTS:
            eager = chain(x, layers, v)
            graph = torch.cuda.CUDAGraph()
            chain(x, layers, v)  # warm up (JIT) outside the capture
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                captured = chain(x, layers, v)
            graph.replay()
            torch.cuda.synchronize()
            ok = torch.equal(eager, want) and torch.equal(captured, want)
            print(f"bits M={m} {v}: {'same' if ok else 'DIFFERENT'}", flush=True)
            assert ok, v


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--parts", default="bits,plain,gated,mlp", help="comma-separated subset of bits,plain,gated,mlp")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    torch.manual_seed(0)
    device = torch.device("cuda")
    rows = []
    with torch.no_grad():
        if "bits" in parts:
            check_bits(device)
        for n, k, gated in ([(n, k, False) for n, k in LINEARS] if "plain" in parts else []) + \
                ([(n, k, True) for n, k in GATED] if "gated" in parts else []):
            w8 = [reference.quant_weight_block(torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02)
                  for _ in range(bench._copies(n * k))]
            for m in (1, 16, 32):
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                b = torch.randn(m, k, device=device, dtype=torch.bfloat16) if gated else None
                time_variants(lambda v: [lambda q=q: run(lambda **kw: triton_gemm.linear_small_m(x, *q, b=b, **kw), v)
                                         for q in w8], rows, n=n, k=k, m=m, gated=gated)
        for name, (hidden, inter) in bench.MLPS.items() if "mlp" in parts else ():
            copies = [(reference.quant_weight_block(torch.randn(2 * inter, hidden, device=device, dtype=torch.bfloat16) * 0.02),
                       reference.quant_weight_block(torch.randn(hidden, inter, device=device, dtype=torch.bfloat16) * 0.02))
                      for _ in range(bench._copies(3 * hidden * inter))]
            for m in (1, 16, 32):
                x = torch.randn(m, hidden, device=device, dtype=torch.bfloat16)
                time_variants(lambda v: [lambda c=c: run(lambda **kw: mlp_pair(x, *c, **kw), v) for c in copies],
                              rows, mlp=name, m=m)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "decode_options_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
