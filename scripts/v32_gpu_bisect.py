"""Probe (issue 20): which part of the FP8 DeepSeek-V3.2 (architecture matrix's small sizes) moves
its logits away from eager bf16 on the GPU: Inductor bf16, then backend="fp8" with one backend
family, one fusion or one group of modules at a time. Writes $OUT/v32_bisect.json."""

import json
import os
import sys
import time

import torch

import fp8compile
import tests.test_mqa_logits as T
from fp8compile.config import FUSIONS
from fp8compile.numerics import calc_diff

arch = sys.argv[1] if len(sys.argv) > 1 else "deepseek_v32"
torch.manual_seed(0)
if arch == "deepseek_v32":
    model = T.deepseek_v32(topk=16)
else:
    from transformers import AutoModelForCausalLM

    from fp8compile import architectures

    config = architectures.small_config(arch)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
    model = model.to(T.DEVICE)
ids = torch.randint(0, 200, (2, 64), device=T.DEVICE)
with torch.no_grad():
    want = model(ids, use_cache=False).logits.float()

no = lambda f: tuple(x for x in FUSIONS if x != f)  # noqa: E731
variants = [
    ("inductor_bf16", None),
    ("fp8_all", {}),
    ("fp8_reference", dict(backends=("reference",))),
    ("fp8_linears_only", dict(fusions=())),
    ("fp8_triton", dict(backends=("triton_small_m", "triton", "reference"))),
    ("fp8_cublas", dict(backends=("cublas", "reference"))),
    ("fp8_deep_gemm", dict(backends=("deep_gemm", "reference"))),
    ("fp8_no_moe", dict(fusions=no("moe"))),
    ("fp8_no_qkv", dict(fusions=no("qkv"))),
    ("fp8_no_gate_up", dict(fusions=no("gate_up"))),
    ("fp8_skip_attn", dict(skip=("*self_attn*",))),
    ("fp8_skip_mlp", dict(skip=("*mlp*",))),
    ("fp8_skip_lm_head", dict(skip=("lm_head",))),
]
only = os.environ.get("ONLY")
out = {}
path = os.path.join(os.environ.get("OUT", "."), f"{arch}_bisect.json")
for name, opts in variants:
    if only and name not in only.split(","):
        continue
    torch._dynamo.reset()
    t0 = time.time()
    try:
        be = "inductor" if opts is None else fp8compile.backend(**opts)
        with torch.no_grad():
            got = torch.compile(model, backend=be, dynamic=True)(ids, use_cache=False).logits.float()
        row = {"calc_diff": calc_diff(got, want), "finite": bool(torch.isfinite(got).all())}
        if opts is not None:
            row["counts"] = be.report.counts()
            row["report"] = str(be.report)
    except Exception as e:  # noqa: BLE001
        row = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    row["s"] = round(time.time() - t0, 1)
    out[name] = row
    print(name, row, flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
