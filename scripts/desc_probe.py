"""Probe (one session): the Gluon GEMM with TMA descriptors built on the device (gluon_gemm.py)
against the same kernel with host descriptors (b76b9ed's module, copied beside it before the run:
`git show b76b9ed:fp8compile/ops/gluon_gemm.py > fp8compile/ops/gluon_gemm_host_desc.py`): host
time per call in a tight loop, GPU time per call (CUDA graph replay: since the rule that a launch
being captured takes host descriptors, both columns time host descriptors), and bitwise equality,
at the routed experts' and dense shapes of a Qwen3-30B-A3B prefill of 2048 tokens. Writes
$OUT/desc_probe.json."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch
import triton.testing

from fp8compile.ops import gluon_gemm as device_desc
from fp8compile.ops import gluon_gemm_host_desc as host_desc
from fp8compile.ops import triton_quant

OUT = Path(os.environ.get("OUT", "/tmp/out"))
torch.manual_seed(0)


def host_us(fn, calls=200, repeat=5):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def gpu_us(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3


def operands(m, n, k, experts):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    x_fp8, x_scale = triton_quant.quant_act(x, False)
    lead = (experts,) if experts else ()
    w_fp8 = (torch.randn(*lead, n, k, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    w_scale = torch.rand(*lead, n // 128, k // 128, device="cuda") * 0.01 + 0.001
    return x_fp8, x_scale, w_fp8, w_scale


rows = []
# (name, M, N, K, experts): routed rows of 2048 tokens x top-8 padded to 64-row blocks (~17 k), and
# a dense prefill linear
shapes = [
    ("qwen3 gate_up grouped", 17408, 1536, 2048, 128),
    ("qwen3 down grouped", 17408, 2048, 768, 128),
    ("dense 2048x4096x4096", 2048, 4096, 4096, 0),
    ("dense 2048x6144x4096", 2048, 6144, 4096, 0),
]
for name, m, n, k, experts in shapes:
    x_fp8, x_scale, w_fp8, w_scale = operands(m, n, k, experts)
    if experts:
        block_m = device_desc.grouped_config(n)["BLOCK_M"]
        blocks = m // block_m
        block_expert = torch.arange(blocks, device="cuda", dtype=torch.int32) % experts
        block_expert[-3:] = -1  # skipped blocks, as routing leaves them

        def call(mod):
            return lambda: mod.grouped_gemm(x_fp8, x_scale, w_fp8, w_scale, block_expert)
    else:

        def call(mod):
            return lambda: mod.gemm(x_fp8, x_scale, w_fp8, w_scale)

    new, old = call(device_desc), call(host_desc)
    a, b = new(), old()
    torch.cuda.synchronize()
    valid = slice(None) if not experts else slice(0, (m // block_m - 3) * block_m)
    same = bool(torch.equal(a[valid], b[valid]))
    row = dict(
        shape=name,
        m=m,
        n=n,
        k=k,
        experts=experts,
        bitwise_equal=same,
        host_us_device_desc=host_us(new),
        host_us_host_desc=host_us(old),
        gpu_us_device_desc=gpu_us(new),
        gpu_us_host_desc=gpu_us(old),
        host_us_device_desc_again=host_us(new),
        host_us_host_desc_again=host_us(old),
    )
    print(row, flush=True)
    rows.append(row)

OUT.mkdir(parents=True, exist_ok=True)
(OUT / "desc_probe.json").write_text(
    json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), indent=1)
)
