"""The block recipe's quantization in pure PyTorch: the definitions every kernel is tested against
(the linears' and the experts' references, linear/reference.py and moe/reference.py, build on it).

Layouts (M tokens, N output features, K input features, G = K / 128 groups):
  x (M, K) bf16        -> x_fp8 (M, K) e4m3fn, x_scale (M, G) fp32, row-major
  w (N, K) bf16        -> w_fp8 (N, K) e4m3fn, w_scale (ceil(N/128), G) fp32
  out[m, n] = sum_g (x_fp8[m, g] . w_fp8[n, g]) * x_scale[m, g] * w_scale[n // 128, g]
A K of part of a group is zero columns up to whole groups, in the weight (quant_weight_block)
and in the activation (pad_k): a zero column adds nothing to a dot product, and the last group's
scale is that of its real columns (a partial group, as a partial last weight block along N).
"""

from __future__ import annotations

import torch

from ...numerics import BLOCK, FP8_DTYPE, FP8_MAX, ceil_div, scale_from_amax, whole_blocks


def check_k(k: int) -> None:
    if k % BLOCK:
        raise ValueError(
            f"K={k} is not a multiple of {BLOCK}: the block recipe scales K in groups of {BLOCK}"
        )


def quant_act_block(x: torch.Tensor, e8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-128-group quantization of x (M, K) -> (x_fp8 (M, K), x_scale (M, K/128))."""
    m, k = x.shape
    check_k(k)
    groups = x.float().reshape(m, k // BLOCK, BLOCK)
    scale = scale_from_amax(groups.abs().amax(dim=-1), e8m0) if m else groups.new_empty(0, k // BLOCK)
    x_fp8 = (groups / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x_fp8.reshape(m, k), scale


def pad_k(x: torch.Tensor, k: int) -> torch.Tensor:
    """x (..., K') with zero columns up to K >= K' (the K of a weight's FP8 copy)."""
    return x if x.shape[-1] == k else torch.nn.functional.pad(x, (0, k - x.shape[-1]))


def quant_weight_block(w: torch.Tensor, e8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128-block quantization of w (N, K) -> (w_fp8 (N, Kp), w_scale (ceil(N/128), Kp/128)),
    Kp = K in whole 128-wide groups.

    N need not be a multiple of 128: the last block row is padded with zeros for its amax. Nor
    need K: the copy has zero columns up to Kp (linear_block pads the activation alike).
    """
    n, k = w.shape
    nb, k = ceil_div(n, BLOCK), whole_blocks(k)
    padded = w.new_zeros(nb * BLOCK, k, dtype=torch.float32)
    padded[:n, : w.shape[1]] = w.float()
    blocks = padded.reshape(nb, BLOCK, k // BLOCK, BLOCK)
    scale = scale_from_amax(blocks.abs().amax(dim=(1, 3)), e8m0)
    w_fp8 = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return w_fp8.reshape(nb * BLOCK, k)[:n].contiguous(), scale


def dequant_weight_block(w_fp8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """fp32 weight that w_fp8 and its block scales stand for (for tests and error analysis)."""
    n, _ = w_fp8.shape
    full = w_scale.repeat_interleave(BLOCK, dim=0)[:n].repeat_interleave(BLOCK, dim=1)
    return w_fp8.float() * full


def dequant_act_block(x_fp8: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
    return x_fp8.float() * x_scale.repeat_interleave(BLOCK, dim=1)
