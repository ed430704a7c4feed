"""Probe (one session): host time of fp8compile::moe outside CUDA graphs (default mode), its
kernels launched through Triton's own path against our Launcher (ops/launch.py). Each call is
repeated 50 times without a sync, so the loop's time is what the host spends enqueuing it while
the GPU's queue does not fill; then the same with a sync (the wall). Qwen3-30B-A3B widths.
Then cProfile of the op with the Launcher. Writes $OUT/moe_host_probe.json."""
import cProfile
import io
import json
import os
import pstats
import time

import torch

import fp8compile  # noqa: F401  (registers the ops)
from fp8compile.ops import gluon_gemm, launch
from fp8compile.ops import triton_moe as tm
from fp8compile.ops import triton_quant

E, TOP_K, H, INTER = 128, 8, 2048, 768
LAUNCHERS = [getattr(tm, name) for name in dir(tm) if name.endswith("_launch")] + \
    [gluon_gemm._gemm_launch, triton_quant._quant_act_launch]
assert all(isinstance(x, launch.Launcher) for x in LAUNCHERS)

w13 = torch.randn(E, 2 * INTER, H, device="cuda", dtype=torch.bfloat16) * 0.02
w2 = torch.randn(E, H, INTER, device="cuda", dtype=torch.bfloat16) * 0.02


def op(x, ids, weights):
    return torch.ops.fp8compile.moe(x, ids, weights, w13, w2, backend="triton")


def timed(fn, n=50):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()
    return dict(host_us=host, wall_us=(time.perf_counter() - start) / n * 1e6)


out = {}
for t in (1, 16, 2048):
    x = torch.randn(t, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.topk(torch.rand(t, E, device="cuda"), TOP_K, dim=-1).indices
    weights = torch.softmax(torch.randn(t, TOP_K, device="cuda"), -1)
    for relaunch in (False, True):
        for launcher in LAUNCHERS:
            launcher.relaunch = relaunch
        name = f"T={t} {'launcher' if relaunch else 'triton_path'}"
        out[name] = timed(lambda: op(x, ids, weights))
        print(name, out[name], flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        op(x, ids, weights)
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    print(f"T={t}", text.getvalue()[:5000])
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "moe_host_probe.json"), "w"), indent=1)

# The op's parts, each in its own tight loop (no sync), Launcher on.
for launcher in LAUNCHERS:
    launcher.relaunch = True
lib = torch.library.Library("probe", "DEF")
lib.define("identity(Tensor x, Tensor y, Tensor z, Tensor w, Tensor v, Tensor? a=None, Tensor? b=None, "
           "Tensor? c=None, bool e=False, str backend='x', bool kn=False, str g='concat', str act='silu', "
           "float alpha=1.7, float limit=7.0, bool bi=False) -> Tensor")
lib.impl("identity", lambda x, *args, **kwargs: x, "CompositeExplicitAutograd")
from fp8compile.ops.custom import _check_moe_args  # noqa: E402
from fp8compile.weights import fp8_experts  # noqa: E402

w13_fp8, s13 = fp8_experts(w13)
w2_fp8, s2 = fp8_experts(w2)
parts_out = {}
for t in (1, 2048):
    x = torch.randn(t, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.topk(torch.rand(t, E, device="cuda"), TOP_K, dim=-1).indices
    weights = torch.softmax(torch.randn(t, TOP_K, device="cuda"), -1)
    s = ids.numel()
    gluon = tm._gluon_runs(x, w13_fp8, w2_fp8, s, False)
    bm = 64 if gluon else tm.block_m_for(s, E)
    slots, block_expert = tm.route(ids, E, bm)
    x_fp8, x_s = triton_quant.quant_act(x, False, "row")
    parts = {
        "op (torch.ops.fp8compile.moe)": lambda: op(x, ids, weights),
        "moe_triton on fp8 weights": lambda: tm.moe_triton(x, ids, weights, w13_fp8, s13, w2_fp8, s2),
        "empty custom op, same arguments": lambda: torch.ops.probe.identity(x, ids, weights, w13, w2),
        "memo lookups (2)": lambda: (fp8_experts(w13), fp8_experts(w2)),
        "_check_moe_args": lambda: _check_moe_args(x, ids, weights, w13, w2, None, None, False, "concat", "silu"),
        "_gluon_runs": lambda: tm._gluon_runs(x, w13_fp8, w2_fp8, s, False),
        "route": lambda: tm.route(ids, E, bm),
        "quant_act": lambda: triton_quant.quant_act(x, False, "row"),
        "torch.empty": lambda: torch.empty(t, H, device="cuda"),
        "topk_sum": lambda: tm.topk_sum(torch.empty(s, H, device="cuda", dtype=torch.bfloat16), ids, weights, E),
    }
    if gluon:
        a, a_s, rows = tm.gather_quant(x, slots, block_expert, s, TOP_K, bm)
        parts["gather_quant"] = lambda: tm.gather_quant(x, slots, block_expert, s, TOP_K, bm)
        parts["gluon grouped_gemm 1"] = lambda: gluon_gemm.grouped_gemm(a, a_s, w13_fp8, s13, block_expert)
        parts["gluon launch_args"] = lambda: gluon_gemm.launch_args(
            a, a_s, w13_fp8, s13, None, torch.empty(a.shape[0], 2 * INTER, device="cuda", dtype=torch.bfloat16),
            None, block_expert)
    else:
        parts["triton grouped_gemm 1"] = lambda: tm.grouped_gemm(x_fp8, x_s, w13_fp8, s13, None, slots, block_expert,
                                                                  s, TOP_K, bm)
    for name, fn in parts.items():
        parts_out[f"T={t} {name}"] = timed(fn, 200)["host_us"]
        print(f"T={t} {name:40s} {parts_out[f'T={t} {name}']:.1f}", flush=True)
json.dump(dict(out, parts=parts_out), open(os.path.join(os.environ.get("OUT", "."), "moe_host_probe.json"), "w"),
          indent=1)
