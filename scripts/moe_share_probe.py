"""Probe (one session): the real host time of the MoE op and of cuBLAS's block-scaled GEMM inside
a default-mode Qwen3-MoE prefill. (1) compiled fp8 4-layer prefill 2048 (static), host time to
return, with the MoE op as it is and stubbed (torch.empty_like), interleaved; (2) the MoE op
alone on the captured arguments, 50 calls without a sync; (3) torch._scaled_mm (block scales),
torch.mm bf16 and our Triton large-M GEMM at the attention's shapes: host us per call, GPU us.
Writes $OUT/moe_share_probe.json."""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

import fp8compile
from fp8compile import registry
from fp8compile.bench import model as bm

OUT = Path(os.environ.get("OUT", "/tmp/out"))


def host_ms(fn, calls=1):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) * 1e3 / calls
    torch.cuda.synchronize()
    return host


def gpu_us(fn, calls=20):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    begin.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) * 1e3 / calls


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    res = {}
    model = bm.build("qwen3-30b-a3b", 4, "cuda")
    compiled = torch.compile(model, backend=fp8compile.backend())
    ids = torch.randint(0, model.config.vocab_size, (1, 2048), device="cuda")

    def step():
        compiled(ids, use_cache=False, logits_to_keep=1)

    for _ in range(3):
        step()
    b, real = registry._IMPLEMENTATIONS[("moe", "triton")]
    captured = []

    def capture(*args):
        captured.append(args)
        return real(*args)

    registry._IMPLEMENTATIONS[("moe", "triton")] = (b, capture)
    step()
    registry._IMPLEMENTATIONS[("moe", "triton")] = (b, lambda x, *rest: torch.empty_like(x))
    step()
    normal, stub = [], []
    for _ in range(7):
        registry._IMPLEMENTATIONS[("moe", "triton")] = (b, real)
        normal.append(host_ms(step))
        registry._IMPLEMENTATIONS[("moe", "triton")] = (b, lambda x, *rest: torch.empty_like(x))
        stub.append(host_ms(step))
    registry._IMPLEMENTATIONS[("moe", "triton")] = (b, real)
    res["prefill_host_ms"] = dict(normal=statistics.median(normal), moe_stubbed=statistics.median(stub),
                                  moe_calls=len(captured))
    args = captured[0]
    res["moe_op_alone_us"] = {2048: host_ms(lambda: real(*args), 50) * 1e3}
    one = (args[0][:1], args[1][:1], args[2][:1], *args[3:])
    res["moe_op_alone_us"][1] = host_ms(lambda: real(*one), 50) * 1e3
    print(json.dumps(res), flush=True)

    from fp8compile.ops import reference, triton_gemm, triton_quant
    gemms = {}
    for m, n, k in ((2048, 5120, 2048), (2048, 2048, 4096), (512, 5120, 2048), (2048, 6144, 4096)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w_fp8, w_scale = reference.quant_weight_block(w)
        x_fp8, x_scale_col = triton_quant.quant_act(x, False, "col")
        x_fp8r, x_scale_row = triton_quant.quant_act(x, False, "row")
        cases = {
            "scaled_mm": lambda: torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=x_scale_col, scale_b=w_scale.t(),
                                                  out_dtype=torch.bfloat16),
            "bf16_mm": lambda: torch.mm(x, w.t()),
            "triton_large_m": lambda: triton_gemm.gemm_large_m(x_fp8r, x_scale_row, w_fp8, w_scale, tma=False),
            "triton_large_m_tma": lambda: triton_gemm.gemm_large_m(x_fp8r, x_scale_row, w_fp8, w_scale, tma=True),
            "gluon": lambda: __import__("fp8compile.ops.gluon_gemm", fromlist=["x"]).gemm(
                x_fp8r, x_scale_row, w_fp8, w_scale),
        }
        row = {}
        for name, fn in cases.items():
            try:
                fn()
                row[name] = dict(host_us=host_ms(fn, 50) * 1e3, gpu_us=gpu_us(fn))
            except Exception as e:  # noqa: BLE001
                row[name] = repr(e)[:200]
        gemms[f"{m}x{n}x{k}"] = row
        print(m, n, k, json.dumps(row), flush=True)
    res["gemms"] = gemms
    (OUT / "moe_share_probe.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    with torch.no_grad():
        main()
