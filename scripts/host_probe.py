"""Host (CPU) cost of our launchers against the GPU time they launch, outside CUDA graphs.

Without a CUDA graph every launch pays its Python launcher; a decode GEMM runs 8-20 us on the
GPU, so a launcher that costs more leaves the GPU waiting. This prints, per call:
- host us: launching 2000 calls back to back, no synchronisation (the launcher's cost);
- eager us: the same loop, synchronised at the end (what a caller without a graph gets);
- graph us: CUDA-graph replay (the GPU time alone, as `bench gemm` measures).
Variants: bf16 F.linear, our decode and large-M kernels with TMA loads, with pointer loads, and
by default (tma_pays_off: pointers outside a graph, TMA in one), and nn.Linear compiled with
backend="fp8" against backend="inductor" (bf16), each also with mode="reduce-overhead"
(Inductor's CUDA graphs, one recorded per M; no `graph` column: they are CUDA graphs already).
`--mlp` adds a stack of four Llama-3-8B gated MLPs (4096 -> 14336 -> 4096) at M = 1 and 16,
compiled the same four ways: what a decode step of a model pays per layer.

Run on the GPU: source .whl/prelude.sh && python scripts/host_probe.py [--out DIR]
"""
import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

import fp8compile
from fp8compile.ops import custom, reference, triton_gemm, triton_quant, vendors


def per_call_us(fn, iters, graph=True):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - start) / iters * 1e6
    torch.cuda.synchronize()
    eager = (time.perf_counter() - start) / iters * 1e6
    graph = triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3 if graph else None
    return dict(host_us=host, eager_us=eager, graph_us=graph)


MODES = {"": None, ", reduce-overhead": "reduce-overhead"}


def compiled_variants(model_fn, backends=("fp8", "bf16_inductor")):
    """name -> the model compiled with dynamic M by each backend, in each mode."""
    out = {}
    for name in backends:
        for suffix, mode in MODES.items():
            backend = fp8compile.backend() if name == "fp8" else "inductor"
            out[f"{name}{suffix}"] = torch.compile(model_fn(), backend=backend, dynamic=True, mode=mode)
    return out


def mlp_stack(rows, iters=500):
    from fp8compile.demo import GatedMLP

    torch.manual_seed(0)
    layers = [GatedMLP(4096, 14336).to("cuda", torch.bfloat16) for _ in range(4)]
    compiled = compiled_variants(lambda: torch.nn.Sequential(*layers))
    with torch.no_grad():
        for m in (1, 16):
            x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
            for name, f in compiled.items():
                r = dict(m=m, what="4 x Llama-3-8B MLP", variant=name,
                         **per_call_us(lambda f=f: f(x), iters, graph="reduce-overhead" not in name))
                rows.append(r)
                print(f"M={m:5d} 4 MLPs {name:28s} host {r['host_us']:7.1f}  eager {r['eager_us']:7.1f}  "
                      f"graph {r['graph_us'] or float('nan'):7.1f} us", flush=True)


def profile(fn, title, calls=500):
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(45)
    print(f"--- {title}: {calls} calls\n" + text.getvalue()[:16000])


def trace(fn, title, calls=50):
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    print(f"--- {title}: {calls} calls")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--profile", action="store_true", help="also cProfile the compiled fp8 nn.Linear (by own time, then cumulative)")
    parser.add_argument("--mlp", action="store_true", help="also time a stack of four Llama-3-8B MLPs")
    parser.add_argument("--trace", action="store_true",
                        help="also list the torch ops the compiled fp8 nn.Linear runs per call (torch.profiler)")
    args = parser.parse_args()
    torch._dynamo.config.cache_size_limit = 64  # nn.Linear's forward, compiled eight ways: no eager fallback
    torch.manual_seed(0)
    n, k = 4096, 7168
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    w8 = reference.quant_weight_block(w)
    lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    lin.weight.data.copy_(w)
    lin16 = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    compiled = {**compiled_variants(lambda: lin, ("fp8",)), **compiled_variants(lambda: lin16, ("bf16_inductor",))}
    rows = []
    with torch.no_grad():
        for m in (1, 16, 1024, 4096):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            x8 = triton_quant.quant_act(x)
            variants = {"bf16 F.linear": lambda: F.linear(x, w)}
            if m <= triton_gemm.SMALL_M_MAX:
                for loads, tma in (("TMA", True), ("pointers", False), ("default", None)):
                    variants[f"decode kernel, {loads}"] = lambda tma=tma: triton_gemm.linear_small_m(x, *w8, tma=tma)
            else:
                for loads, tma in (("TMA", True), ("pointers", False), ("default", None)):
                    variants[f"large-M GEMM, {loads}"] = lambda tma=tma: triton_gemm.gemm_large_m(*x8, *w8, tma=tma)
                x8_mn = triton_quant.quant_act(x, layout="mn_major")
                x8_col = triton_quant.quant_act(x, layout="col")
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                variants["quant_act"] = lambda: triton_quant.quant_act(x)
                variants["cuBLAS _scaled_mm"] = lambda: torch._scaled_mm(x8_col[0], w8[0].t(), scale_a=x8_col[1],
                                                                         scale_b=w8[1].t(), out_dtype=torch.bfloat16)
                if vendors.import_error("deep_gemm") is None:
                    import deep_gemm

                    variants["DeepGEMM fp8_gemm_nt"] = lambda: deep_gemm.fp8_gemm_nt(x8_mn, w8, out, disable_ue8m0_cast=True)
                for backend in ("deep_gemm", "cublas"):
                    variants[f"op fp8compile::linear, {backend}"] = (
                        lambda backend=backend: torch.ops.fp8compile.linear(x, w, None, False, backend))
            if m <= 16:  # the op-call layers around the same decode kernel
                variants["op fp8compile::linear"] = lambda: torch.ops.fp8compile.linear(x, w, None, False, "triton_small_m")
                variants["op body (no dispatcher)"] = lambda: custom.linear(x, w, None, False, "triton_small_m")
            for name, f in compiled.items():
                variants[f"compiled nn.Linear, {name}"] = lambda f=f: f(x)
            for name, fn in variants.items():
                r = dict(m=m, n=n, k=k, variant=name,
                         **per_call_us(fn, 2000 if m <= 16 else 200, graph="reduce-overhead" not in name))
                rows.append(r)
                print(f"M={m:5d} {name:32s} host {r['host_us']:7.1f}  eager {r['eager_us']:7.1f}  "
                      f"graph {r['graph_us'] or float('nan'):7.1f} us", flush=True)
            if args.profile:
                profile(lambda: compiled["fp8"](x), f"compiled nn.Linear, fp8, M={m}")
            if args.trace:
                trace(lambda: compiled["fp8"](x), f"compiled nn.Linear, fp8, M={m}")
    if args.mlp:
        mlp_stack(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "host_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
