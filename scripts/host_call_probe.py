"""Probe (one session): host time of one call of each layer of the Gluon grouped GEMM's call path,
and of cuBLAS's block-scaled _scaled_mm against torch.mm, at Qwen3-30B-A3B widths.

    python scripts/host_call_probe.py   (GPU; writes $OUT/host_call_probe.json)

Each is a loop of CALLS calls with small M (the GPU keeps up, so the loop's time is the host's),
median over REPEATS loops, in us a call.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

import fp8compile  # noqa: F401  (registers the ops)
from fp8compile.ops import gluon_gemm, launch, moe_gluon_op

OUT = Path(os.environ.get("OUT", "/tmp/out"))
CALLS, REPEATS = 500, 7


def per_call(fn) -> float:
    """Median host time of one call, each timed alone, the queue drained every 50 calls (so a
    call whose kernel is slower than its host work is not held up by a full launch queue)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(CALLS // 50 * REPEATS):
        for _ in range(50):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        torch.cuda.synchronize()
    return round(sorted(times)[len(times) // 2] * 1e6, 2)


def main() -> None:
    dev = "cuda"
    e, n, k, rows = 128, 1536, 2048, 512
    a = torch.randn(rows, k, device=dev).to(torch.float8_e4m3fn)
    a_scale = torch.rand(rows, k // 128, device=dev) + 0.5
    w = torch.randn(e, n, k, device=dev).to(torch.float8_e4m3fn)
    w_scale = torch.rand(e, n // 128, k // 128, device=dev) + 0.5
    block_expert = torch.arange(rows // 64, device=dev, dtype=torch.int32)
    cfg = gluon_gemm.config_of_rows(64)
    out = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
    prepared = gluon_gemm._prepare(a, a_scale, w, w_scale, None, out, cfg, block_expert)
    op = torch.ops.fp8compile.gluon_grouped_gemm.default

    m2, n2, k2 = 512, 5120, 2048
    x8 = torch.randn(m2, k2, device=dev).to(torch.float8_e4m3fn)
    xs = torch.rand(k2 // 128, m2, device=dev).t()  # (M, G) column-major, as the wrapper passes
    w8 = torch.randn(n2, k2, device=dev).to(torch.float8_e4m3fn)
    ws = torch.rand(n2 // 128, k2 // 128, device=dev)
    xb = torch.randn(m2, k2, device=dev, dtype=torch.bfloat16)
    wb = torch.randn(n2, k2, device=dev, dtype=torch.bfloat16)
    out2 = torch.empty(m2, n2, device=dev, dtype=torch.bfloat16)

    rows_out = {
        "op through the dispatcher (torch.ops...default)": lambda: op(
            a, a_scale, w, w_scale, block_expert, bias=None, block_m=64
        ),
        "op's Python kernel called directly": lambda: moe_gluon_op.gluon_grouped_gemm(
            a, a_scale, w, w_scale, block_expert, None, 64
        ),
        "gluon_gemm.grouped_gemm": lambda: gluon_gemm.grouped_gemm(
            a, a_scale, w, w_scale, block_expert, config=cfg
        ),
        "why_not_grouped": lambda: gluon_gemm.why_not_grouped(a, w),
        "torch.empty of the output": lambda: torch.empty(rows, n, device=dev, dtype=torch.bfloat16),
        "_prepare": lambda: gluon_gemm._prepare(a, a_scale, w, w_scale, None, out, cfg, block_expert),
        "_launch of a prepared call": lambda: gluon_gemm._launch(*prepared),
        "ensure_scratch_allocator": launch.ensure_scratch_allocator,
        "launch._signature": lambda: launch._signature(prepared[1]),
        "_scaled_mm block-scaled 512x5120x2048 (out=)": lambda: torch._scaled_mm(
            x8, w8.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16, out=out2
        ),
        "torch.mm bf16 512x5120x2048 (out=)": lambda: torch.mm(xb, wb.t(), out=out2),
        "torch.empty 512x5120 bf16": lambda: torch.empty(m2, n2, device=dev, dtype=torch.bfloat16),
    }
    # The dispatcher's own cost for a Python kernel: an op that returns a new empty tensor, its
    # Python kernel registered under each dispatch key, against the Python function alone.
    lib = torch.library.Library("fp8probe", "DEF")

    def kernel(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor, n: int = 64) -> torch.Tensor:
        return x.new_empty(4)

    for key in ("CompositeExplicitAutograd", "CUDA"):
        name = "k_" + key.lower()
        lib.define(name + "(Tensor x, Tensor y, Tensor z, int n=64) -> Tensor")
        lib.impl(name, kernel, key)
        overload = getattr(torch.ops.fp8probe, name).default
        rows_out[f"empty-returning Python op, {key}"] = lambda o=overload: o(a, a_scale, w, n=64)
    rows_out["the same Python function called directly"] = lambda: kernel(a, a_scale, w, n=64)
    rows_out["aten.alias.default (a C++ op that does nothing)"] = lambda: torch.ops.aten.alias.default(a)

    # cuBLAS block scaling at the prefill's shapes, one shape per loop and two shapes alternating.
    xq = torch.randn(2048, 2048, device=dev).to(torch.float8_e4m3fn)
    xqs = torch.rand(16, 2048, device=dev).t()
    wq = torch.randn(5120, 2048, device=dev).to(torch.float8_e4m3fn)
    wqs = torch.rand(40, 16, device=dev)
    xo = torch.randn(2048, 4096, device=dev).to(torch.float8_e4m3fn)
    xos = torch.rand(32, 2048, device=dev).t()
    wo = torch.randn(2048, 4096, device=dev).to(torch.float8_e4m3fn)
    wos = torch.rand(16, 32, device=dev)

    def q_mm():
        return torch._scaled_mm(xq, wq.t(), scale_a=xqs, scale_b=wqs.t(), out_dtype=torch.bfloat16)

    def o_mm():
        return torch._scaled_mm(xo, wo.t(), scale_a=xos, scale_b=wos.t(), out_dtype=torch.bfloat16)

    def both():
        q_mm()
        o_mm()

    rows_out["_scaled_mm 2048x5120x2048, one shape (GPU-bound? compare)"] = q_mm
    rows_out["_scaled_mm q then o shapes alternating, per pair"] = both
    xbq, wbq = (
        torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16),
        torch.randn(5120, 2048, device=dev, dtype=torch.bfloat16),
    )
    xbo, wbo = (
        torch.randn(2048, 4096, device=dev, dtype=torch.bfloat16),
        torch.randn(2048, 4096, device=dev, dtype=torch.bfloat16),
    )
    rows_out["torch.mm bf16 q then o shapes alternating, per pair"] = lambda: (
        torch.mm(xbq, wbq.t()),
        torch.mm(xbo, wbo.t()),
    )

    # Behind a busy GPU, as in a host-bound prefill's stream: a call that waits on the GPU (a
    # synchronize, an allocation that frees by waiting) shows the sleep's length here.
    def behind(fn):
        def call():
            torch.cuda._sleep(2_000_000)  # about 1 ms of GPU time queued ahead
            start = time.perf_counter()
            fn()
            spent = time.perf_counter() - start
            torch.cuda.synchronize()
            return spent

        for _ in range(5):
            call()
        return round(sorted(call() for _ in range(50))[25] * 1e6, 2)

    def q_mm_fresh():  # the wrapper's way: fresh fp8 and scale buffers, the scale a column-major view
        x = torch.empty(2048, 2048, device=dev, dtype=torch.float8_e4m3fn)
        sc = torch.empty(16, 2048, device=dev)
        out = torch.empty(2048, 5120, device=dev, dtype=torch.bfloat16)
        return torch._scaled_mm(
            x,
            wq.t(),
            scale_a=sc.t(),
            scale_b=wqs.t(),
            out_dtype=torch.bfloat16,
            use_fast_accum=False,
            out=out,
        )

    behind_rows = {
        "behind a busy GPU: _scaled_mm 2048x5120x2048": q_mm,
        "behind a busy GPU: _scaled_mm, fresh buffers as the wrapper": q_mm_fresh,
        "behind a busy GPU: torch.mm bf16 2048x5120x2048": lambda: torch.mm(xbq, wbq.t()),
        "behind a busy GPU: Gluon grouped op": rows_out["op through the dispatcher (torch.ops...default)"],
        "behind a busy GPU: torch.empty": lambda: torch.empty(2048, 5120, device=dev),
    }
    result = {name: behind(fn) for name, fn in behind_rows.items()}
    rows_out["_scaled_mm, fresh buffers as the wrapper"] = q_mm_fresh
    for grad in ("grad", "no_grad"):
        with torch.set_grad_enabled(grad == "grad"):
            for name, fn in rows_out.items():
                if grad == "grad" or "op" in name or "Python" in name:
                    result[f"{name} [{grad}]"] = per_call(fn)
    for name, us in result.items():
        print(f"{us:9.2f} us  {name}")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            torch.cuda._sleep(200_000)
            q_mm_fresh()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    call = rows_out["op through the dispatcher (torch.ops...default)"]
    prof.enable()
    for _ in range(2000):
        call()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue()[-6000:])
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "host_call_probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
