"""The kernel benches' timing harness (bench gemm, mlp, moe, tune).

Timing: each variant is captured in a CUDA graph and replayed (triton.testing.do_bench_cudagraph,
median), so launch overhead does not hide the kernels, as in a decode loop under CUDA graphs.
Each graph runs the variant over R copies of the weights whose total is >= 4x the L2 cache:
every call streams its weights from HBM, as in a real model. Times are per call, in us.
"""

from __future__ import annotations

import math

import torch

import fp8compile


def copies(bytes_each: int) -> int:
    """Weight copies a timed call cycles through so that together they are >= 4x the L2 cache."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(1, min(16, math.ceil(4 * l2 / bytes_each)))


def time_us(fns) -> float | None:
    """Median us per call of one of `fns` (a list of zero-arg callables run back to back)."""
    import triton.testing

    try:
        for fn in fns:  # warm up: JIT, autotune, allocator
            fn()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench_cudagraph(lambda: [fn() for fn in fns], rep=30, return_mode="median")
    except Exception as e:  # a backend that cannot run this shape: report, keep going
        print(f"    failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        torch.cuda.synchronize()
        return None
    return ms * 1000 / len(fns)


def variant_rows(compile_variant, variants, inputs, row, report=False):
    """Time every variant on every input, one variant at a time: Dynamo is reset before each,
    so no variant runs out of its recompile budget (a code object shared by several backends
    keeps at most torch._dynamo.config.cache_size_limit graphs, then silently runs eagerly), and
    Inductor's config is put back as it was, so no variant runs under another's (torchao's
    quantize_ turns coordinate_descent_tuning on for the process; the bf16 variant after it then
    compiled one-row matmuls as Inductor reductions), nor after them."""
    rows = []
    inductor_config = torch._inductor.config.get_config_copy()
    try:
        for variant in variants:
            torch._dynamo.reset()
            torch._inductor.config.load_config(inductor_config)
            fns = compile_variant(variant)
            for key, x in inputs:
                us = time_us([lambda f=f: f(x) for f in fns])
                rows.append(row(variant, key, us))
            if report and isinstance(variants[variant], fp8compile.Fp8Backend):
                print(f"{variant}: {variants[variant].report}")
    finally:
        torch._inductor.config.load_config(inductor_config)
    return rows
