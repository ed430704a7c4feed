"""fp8compile: a torch.compile backend that runs bfloat16 and float16 models in FP8.

    model = torch.compile(model, backend="fp8")
    model = torch.compile(model, backend=fp8compile.backend(e8m0=True, batch_invariant=True))
    print(fp8compile.explain(model, x))

Importing this package registers the torch.ops.fp8compile ops and sets
TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS=1 unless it is set (Inductor's compile
workers then launch our Triton kernels with less host time); once transformers' FP8 integration
is imported too, it has Dynamo trace an FP8 checkpoint's linears as one op (checkpoints.py), and
once compressed-tensors is, its compressor keeps no decompress hook on a model with nothing to
decompress (checkpoints.install_idle_hook_drop). It does not initialise CUDA or import any vendor
kernel library.
"""

from __future__ import annotations

from typing import Any

import torch

from . import ops, registry  # noqa: F401  (the ops, torch.ops.fp8compile.*, and their kernel table)
from . import checkpoints
from .calibrate import calibrate, load_scales, save_scales
from .backend import Fp8Backend, fp8_backend, last_report, static_launch_for_user_kernels
from .config import Fp8Config, make_config
from .lean_decode import LeanDecoder
from .numerics import calc_diff
from .release import restore as restore_bf16_weights
from .report import Report
from .weights import forget as drop_fp8_weights

__version__ = "0.1.0"

# Before any compile starts Inductor's compile workers, which read it once, when they start
# (backend.static_launch_for_user_kernels): set later, the workers are restarted.
static_launch_for_user_kernels()
# An FP8 checkpoint's linears as fp8compile::checkpoint_linear when Dynamo traces them, from
# when transformers' FP8 integration is imported (now, or later).
checkpoints.install_when_imported()


def backend(config: Fp8Config | dict | None = None, **options: Any) -> Fp8Backend:
    """A backend for torch.compile(model, backend=...), from a config and/or keyword options."""
    return Fp8Backend(config, **options)


def explain(
    model: torch.nn.Module, *example_args: Any, config: Fp8Config | dict | None = None, **options: Any
) -> Report:
    """Compile `model` with the fp8 backend, run it once on example_args (under no_grad), and
    return the report: what was rewritten (kind, module, shape, kernel per M range) and what
    was left unchanged and why. The model itself is not modified."""
    fp8 = Fp8Backend(config, **options)
    with torch.no_grad():
        torch.compile(model, backend=fp8)(*example_args)
    return fp8.report


__all__ = [
    "Fp8Backend",
    "Fp8Config",
    "LeanDecoder",
    "Report",
    "backend",
    "calc_diff",
    "calibrate",
    "drop_fp8_weights",
    "explain",
    "fp8_backend",
    "last_report",
    "load_scales",
    "make_config",
    "restore_bf16_weights",
    "save_scales",
]
