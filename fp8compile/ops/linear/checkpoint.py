"""The linear of an FP8 checkpoint as transformers loads it (its `FP8Linear`, from
`FineGrainedFP8Config`), as one op a traced graph can hold: fp8compile::checkpoint_linear; and a
compressed-tensors FP8 checkpoint's (`CompressedTensorsFP8Linear`, per-channel weight scales,
per-token activations) as its two steps, fp8compile::checkpoint_quant_rows and
fp8compile::checkpoint_scaled_mm_rowwise.

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


@op
def checkpoint_quant_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """transformers' quantize_fp8_per_row (a compressed-tensors FP8 linear's activation): x (M, K)
    -> (e4m3fn (M, K), its fp32 scale a row (M,))."""
    from transformers.integrations import compressed_tensors

    x_fp8, scale = compressed_tensors.quantize_fp8_per_row(x)
    return x_fp8, scale.float()


@fake(checkpoint_quant_rows)
def _(x):
    return x.new_empty(x.shape, dtype=FP8_DTYPE), x.new_empty(x.shape[:-1], dtype=torch.float32)


@op
def checkpoint_scaled_mm_rowwise(
    x_fp8: Tensor,
    weight_t: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    out_dtype: torch.dtype,
    bias: Tensor | None = None,
) -> Tensor:
    """transformers' _scaled_mm_rowwise (a compressed-tensors FP8 linear's matmul): x_fp8 (M, K)
    times weight_t (K, N), the FP8 weight transposed, with scales (M, 1) and (1, N) (+ bias)
    -> (M, N) in out_dtype."""
    from transformers.integrations import compressed_tensors

    return compressed_tensors._scaled_mm_rowwise(x_fp8, weight_t, scale_a, scale_b, out_dtype, bias)


@fake(checkpoint_scaled_mm_rowwise)
def _(x_fp8, weight_t, scale_a, scale_b, out_dtype, bias=None):
    torch._check(
        x_fp8.shape[-1] == weight_t.shape[0],
        lambda: f"x has K={x_fp8.shape[-1]} but the FP8 weight has K={weight_t.shape[0]}",
    )
    return x_fp8.new_empty(x_fp8.shape[0], weight_t.shape[1], dtype=out_dtype)


def scaled_mm_reference(
    input: Tensor,
    weight: Tensor,
    scale_a: Tensor,
    scale_recipe_a=None,
    scale_b: Tensor | None = None,
    scale_recipe_b=None,
    bias: Tensor | None = None,
    output_dtype: torch.dtype = torch.bfloat16,
    **_,
) -> Tensor:
    """torch.nn.functional.scaled_mm with rowwise scales in PyTorch (it has no CPU kernel): FP8
    input (M, K) and weight (K, N), scales (M, 1) and (1, N), one fp32 product."""
    out = (input.float() * scale_a) @ (weight.float() * scale_b)
    return (out if bias is None else out + bias.float()).to(output_dtype)
