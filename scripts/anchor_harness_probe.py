"""Why the decode anchors stream weights at "about 2 TB/s" in ../shared/device/README.md and at
about 3 TB/s in `bench gemm`: the same kernels timed by four harnesses, side by side.

- `graph`: `bench gemm`'s harness: CUDA-graph replay over weight copies that together are
  >= 4x the L2 cache (each call reads its weight from HBM; nothing else runs between calls).
- `do_bench`: `triton.testing.do_bench(fn, return_mode="median")`, as the device README says to
  time. Before every call it clears the L2 by writing zeros over a 256 MB buffer.
- `zero_flush`: the same, spelled out: write zeros over 256 MB, event, the call, event.
- `read_flush`: the same loop, but the L2 is cleared by reading 256 MB, not writing it.

`fp8compile_graphs` is the compiled linear with mode="reduce-overhead" (Inductor's CUDA graphs,
one per M), timed by the flushed harnesses only: it is a CUDA graph itself.

`read` is a kernel that only reads the FP8 weight bytes (scripts/decode_probe.py), the floor of
any decode kernel. If the write-flushed harnesses slow every kernel, the plain read included,
by about the same microseconds, what they measure is the flush's dirty lines being written back
from L2 while the call runs, not the kernel.

Run on the device: source .whl/prelude.sh && python scripts/anchor_harness_probe.py --out $OUT
"""
import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, ".")
sys.path.insert(0, "scripts")
from decode_probe import read_all  # noqa: E402

import fp8compile  # noqa: E402
from fp8compile.bench import kernels as bench  # noqa: E402

FLUSH_BYTES = 256 << 20  # what triton.testing.do_bench clears the L2 with
VARIANTS = ("read", "bf16", "deep_gemm", "flashinfer", "cublas_fp8", "triton_small_m", "fp8compile", "fp8compile_graphs")


def _flushed_us(fn, flush, reps: int = 200) -> float:
    """Median us of fn() between CUDA events, the L2 flushed by flush() before each call."""
    for _ in range(3):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        flush()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[reps // 2] * 1000


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ms", default="1,16")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args()
    ms = [int(m) for m in a.ms.split(",")]
    flush_buf = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    torch._dynamo.config.cache_size_limit = 64  # a compiled nn.Linear per shape and mode: no eager fallback
    harnesses = {
        "graph": lambda fns: bench._time_us(fns),
        "do_bench": lambda fns: triton.testing.do_bench(fns[0], return_mode="median") * 1000,
        "zero_flush": lambda fns: _flushed_us(fns[0], flush_buf.zero_),
        "read_flush": lambda fns: _flushed_us(fns[0], flush_buf.sum),
    }
    rows = []
    device = torch.cuda.get_device_name(0)
    with torch.no_grad():
        for n, k in bench.SHAPES:
            shape = bench._Shape(n, k)
            lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
            lin.weight.data.copy_(shape.w16[0])
            graphed = torch.compile(lin, backend=fp8compile.backend(), dynamic=True, mode="reduce-overhead")
            for m in ms:
                variants = shape.variants(m)
                variants["read"] = [lambda w=w: read_all(w) for w, _ in shape.w8]
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                variants["fp8compile_graphs"] = [lambda: graphed(x)]
                for name in VARIANTS:
                    if name not in variants or (name == "cublas_fp8" and m < 8):  # cuBLAS fails at M = 1
                        continue
                    row = dict(device=device, n=n, k=k, m=m, variant=name)
                    for h, time in harnesses.items():
                        if name == "fp8compile_graphs" and h == "graph":  # a CUDA graph already
                            row[h] = None
                            continue
                        try:
                            row[h] = time(variants[name])
                        except Exception as e:  # a backend that cannot run here: say so, go on
                            print(f"  {name} {h}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                            row[h] = None
                    rows.append(row)
                    print(f"N={n} K={k} M={m} {name:15s} " + " ".join(
                        f"{h} {row[h]:.1f}" if row[h] else f"{h} -" for h in harnesses), flush=True)
            del shape
            torch.cuda.empty_cache()
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, "anchor_harness_probe.json"), "w") as f:
                json.dump(rows, f, indent=1)
    print(table(rows, list(harnesses)))


def table(rows, harnesses) -> str:
    """Per harness and point: the plain read, the best anchor and ours in us, and what the
    issue's decode target asks: best anchor / 1.4 against the read."""
    lines = [f"{'N':>6} {'K':>6} {'M':>3} {'harness':>11} {'read':>7} {'best anchor':>18} {'ours':>7} "
             f"{'anchor TB/s':>11} {'read TB/s':>9} {'target us':>9} {'ours, graphs':>12}"]
    points = sorted({(r["n"], r["k"], r["m"]) for r in rows})
    for n, k, m in points:
        at = {r["variant"]: r for r in rows if (r["n"], r["k"], r["m"]) == (n, k, m)}
        for h in harnesses:
            anchors = [(at[v][h], v) for v in ("deep_gemm", "flashinfer", "cublas_fp8") if v in at and at[v][h]]
            if not anchors or not at.get("read", {}).get(h):
                continue
            best, name = min(anchors)
            ours = at.get("fp8compile", {}).get(h)
            graphs = at.get("fp8compile_graphs", {}).get(h)
            lines.append(f"{n:>6} {k:>6} {m:>3} {h:>11} {at['read'][h]:>7.1f} {best:>7.1f} {name:>10} "
                         f"{ours or float('nan'):>7.1f} {n * k / best / 1e6:>11.2f} {n * k / at['read'][h] / 1e6:>9.2f} "
                         f"{best / 1.4:>9.1f} {graphs or float('nan'):>12.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
