"""Triton per-token-group activation quantization (1x128, fp32 scales), twin of
reference.quant_act_block, bit-exact with it on the GPU; optionally of a gated MLP's act(a, b),
computed in fp32 in the same pass (twin of reference.gated + quantization).

Scale layouts:
  "row"      (M, G) row-major: the fp8compile::quant_act contract.
  "mn_major" (M, G) with strides (1, align(M, 4)): column-major, each column 16-byte (TMA)
             aligned; what DeepGEMM reads without a transpose.
  "col"      (M, G) with strides (1, M): column-major, unpadded; what torch._scaled_mm's
             1x128 block scaling accepts (it rejects padded columns).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...numerics import AMAX_EPS, BLOCK, FP8_DTYPE, FP8_MAX, ceil_div, next_pow2
from ..launch import Launcher

TMA_ALIGN = 4  # fp32 elements per 16 bytes: the alignment TMA and cuBLAS want of a scale column
QUANT_ROWS = 16


@triton.jit
def round_up_pow2(scale):
    """Smallest power of two >= scale, for positive normal fp32: bump the exponent if any
    mantissa bit is set, then clear the mantissa. Bit-exact twin of numerics.round_scale_e8m0."""
    bits = scale.to(tl.int32, bitcast=True)
    bits = tl.where((bits & 0x7FFFFF) != 0, bits + 0x800000, bits) & 0x7F800000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def quant_group(x, eps, fp8_max, E8M0: tl.constexpr):
    """x (R, 128) fp32 -> (x_fp8 (R, 128), scale (R,)) for one 128-wide group per row."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), eps) / fp8_max
    if E8M0:
        scale = round_up_pow2(scale)
    x_fp8 = tl.clamp(x / scale[:, None], -fp8_max, fp8_max).to(tl.float8e4nv)
    return x_fp8, scale


# Prologue of the quantization: 0 = x itself, else a gated MLP's act(x, b) (reference.gated) or
# a non-gated one's act(x) (reference.unary).
ACT_CODES = {"silu": 1, "swigluoai": 2, "silu_limit": 3, "gelu_tanh": 5}  # reference.gated's activations
UNARY_CODES = {"relu2": 4}  # reference.unary's


@triton.jit
def load_activation(
    x_ptr,
    b_ptr,
    rows,
    cols,
    stride_xm,
    stride_xk,
    stride_bm,
    stride_bk,
    mask,
    alpha,
    limit,
    ACT: tl.constexpr,
):
    """The fp32 (rows, cols) tile to quantize: x itself, act(x, b) of a gated MLP or act(x) of a
    non-gated one, never rounded to bf16. Masked rows load zeros, so they quantize to zeros.
    Strided last dims serve interleaved gate/up halves (gate_up[..., ::2]) without a copy."""
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0).to(
        tl.float32
    )
    if ACT == 4:
        x = tl.maximum(x, 0.0)
        x = x * x
    elif ACT != 0:
        b = tl.load(b_ptr + rows[:, None] * stride_bm + cols[None, :] * stride_bk, mask=mask, other=0.0).to(
            tl.float32
        )
        if ACT == 1:
            x = x * tl.sigmoid(x) * b
        elif ACT == 2:
            x = tl.minimum(x, limit)
            x = x * tl.sigmoid(x * alpha) * (tl.clamp(b, -limit, limit) + 1.0)
        elif ACT == 5:
            # gelu's tanh form, 0.5 x (1 + tanh(z)) with z = sqrt(2 / pi) (x + 0.044715 x^3), is
            # x sigmoid(2 z): the same function, one sigmoid instead of a tanh
            z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
            x = x * tl.sigmoid(2.0 * z) * b
        else:
            x = tl.minimum(x, limit)
            x = x * tl.sigmoid(x) * tl.clamp(b, -limit, limit)
    return x


@triton.jit
def _quant_act_kernel(
    x_ptr,
    b_ptr,
    q_ptr,
    s_ptr,
    M,
    M_OUT,
    stride_xm,
    stride_xk,
    stride_bm,
    stride_bk,
    stride_qm,
    stride_sm,
    stride_sg,
    eps,
    fp8_max,
    alpha,
    limit,
    E8M0: tl.constexpr,
    ACT: tl.constexpr,
    ROWS: tl.constexpr,
    GROUP: tl.constexpr,
):
    """Rows < M quantized from x; rows M..M_OUT - 1 written as quantized zeros (padding a GEMM
    needs, without a padded copy of x)."""
    # Float arguments in fp32 whatever the launcher typed them as (Inductor passes Python floats
    # as fp64, and fp64 has no conversion to FP8: its compile fails in ConvertTritonGPUToLLVM).
    eps, fp8_max = tl.cast(eps, tl.float32), tl.cast(fp8_max, tl.float32)
    alpha, limit = tl.cast(alpha, tl.float32), tl.cast(limit, tl.float32)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    x = load_activation(
        x_ptr,
        b_ptr,
        rows,
        cols,
        stride_xm,
        stride_xk,
        stride_bm,
        stride_bk,
        rows[:, None] < M,
        alpha,
        limit,
        ACT,
    )
    x_fp8, scale = quant_group(x, eps, fp8_max, E8M0)
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], x_fp8, mask=rows[:, None] < M_OUT)
    tl.store(s_ptr + rows * stride_sm + g * stride_sg, scale, mask=rows < M_OUT)


