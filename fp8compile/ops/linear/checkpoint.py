"""The linear of an FP8 checkpoint as transformers loads it (its `FP8Linear`, from
`FineGrainedFP8Config`), as one op a traced graph can hold: fp8compile::checkpoint_linear.

transformers' own forward (integrations/finegrained_fp8.py, `fp8_linear`) picks DeepGEMM or a
Triton kernel it loads from the Hub at its first call; Dynamo cannot trace that choice, and where
neither loads (the CPU, a machine offline) tracing it fails. fp8compile/checkpoints.py has Dynamo
trace this op in its place. Its kernel is transformers' own function, called as the model would
call it, so a graph that keeps the op (a site no pass took, another backend's graph) computes
what the eager model computes; passes/checkpoint_linear.py rewrites the sites it can serve onto
fp8compile's FP8 linear, on the checkpoint's own weights and scales. `reference` is what
transformers' kernels compute, in PyTorch: the definition the rewritten sites are tested against
(tests/test_checkpoints.py), where those kernels do not load.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...numerics import BLOCK, E8M0_DTYPE, FP8_DTYPE, FP8_MAX
from ..library import fake, op
from . import reference as linear_reference


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


def reference(
    input: Tensor,
    weight: Tensor,
    weight_scale_inv: Tensor,
    block_size: list[int] | None = None,
    bias: Tensor | None = None,
    activation_scale: Tensor | None = None,
) -> Tensor:
    """transformers' fp8_linear in PyTorch. The weight dequantized by its (bn, bk) blocks' scales
    (one scale for the whole weight without block_size); the activation quantized per token in
    groups of bk along K (dynamic) or with the one static activation_scale; products in fp32,
    written in input's dtype. 128x128 blocks with dynamic scales are the block recipe itself:
    fp8compile's reference linear (its e8m0 form for UE8M0 scales)."""
    bn, bk = block_size or weight.shape
    if (bn, bk) == (BLOCK, BLOCK) and activation_scale is None:
        e8m0 = weight_scale_inv.dtype == E8M0_DTYPE
        return linear_reference.linear_block(input, weight, weight_scale_inv.float(), bias, e8m0)
    return dequantized_reference(input, weight, weight_scale_inv, (bn, bk), bias, activation_scale)


def dequantized_reference(
    input: Tensor,
    weight: Tensor,
    weight_scale_inv: Tensor,
    block: tuple[int, int],
    bias: Tensor | None = None,
    activation_scale: Tensor | None = None,
) -> Tensor:
    """reference for any block size: both operands quantized, dequantized, one fp32 product."""
    bn, bk = block
    scale = weight_scale_inv.float().reshape(-1, weight_scale_inv.shape[-1] if weight_scale_inv.dim() else 1)
    scale = scale.repeat_interleave(bn, 0)[: weight.shape[0]].repeat_interleave(bk, 1)[:, : weight.shape[1]]
    x = input.float()
    if activation_scale is not None:
        x_scale = activation_scale.float()
        x = (x / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * x_scale
    else:
        groups = x.unflatten(-1, (-1, bk))
        x_scale = groups.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
        x = ((groups / x_scale).to(FP8_DTYPE).float() * x_scale).flatten(-2)
    out = torch.nn.functional.linear(x, weight.float() * scale, None if bias is None else bias.float())
    return out.to(input.dtype)
