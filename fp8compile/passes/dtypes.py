"""The model dtypes the FP8 rewrites serve: 16-bit models, bfloat16 or float16. An FP8 GEMM does
not care what its activation was before quantization; its output is written in the model's own
dtype, so a float16 model stays a float16 model. A float32 model (often one loaded without
`torch_dtype`) asked for float32 precision: its sites stay float32, and the reason says how to
get FP8's speed."""

from __future__ import annotations

import torch

SERVED = (torch.bfloat16, torch.float16)


def name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def served(dtypes: set[torch.dtype], kinds: tuple[torch.dtype, ...] = SERVED) -> bool:
    """Whether a site's tensors are of one dtype, one of `kinds`."""
    return len(dtypes) == 1 and next(iter(dtypes)) in kinds


def why_not(dtypes: set[torch.dtype], what: str, kinds: tuple[torch.dtype, ...] = SERVED) -> str | None:
    """Why a site whose tensors (activation, weights, output) have these dtypes stays as it is,
    or None. what: the sites, plural ("linears", "experts"); kinds: the dtypes its kernels serve."""
    if served(dtypes, kinds):
        return None
    names = "/".join(sorted(map(name, dtypes)))
    named = " or ".join(map(name, kinds))
    if dtypes == {torch.float32}:
        return (
            f"dtype float32: {what} are rewritten in {named} models; "
            "model.to(torch.bfloat16) before compiling gives them FP8"
        )
    return f"dtype {names}: {what} are rewritten where all their tensors are {named}, one dtype"
