"""A CPU-only torch comes without Triton: every pass still rewrites, on the reference kernels."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_linear_a_gated_mlp_and_a_qwen3_moe_block_are_rewritten_where_triton_cannot_be_imported():
    # In its own process: `import triton` raises there, as on a CPU-only install. The MoE pass's
    # decisions about the GPU's traced launches once imported the Triton kernels' module to read
    # their tile limits, and every MoE block stayed bf16 ("moe pass failed ... No module named
    # 'triton'").
    script = textwrap.dedent("""
        import json, sys
        sys.modules["triton"] = None  # `import triton` raises ImportError from here on
        import torch, fp8compile
        from tests.conftest import GATED_MLP, ONE_GEMM
        from tests.models import GatedMLP
        from tests.test_moe import MOE_BLOCK, qwen3_moe_block

        BF16 = torch.bfloat16
        torch.manual_seed(0)
        rows = {}
        for name, model in [
            ("linear", torch.nn.Linear(256, 384).to(BF16)),
            ("gated_mlp", GatedMLP(256, 512).to(BF16)),
            ("qwen3_moe", qwen3_moe_block("grouped_mm")),
        ]:
            fp8 = fp8compile.backend()
            x = torch.randn(2, 5, 256).to(BF16)
            torch._dynamo.mark_dynamic(x, 1)
            with torch.no_grad():
                out, ref = torch.compile(model, backend=fp8)(x), model(x)
            rows[name] = dict(
                counts=fp8.report.counts(),
                calc_diff=fp8compile.calc_diff(out, ref),
                errors=[s.reason for s in fp8.report.skips if "pass error" in s.reason],
                bounds=dict(ONE_GEMM=ONE_GEMM, GATED_MLP=GATED_MLP, MOE_BLOCK=MOE_BLOCK),
            )
            torch._dynamo.reset()
        rows["triton_loaded"] = sys.modules.get("triton") is not None
        print(json.dumps(rows))
    """)
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.splitlines()[-1])
    assert rows.pop("triton_loaded") is False
    bounds = rows["linear"]["bounds"]
    linear, mlp, moe = rows["linear"], rows["gated_mlp"], rows["qwen3_moe"]
    assert [row["errors"] for row in rows.values()] == [[], [], []]
    assert linear["counts"]["linear"] == 1 and linear["calc_diff"] < bounds["ONE_GEMM"]
    assert (mlp["counts"]["linear"], mlp["counts"]["silu_mul"]) == (2, 1)
    assert mlp["calc_diff"] < bounds["GATED_MLP"]
    assert moe["counts"]["moe"] == 1 and moe["calc_diff"] < bounds["MOE_BLOCK"]  # tests/test_moe.py's
