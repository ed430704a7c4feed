"""Sweep the Q-stationary MQA logits kernel's tiles against the old kernel and DeepGEMM (prefill, causal)."""
import json, os, sys
import torch
sys.path.insert(0, "probe")
import tm_old
import fp8compile
from fp8compile.bench import harness
from fp8compile.bench.mqa import _fp8_inputs, HEADS, HEAD_DIM
from fp8compile.ops import triton_mqa, reference_mqa as rm

HEADS = int(os.environ.get("HEADS", HEADS))
CONFIGS = [tuple(int(x) for x in c.split(",")) for c in os.environ["CONFIGS"].split()]
rows = []
for m in [int(x) for x in os.environ.get('MS', '4096 8192').split()]:
    gen = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(1, m, HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    k = torch.randn(1, m, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    w = torch.randn(1, m, HEADS, device="cuda", generator=gen).bfloat16()
    args = _fp8_inputs(q, k, w)
    args = (args[0], args[1], args[2], args[3] * (64 / HEADS) ** 0.5)
    ks = torch.zeros(m, dtype=torch.int32, device="cuda")
    ke = torch.arange(1, m + 1, dtype=torch.int32, device="cuda")
    op = torch.ops.fp8compile.mqa_logits
    want = op(*args, ks, ke, True, 0, "deep_gemm") if m == 4096 else None
    fns = {"deep_gemm": lambda: op(*args, ks, ke, False, 0, "deep_gemm"),
           "old_triton": lambda: tm_old.mqa_logits(*args, ks, ke, False, 0)}
    for cfg in CONFIGS:
        fns[f"new{cfg}"] = lambda c=cfg: triton_mqa.mqa_logits(*args, ks, ke, False, 0, tiles=c)
    for name, fn in fns.items():
        err = None
        try:
            if want is not None and name.startswith("new"):
                cfg = eval(name[3:])
                got = triton_mqa.mqa_logits(*args, ks, ke, True, 0, tiles=cfg)
                inside = want != float("-inf")
                err = dict(calc_diff=fp8compile.calc_diff(got[inside], want[inside]),
                           minus_inf_ok=bool((got[~inside] == float("-inf")).all()))
            us = harness.time_us([fn])
        except Exception as e:
            us, err = None, f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(dict(m=m, variant=name, us=us, check=err))
        print(m, name, us and round(us, 1), err, flush=True)
    dg = next(r["us"] for r in rows if r["m"] == m and r["variant"] == "deep_gemm")
    for r in rows:
        if r["m"] == m and r["us"] and dg:
            r["vs_deep_gemm"] = dg / r["us"]
    print({r["variant"]: round(r.get("vs_deep_gemm", 0), 3) for r in rows if r["m"] == m}, flush=True)
os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), f"mqa_sweep_h{HEADS}.json"), "w"), indent=1)
