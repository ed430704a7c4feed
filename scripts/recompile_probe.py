"""Probe (one session): which guards recompile the default-mode Qwen3-MoE test model across the
test's token counts (run with TORCH_LOGS=recompiles)."""
import os  # noqa: F401

import torch

from tests.conftest import CountingBackend
from tests.test_gpu_models import MS, ids_for, qwen3_moe

model = qwen3_moe()
backend = CountingBackend()
compiled = torch.compile(model, backend=backend, dynamic=True)
import os
with torch.no_grad():
    for m in [int(v) for v in os.environ["MS"].split()] if "MS" in os.environ else MS:
        compiled(ids_for(m), use_cache=False)
        print(f"M={m}: {backend.compiles} compiles", flush=True)
