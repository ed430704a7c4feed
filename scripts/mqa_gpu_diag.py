"""Probe (issue 19): DeepSeek-V3.2 at the architecture matrix's small sizes on the GPU, compiled
with every pass, without the mqa_logits pass, with it alone (linears bf16), and with the reference
kernels: which part of the FP8 model moves its logits away from eager bf16."""

import torch

import fp8compile
import tests.test_mqa_logits as T
from fp8compile.config import FUSIONS
from fp8compile.numerics import calc_diff

torch.manual_seed(0)
model = T.deepseek_v32(topk=16)
ids = torch.randint(0, 200, (2, 64), device="cuda")
with torch.no_grad():
    want = model(ids, use_cache=False).logits
for name, opts in [
    ("all", {}),
    ("no_mqa", dict(fusions=tuple(f for f in FUSIONS if f != "mqa_logits"))),
    ("only_mqa", dict(fusions=("mqa_logits",), skip=("*",))),
    ("mqa_ref", dict(backends=("reference",))),
]:
    torch._dynamo.reset()
    be = fp8compile.backend(**opts)
    with torch.no_grad():
        got = torch.compile(model, backend=be, dynamic=True)(ids, use_cache=False).logits
    print(name, be.report.counts(), calc_diff(got.float(), want.float()), flush=True)
