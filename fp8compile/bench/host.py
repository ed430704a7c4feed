"""`python -m fp8compile bench host`: what one decode linear costs the host outside CUDA graphs.

In default mode (no CUDA graphs) every op of a decode step is enqueued by Python, and a step
is host-bound when the enqueue takes longer than the GPU runs. This bench times, for one
linear at M tokens, the host time per call (N calls enqueued back to back, no sync inside) and
the wall time per call (the same with a sync at the end), layer by layer of the FP8 path:

    bf16_eager        F.linear (one cuBLAS call through the C++ dispatcher): the floor
    bf16_inductor     nn.Linear compiled by Inductor, default mode
    fp8compile        nn.Linear compiled with backend="fp8", default mode: the decode side of the
                      dispatch launched by Inductor (passes/inline.py), the cond's branches inline
                      in Inductor's generated code (Fp8Config.inline_conds, on outside CUDA graphs)
    fp8compile_op_launch  the same with inductor_launch=False: cond, op, kernel
    fp8compile_cond_functions  fp8compile with Fp8Config(inline_conds=False): a function per
                      branch, as Inductor emits a cond
    fp8_inductor_launch  fp8compile::linear_decode (ops/linear/decode_op.py) compiled by Inductor, the
                      FP8 weight a module buffer: Inductor launches the decode kernel itself
    fp8_op            torch.ops.fp8compile.linear with the decode backend: dispatcher + op body
    fp8_kernel        the decode kernel's Python entry (ops/triton_gemm.linear_small_m)
    fp8_kernel_triton the same with the direct relaunch off (ops/launch.py): Triton's own path

With chain=L the four compiled variants run L linears (of different weights) in one graph, and
the times are per linear: the graph's own call cost spread over L, as in a model's layer. The
variants are timed in `rounds` interleaved rounds (each round times every variant once) and the
median is reported: a lent host drifts by as much as two variants differ, and a drift then moves
every variant's rounds alike instead of one variant's only.
Writes cProfiles of fp8compile and fp8_inductor_launch per M (host_profile[_decode]_m{M}.txt) beside the JSON.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import fp8compile
from fp8compile.numerics import calc_diff

from .output import profiled


def _host_and_wall_us(fn, calls: int) -> tuple[float, float]:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    enqueued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return (enqueued - start) * 1e6 / calls, (done - start) * 1e6 / calls


class _DecodeChain(torch.nn.Module):
    """Linears through fp8compile::linear_decode, their FP8 weights as buffers (graph tensors)."""

    def __init__(self, linears, max_m: int):
        super().__init__()
        from fp8compile.ops.linear import decode_op  # noqa: F401  (registers the op)
        from fp8compile.weights import fp8_weight

        self.max_m = max_m
        for i, linear in enumerate(linears):
            w_fp8, w_scale = fp8_weight(linear.weight.detach())
            self.register_buffer(f"w_fp8_{i}", w_fp8)
            self.register_buffer(f"w_scale_{i}", w_scale)
        self.layers = len(linears)

    def forward(self, x):
        for i in range(self.layers):
            x = torch.ops.fp8compile.linear_decode(
                x, getattr(self, f"w_fp8_{i}"), getattr(self, f"w_scale_{i}"), max_m=self.max_m
            )
        return x


def bench_host(
    out_dir: Path,
    ms=(1, 16),
    n: int = 4096,
    k: int = 4096,
    calls: int = 200,
    chain: int = 1,
    rounds: int = 5,
) -> list[dict]:
    from fp8compile.ops.linear import triton_gemm
    from fp8compile.weights import fp8_weight

    if max(ms) > triton_gemm.SMALL_M_MAX:
        raise ValueError(f"bench host times decode linears: M <= {triton_gemm.SMALL_M_MAX}, got {max(ms)}")
    if chain > 1 and n != k:
        raise ValueError(f"a chain of linears needs N == K, got N={n}, K={k}")
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    torch.manual_seed(0)
    linears = [torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16) for _ in range(chain)]
    model = torch.nn.Sequential(*linears)
    w = linears[0].weight.detach()
    w_fp8, w_scale = fp8_weight(w)
    inductor = torch.compile(model, dynamic=True)
    fp8 = torch.compile(model, backend=fp8compile.backend(), dynamic=True)
    fp8_op_launch = torch.compile(model, backend=fp8compile.backend(inductor_launch=False), dynamic=True)
    fp8_functions = torch.compile(model, backend=fp8compile.backend(inline_conds=False), dynamic=True)
    decode = torch.compile(_DecodeChain(linears, max(ms)), dynamic=True)
    launcher = triton_gemm._small_m_launch
    rows = []
    with torch.no_grad():
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            variants = {
                "bf16_eager": lambda: F.linear(x, w),
                "bf16_inductor": lambda: inductor(x),
                "fp8compile": lambda: fp8(x),
                "fp8compile_op_launch": lambda: fp8_op_launch(x),
                "fp8compile_cond_functions": lambda: fp8_functions(x),
                "fp8_inductor_launch": lambda: decode(x),
                "fp8_op": lambda: torch.ops.fp8compile.linear(x, w, backend="triton_small_m"),
                "fp8_kernel": lambda: triton_gemm.linear_small_m(x, w_fp8, w_scale),
            }
            compiled = (
                "bf16_inductor",
                "fp8compile",
                "fp8compile_op_launch",
                "fp8compile_cond_functions",
                "fp8_inductor_launch",
            )
            timed = {name: [] for name in variants}
            for _ in range(rounds):
                for name, fn in variants.items():
                    timed[name].append(_host_and_wall_us(fn, calls))
            for name, runs in timed.items():
                per = chain if name in compiled else 1
                hosts = [host / per for host, _ in runs]
                walls = [wall / per for _, wall in runs]
                rows.append(
                    dict(
                        m=m,
                        n=n,
                        k=k,
                        chain=per,
                        variant=name,
                        host_us=statistics.median(hosts),
                        wall_us=statistics.median(walls),
                        host_us_rounds=hosts,
                        wall_us_rounds=walls,
                    )
                )
            out = decode(x).float()
            rows.append(
                dict(
                    m=m,
                    variant="fp8_inductor_launch_vs_fp8compile_calc_diff",
                    value=calc_diff(out, fp8(x).float()),
                )
            )
            same = torch.equal(fp8_functions(x), fp8(x))
            rows.append(dict(m=m, variant="cond_functions_same_bits", value=same))
            relaunched = launcher.relaunch and bool(launcher.compiled)
            launcher.relaunch = False
            try:
                host, wall = _host_and_wall_us(variants["fp8_kernel"], calls)
            finally:
                launcher.relaunch = True
            rows.append(dict(m=m, n=n, k=k, variant="fp8_kernel_triton", host_us=host, wall_us=wall))
            rows.append(dict(m=m, n=n, k=k, variant="direct_relaunch_used", value=relaunched))
            profiled(lambda: [fp8(x) for _ in range(100)], out_dir / f"host_profile_m{m}.txt", lines=25)
            profiled(
                lambda: [decode(x) for _ in range(100)], out_dir / f"host_profile_decode_m{m}.txt", lines=25
            )
    (out_dir / "bench_host.json").write_text(json.dumps(rows, indent=1))
    print(
        f"host cost of one linear N={n} K={k} on {torch.cuda.get_device_name(device)} "
        f"({calls} calls enqueued, "
        f"then one sync; compiled variants: a chain of {chain} linears, per linear; the median of "
        f"{rounds} interleaved rounds): us per call"
    )
    print(f"{'variant':<20}" + "".join(f"{'M=' + str(m) + ' host':>14}{'wall':>8}" for m in ms))
    for name in dict.fromkeys(r["variant"] for r in rows if "host_us" in r):
        cells = "".join(f"{r['host_us']:>14.1f}{r['wall_us']:>8.1f}" for r in rows if r["variant"] == name)
        print(f"{name:<20}{cells}")
    print("direct relaunch taken:", [r["value"] for r in rows if r["variant"] == "direct_relaunch_used"])
    print(
        "fp8_inductor_launch against fp8compile, calc_diff:",
        [r["value"] for r in rows if r["variant"].endswith("calc_diff")],
    )
    print(
        "fp8compile_cond_functions gives fp8compile's bits:",
        [r["value"] for r in rows if r["variant"] == "cond_functions_same_bits"],
    )
    return rows
