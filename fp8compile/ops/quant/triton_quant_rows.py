"""The scaled recipes' activation quantization in Triton: each token of x, or of a gated MLP's
act(x, b) (reference.gated, fp32, never rounded to bf16), quantized to e4m3fn with its own scale
from its amax (the rowwise recipe's dynamic scale, reference_scaled.act_scale: capped at
amax_ub, E8M0 if asked) or with one given scale (static, or the tensor recipe's dynamic scale
found before the launch). One program per token, so a row's bits never depend on the others.

Rows up to ONE_PASS_MAX columns are held in registers: one read, the amax, the quantized row
written. On an H100 at M = 4096, K = 14336 (Llama-3-8B's down projection input) that took 107.8
us (2.72 TB/s of the bytes that must move: gate and up read, the FP8 product written) against
143.6 us for Inductor's fused act / amax / cast (2.04 TB/s); 72.3 against 76.9 at M = 2048, 200
against 217 at K = 18944 (Qwen2.5-7B) (BENCHMARKS.md, W8A8 recipes, "2026-11-26 (acad3b3)"; the
probe is in git at 246828c). Wider rows take two passes over chunks, the second reading the row
back (mostly from L2); a given scale needs one pass over chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from ...numerics import AMAX_EPS, FP8_DTYPE, FP8_MAX, next_pow2
from ..launch import Launcher
from ..activations import gated
from ..linear.reference_scaled import act_scale
from .triton_quant import activation_code, load_activation, round_up_pow2

# Rows up to this many columns are quantized from registers, in one pass (32 fp32 values per
# thread of 32 warps for each of a, b and the product).
ONE_PASS_MAX = 32768
CHUNK = 4096  # columns per step of the two-pass and given-scale loops


@triton.jit
def scale_from(amax, eps, fp8_max, amax_ub, CAP: tl.constexpr, E8M0: tl.constexpr):
    """reference_scaled.act_scale's dynamic scale from an amax (capped at amax_ub if CAP)."""
    if CAP:
        amax = tl.minimum(amax, amax_ub)
    scale = tl.maximum(amax, eps) / fp8_max
    if E8M0:
        scale = round_up_pow2(scale)
    return scale