_quant_act_launch = Launcher(_quant_act_kernel)


def empty_scales(m: int, groups: int, layout: str, device) -> torch.Tensor:
    if layout == "row":
        return torch.empty(m, groups, dtype=torch.float32, device=device)
    if layout in ("mn_major", "col"):
        m_aligned = ceil_div(max(m, 1), TMA_ALIGN) * TMA_ALIGN if layout == "mn_major" else m
        return torch.empty(groups, m_aligned, dtype=torch.float32, device=device).t()[:m]
    raise ValueError(f"scale layout {layout!r}: valid layouts are 'row', 'mn_major' and 'col'")


def activation_code(b: torch.Tensor | None, activation: str) -> int:
    """The kernel's ACT: with b a gated activation's code; without, a non-gated activation's, or
    0 (x itself) for any other name (a gated block's own input quantization passes its name)."""
    if b is None:
        return UNARY_CODES.get(activation, 0)
    if activation not in ACT_CODES:
        raise ValueError(f"activation {activation!r}: valid gated activations are {', '.join(ACT_CODES)}")
    return ACT_CODES[activation]


def quant_act(
    x: torch.Tensor,
    e8m0: bool = False,
    layout: str = "row",
    b: torch.Tensor | None = None,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    rows_multiple: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) bf16 (or fp32), K a multiple of 128 -> (x_fp8 (M', K), x_scale (M', K/128)),
    M' = M rounded up to a multiple of rows_multiple, the rows past M quantized zeros.

    With b (M, K): quantizes the gated activation act(x, b) instead (reference.gated); without b
    and with a non-gated activation, act(x) (reference.unary); computed in fp32 in the same pass."""
    m, k = x.shape
    if k % BLOCK:
        raise ValueError(f"K={k} is not a multiple of {BLOCK}")
    m_out = ceil_div(m, rows_multiple) * rows_multiple
    x_fp8 = torch.empty(m_out, k, dtype=FP8_DTYPE, device=x.device)
    scale = empty_scales(m_out, k // BLOCK, layout, x.device)
    if m_out:
        # 16 rows x 128 per program. With 4-row tiles the compiled linear took 41 us more than
        # cuBLAS alone at M=4096, K=7168 on an H200 (88 MB moved: ~2.2 TB/s); with 16 rows, 25 us
        # (`bench gemm` runs of 2026-11-21, BENCHMARKS.md).
        rows = min(QUANT_ROWS, next_pow2(m_out))
        grid, args, constexprs = quant_act_arguments(x, b, x_fp8, scale, e8m0, activation, alpha, limit, rows)
        _quant_act_launch(grid, args, constexprs, num_warps=4)
    return x_fp8, scale


def quant_act_arguments(x, b, x_fp8, scale, e8m0, activation, alpha, limit, rows=QUANT_ROWS):
    """(grid, args, constexprs) of _quant_act_kernel quantizing x (M, K) (or act(x, b)) into
    x_fp8 (M', K) and scale (M', K/128), M' >= M rows (the rows past M quantized zeros), `rows`
    rows per program. The one place the kernel's arguments are laid out: quant_act launches
    them through our Launcher (_quant_act_launch), ops/linear/scaled_mm_op.py through
    wrap_triton for Inductor."""
    m, k = x.shape
    m_out = x_fp8.shape[0]
    b_ = x if b is None else b
    grid = ((m_out + rows - 1) // rows, k // BLOCK)  # SymInt-safe: no branch on a traced M
    args = (
        x,
        b_,
        x_fp8,
        scale,
        m,
        m_out,
        x.stride(0),
        x.stride(1),
        b_.stride(0),
        b_.stride(1),
        x_fp8.stride(0),
        scale.stride(0),
        scale.stride(1),
        AMAX_EPS,
        FP8_MAX,
        float(alpha),
        float(limit),
    )
    return grid, args, dict(E8M0=e8m0, ACT=activation_code(b, activation), ROWS=rows, GROUP=BLOCK)


def quant_act_row(x: torch.Tensor, e8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8compile::quant_act contract (row-major scales), for the registry."""
    return quant_act(x, e8m0, "row")
