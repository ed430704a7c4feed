"""GPU diagnostics behind the MoE test bounds and the fused-MLP timing: prints calc_diff of each
fp8compile::moe backend against the reference op, and a kernel profile of the Llama-3-8B MLP,
fused vs unfused. Run on the device: source .whl/prelude.sh && python scripts/moe_diag.py"""
import sys

import torch

sys.path.insert(0, ".")
import fp8compile  # noqa: E402
from fp8compile import calc_diff  # noqa: E402
from fp8compile.ops import reference  # noqa: E402
from tests.test_gpu import moe_case  # noqa: E402

for backend in ("triton", "deep_gemm"):
    for tokens in (1, 7, 33, 128, 1000):
        for bias, act in ((False, "silu"), (True, "swigluoai")):
            case = moe_case(tokens, bias=bias)
            args = (*case[:5], None, *case[5:])
            out = torch.ops.fp8compile.moe(*args, backend=backend, activation=act)
            ref = torch.ops.fp8compile.moe(*args, backend="reference", activation=act)
            dense = reference.moe_dense(*case, activation=act)
            print(f"{backend:<10} T={tokens:<5} {act:<10} bias={bias!s:<5} vs reference {calc_diff(out, ref):.2e}"
                  f"  vs unquantized {calc_diff(out, dense):.2e}  reference vs unquantized {calc_diff(ref, dense):.2e}")

from fp8compile.demo import GatedMLP  # noqa: E402

with torch.no_grad():
    for m in (16, 4096):
        for fusions in ((), ("silu_mul",)):
            torch._dynamo.reset()
            mlp = GatedMLP(4096, 14336).cuda().to(torch.bfloat16)
            f = torch.compile(mlp, backend=fp8compile.backend(fusions=fusions))
            x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
            for _ in range(3):
                f(x)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    f(x)
                torch.cuda.synchronize()
            print(f"--- M={m} fusions={fusions}")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=70))