@triton.jit
def act_row_amax(
    x_ptr,
    b_ptr,
    rows,
    K,
    stride_xm,
    stride_xk,
    stride_bm,
    stride_bk,
    alpha,
    limit,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """max |act(x, b)| (load_activation) over row `rows` (a (1,) index), BLOCK columns per load: (1,) fp32."""
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros((1, BLOCK), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        cols = k0 + offs
        h = load_activation(
            x_ptr,
            b_ptr,
            rows,
            cols,
            stride_xm,
            stride_xk,
            stride_bm,
            stride_bk,
            cols[None, :] < K,
            alpha,
            limit,
            ACT,
        )
        amax = tl.maximum(amax, tl.abs(h))
    return tl.max(amax, axis=1)


@triton.jit
def _quant_rows_kernel(
    x_ptr,
    b_ptr,
    q_ptr,
    s_ptr,
    given_ptr,
    K,
    stride_xm,
    stride_xk,
    stride_bm,
    stride_bk,
    stride_qm,
    eps,
    fp8_max,
    amax_ub,
    alpha,
    limit,
    ACT: tl.constexpr,
    GIVEN: tl.constexpr,
    CAP: tl.constexpr,
    E8M0: tl.constexpr,
    ONE_PASS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Row m of act(x, b) (load_activation) quantized to q[m] with scale s[m] (its amax), or with
    the one scale at given_ptr if GIVEN (s not written). ONE_PASS: BLOCK_K covers the row."""
    # Float arguments in fp32 whatever the launcher typed them as (Inductor passes Python floats as fp64).
    eps, fp8_max, amax_ub = (
        tl.cast(eps, tl.float32),
        tl.cast(fp8_max, tl.float32),
        tl.cast(amax_ub, tl.float32),
    )
    alpha, limit = tl.cast(alpha, tl.float32), tl.cast(limit, tl.float32)
    rows = (tl.program_id(0) + tl.arange(0, 1)).to(tl.int64)  # 64-bit offsets: M * K may pass 2**31
    offs = tl.arange(0, BLOCK_K)
    q_row = q_ptr + rows[:, None] * stride_qm
    if ONE_PASS:
        in_k = offs[None, :] < K
        h = load_activation(
            x_ptr, b_ptr, rows, offs, stride_xm, stride_xk, stride_bm, stride_bk, in_k, alpha, limit, ACT
        )
        scale = scale_from(tl.max(tl.abs(h), axis=1), eps, fp8_max, amax_ub, CAP, E8M0)
        tl.store(s_ptr + rows, scale)
        q = tl.clamp(h / scale[:, None], -fp8_max, fp8_max).to(tl.float8e4nv)
        tl.store(q_row + offs[None, :], q, mask=in_k)
    else:
        if GIVEN:
            scale = tl.load(given_ptr + rows * 0)
        else:
            amax = act_row_amax(
                x_ptr, b_ptr, rows, K, stride_xm, stride_xk, stride_bm, stride_bk, alpha, limit, ACT, BLOCK_K
            )
            scale = scale_from(amax, eps, fp8_max, amax_ub, CAP, E8M0)
            tl.store(s_ptr + rows, scale)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + offs
            in_k = cols[None, :] < K
            h = load_activation(
                x_ptr, b_ptr, rows, cols, stride_xm, stride_xk, stride_bm, stride_bk, in_k, alpha, limit, ACT
            )
            q = tl.clamp(h / scale[:, None], -fp8_max, fp8_max).to(tl.float8e4nv)
            tl.store(q_row + cols[None, :], q, mask=in_k)


def quant_rows_launch(k: int, given: bool) -> tuple[dict, dict]:
    """(constexprs ONE_PASS and BLOCK_K, launch options) for rows of k columns: one pass over a
    register-held row where it fits and no scale is given, else CHUNK-wide steps."""
    if not given and next_pow2(k) <= ONE_PASS_MAX:
        block = next_pow2(k)
        return dict(ONE_PASS=True, BLOCK_K=block), dict(num_warps=min(32, max(4, block // 512)))
    return dict(ONE_PASS=False, BLOCK_K=CHUNK), dict(num_warps=8)


def quant_rows(
    a: Tensor,
    b: Tensor | None,
    given: Tensor | None,
    amax_ub: float,
    e8m0: bool,
    activation: str,
    alpha: float,
    limit: float,
    traced: bool = True,
) -> tuple[Tensor, Tensor]:
    """act(a, b) (M, K) (a itself if b is None) -> (x_fp8 (M, K), scale): each row's own (M,)
    fp32, or `given` (one scale) as it is. traced: launched through wrap_triton (in a
    triton_op's body: traced, Inductor makes the launch), else through our Launcher (an eager
    kernel's call, where every launch pays its host cost)."""
    m, k = a.shape
    b_ = a if b is None else b
    x_fp8 = torch.empty(m, k, dtype=FP8_DTYPE, device=a.device)
    scale = torch.empty(m, dtype=torch.float32, device=a.device) if given is None else given
    constexprs, options = quant_rows_launch(k, given is not None)
    if a.device.type == "cpu":  # Triton's interpreter takes no launch options
        options = {}
    args = (
        a,
        b_,
        x_fp8,
        scale,
        scale,
        k,
        a.stride(0),
        a.stride(1),
        b_.stride(0),
        b_.stride(1),
        x_fp8.stride(0),
        AMAX_EPS,
        FP8_MAX,
        float(amax_ub),
        float(alpha),
        float(limit),
    )
    constexprs.update(
        ACT=activation_code(b, activation),
        GIVEN=given is not None,
        CAP=given is None and amax_ub > 0,
        E8M0=e8m0,
    )
    if traced:
        wrap_triton(_quant_rows_kernel)[(m,)](*args, **constexprs, **options)
    else:
        _launch((m,), args, constexprs, **options)
    return x_fp8, scale


_launch = Launcher(_quant_rows_kernel)


def quantize(
    x: Tensor,
    b: Tensor | None,
    recipe: str,
    x_scale: Tensor | None,
    amax_ub: float,
    e8m0: bool,
    act: tuple = ("silu", 1.702, 7.0),
    traced: bool = True,
) -> tuple[Tensor, Tensor]:
    """x (M, K), or act(x, b) with act = (activation, alpha, limit), quantized as the recipe
    says (reference_scaled.quant_act_scaled of it): (x_fp8 (M, K), scale): (M,) per token for a
    dynamic rowwise scale, else the one scale (x_scale, or the tensor recipe's dynamic scale,
    from an amax reduction before the launch)."""
    given = x_scale
    if given is None and recipe == "tensor":  # one amax over all rows
        h = x if b is None else gated(x, b, *act)
        given = act_scale(h, "tensor", e8m0, None, amax_ub)
    return quant_rows(x, b, given, amax_ub, e8m0, *act, traced)
