"""The linear of an FP8 checkpoint as transformers loads it (its `FP8Linear`, from
`FineGrainedFP8Config`), as one op a traced graph can hold: fp8compile::checkpoint_linear.

transformers' own forward (integrations/finegrained_fp8.py, `fp8_linear`) picks DeepGEMM or a
Triton kernel it loads from the Hub at its first call; Dynamo cannot trace that choice, and where
neither loads (the CPU, a machine offline) tracing it fails. fp8compile/checkpoints.py has Dynamo
trace this op in its place. Its kernel is transformers' own function, called as the model would
call it, so a graph that keeps the op (a site no pass took, another backend's graph) computes
what the eager model computes; passes/checkpoint_linear.py rewrites the sites it can serve onto
fp8compile's FP8 linear, on the checkpoint's own weights and scales.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..library import fake, op


@op
def checkpoint_linear(
    x: Tensor,
    weight: Tensor,
    weight_scale_inv: Tensor,
    bias: Tensor | None = None,
    activation_scale: Tensor | None = None,
    block_size: list[int] | None = None,
    allow_deepgemm: bool = True,
) -> Tensor:
    """transformers' fp8_linear(x, weight, weight_scale_inv, block_size, bias, activation_scale):
    x (..., K) times the FP8 weight (N, K) -> (..., N) in x's dtype."""
    from transformers.integrations import finegrained_fp8

    return finegrained_fp8.fp8_linear(
        x, weight, weight_scale_inv, block_size, bias, activation_scale, allow_deepgemm
    )


@fake(checkpoint_linear)
def _(x, weight, weight_scale_inv, bias=None, activation_scale=None, block_size=None, allow_deepgemm=True):
    torch._check(
        x.shape[-1] == weight.shape[-1],
        lambda: f"x has K={x.shape[-1]} but the FP8 weight has K={weight.shape[-1]}",
    )
    return x.new_empty(*x.shape[:-1], weight.shape[0])
