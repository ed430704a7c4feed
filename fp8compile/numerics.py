"""FP8 numerics shared by every recipe and kernel: constants, scale rounding, calc_diff.

Pure math, no graph or kernel code. Shape letters used across the package:
M = tokens (rows of the activation), N = output features, K = input features (reduction).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
BLOCK = 128  # DeepSeek-V3 block recipe: activations 1x128 along K, weights 128x128
# UE8M0 scales as FP8 checkpoints store them (None on a torch without the dtype)
E8M0_DTYPE = getattr(torch, "float8_e8m0fnu", None)
# Floor for a group's amax before it becomes a scale: an all-zero group then quantizes to
# zeros with a finite scale instead of 0/0. DeepGEMM's reference quantizers use the same value.
AMAX_EPS = 1e-4


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def size_hint(size) -> int:
    """A size, or the example value of a symbolic one (1 where it has none: an unbacked size)."""
    if isinstance(size, torch.SymInt):
        return size.node.hint if size.node.has_hint() else 1
    return int(size)


def whole_blocks(size: int) -> int:
    """size rounded up to whole 128-wide blocks (a K or an expert intermediate size of part of a
    block is padded with zeros to this in the FP8 copies)."""
    return ceil_div(size, BLOCK) * BLOCK


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1). For host code on every launch: Triton's
    next_power_of_2 and cdiv are constexpr functions, 2.6 us a call against 0.04 for this."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def round_scale_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Round positive fp32 scales UP to the next power of two (UE8M0), exactly.

    frexp gives scale = mant * 2**exp with mant in [0.5, 1); a scale that is already a power
    of two has mant == 0.5 and stays, anything else becomes 2**exp. No log2/exp2, so the
    result is bit-exact on every device.
    """
    mant, exp = torch.frexp(scale)
    exp = exp - (mant == 0.5).to(exp.dtype)
    return torch.ldexp(torch.ones_like(scale), exp)


def scale_from_amax(amax: torch.Tensor, e8m0: bool) -> torch.Tensor:
    """fp32 scale such that amax / scale <= FP8_MAX (== for non-E8M0 scales)."""
    scale = amax.float().clamp(min=AMAX_EPS) / FP8_MAX
    return round_scale_e8m0(scale) if e8m0 else scale


def is_power_of_two(t: torch.Tensor) -> bool:
    """True when every element is an exact, positive power of two."""
    mant, _ = torch.frexp(t.float())
    return bool((mant == 0.5).all())


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's accuracy metric: 1 - 2*sum(x*y) / sum(x*x + y*y), in float64.

    0 for identical tensors, about 7e-4 for one block-FP8 GEMM on unit-normal data against
    the fp32 product; scale-sensitive (unlike cosine similarity), NaN if either input has NaN.
    """
    if x.shape != y.shape:
        raise ValueError(f"calc_diff needs equal shapes, got {tuple(x.shape)} and {tuple(y.shape)}")
    x, y = x.detach().double(), y.detach().double()
    denominator = (x * x + y * y).sum()
    if denominator == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denominator)
