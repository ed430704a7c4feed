"""Host time of the routed-experts op's parts, outside CUDA graphs (default mode): each part is
called 50 times without a sync, so the loop's wall time is what the host spends enqueuing it
(the GPU's queue does not fill). Then cProfile of moe_gluon. Qwen3-30B-A3B widths, 2048 tokens."""
import cProfile
import io
import json
import os
import pstats
import time

import torch

from fp8compile.ops import gluon_gemm, reference
from fp8compile.ops import triton_moe as tm
from fp8compile.ops.triton_quant import quant_act

dev = "cuda"
E, TOP_K, H, INTER, T = 128, 8, 2048, 768, 2048


def quantized(e, n, k):
    parts = [reference.quant_weight_block(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02)
             for _ in range(e)]
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


w13, s13 = quantized(E, 2 * INTER, H)
w2, s2 = quantized(E, H, INTER)
x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
ids = torch.topk(torch.rand(T, E, device=dev), TOP_K, dim=-1).indices.to(torch.int32)
weights = torch.softmax(torch.randn(T, TOP_K, device=dev), -1)
s = ids.numel()
slots, block_expert = tm.route(ids, E, 64)
x_fp8, x_s = quant_act(x, False, "row")
a, a_s, rows = tm.gather_rows(x_fp8, x_s, slots, block_expert, s, TOP_K, 64)
c1 = gluon_gemm.grouped_gemm(a, a_s, w13, s13, block_expert)
h, h_s = quant_act(c1[:, :INTER], False, "row", b=c1[:, INTER:])
c2 = gluon_gemm.grouped_gemm(h, h_s, w2, s2, block_expert)
parts = {
    "route": lambda: tm.route(ids, E, 64),
    "quant": lambda: quant_act(x, False, "row"),
    "gather": lambda: tm.gather_rows(x_fp8, x_s, slots, block_expert, s, TOP_K, 64),
    "gemm1": lambda: gluon_gemm.grouped_gemm(a, a_s, w13, s13, block_expert),
    "act_quant": lambda: quant_act(c1[:, :INTER], False, "row", b=c1[:, INTER:]),
    "gemm2": lambda: gluon_gemm.grouped_gemm(h, h_s, w2, s2, block_expert),
    "topk_sum": lambda: tm.topk_sum(c2, ids, weights, E, rows=rows),
    "why_not_grouped": lambda: gluon_gemm.why_not_grouped(a, w13),
    "moe_gluon": lambda: tm.moe_gluon(x, ids, weights, w13, s13, w2, s2),
    "moe_triton_kernel_path": lambda: tm.moe_triton(x, ids, weights, w13, s13, w2, s2, batch_invariant=True),
}
out = {}
for name, fn in parts.items():
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        fn()
    host = (time.perf_counter() - t0) / 50 * 1e6
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 50 * 1e6
    out[name] = dict(host_us=host, wall_us=wall)
    print(name, out[name], flush=True)
prof = cProfile.Profile()
prof.enable()
for _ in range(20):
    tm.moe_gluon(x, ids, weights, w13, s13, w2, s2)
prof.disable()
torch.cuda.synchronize()
text = io.StringIO()
pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(30)
print(text.getvalue()[:6000])
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "moe_host_probe.json"), "w"), indent=1)
