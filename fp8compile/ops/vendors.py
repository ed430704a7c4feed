"""The optional kernel libraries (DeepGEMM, FlashInfer): whether each imports, what to install,
and DeepGEMM's runtime made at compile time. The adapters that call them live with their op
family (linear/vendors.py, moe/vendors.py, mqa_logits/vendors.py).

Nothing here is imported by `import fp8compile`; the registry imports this module when a
vendor backend is asked about, and the libraries themselves are imported on first use.
"""

from __future__ import annotations

import functools
import importlib

import torch


INSTALL = {
    "deep_gemm": "pip install 'fp8compile[deep_gemm]' (sgl-deep-gemm; 0.1.5.post1 loads on torch 2.11)",
    "flashinfer": "pip install 'fp8compile[flashinfer]' (flashinfer-python)",
}


@functools.cache
def import_error(module: str) -> str | None:
    """None if `module` imports, else why not (with what to install)."""
    try:
        importlib.import_module(module)
    except Exception as e:  # ImportError, or a library that fails while loading its kernels
        return f"cannot import {module} ({type(e).__name__}: {str(e)[:200]}); {INSTALL[module]}"
    return None


def require(module: str):
    why = import_error(module)
    if why is not None:
        raise RuntimeError(why)
    return importlib.import_module(module)


def prepare_deep_gemm(request) -> None:
    """registry hook, at compile time: DeepGEMM's device runtime, which allocates a tensor when
    the process first calls DeepGEMM, is created now (asking it the SM count creates it). Created
    in a CUDA graph's warm-up run instead, that tensor would stay in the graph's memory pool, live
    but owned by no graph, and Inductor's CUDA graphs refuse every later warm-up."""
    if request.device.type == "cuda":
        with torch.cuda.device(request.device):
            require("deep_gemm").get_num_sms()
