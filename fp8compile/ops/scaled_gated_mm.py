"""A gated MLP's down projection in the scaled recipes ("tensor", "rowwise") above the decode
sizes: act(a, b) quantized by a kernel of ours, then cuBLAS's tensorwise or rowwise FP8 GEMM
(torch._scaled_mm), as fp8compile::gated_linear_scaled_mm.

The plain linear on act(gate, up) (ops/scaled_cublas.py, traced) leaves the product, its
per-token amax and the cast to Inductor's fused reduction: on an H100 at M = 4096, K = 14336
(Llama-3-8B) it took 143.6 us, 2.04 TB/s of the bytes it must move (gate and up read, the FP8
product written). _quant_rows_kernel holds a whole row in registers instead (one program per
token, up to ONE_PASS_MAX columns): one read, the amax, the quantized row written. With 32 warps
it took 107.8 us there (2.72 TB/s), 72.3 against 76.9 at M = 2048, 200 against 217 at K = 18944
(Qwen2.5-7B) (BENCHMARKS.md, W8A8 recipes, "Forty-third session"; the probe is in git at
246828c). Wider rows take two passes over chunks, the second reading the row back (mostly from
L2). A static scale (or the tensor recipe's dynamic one, whose amax over all of x a reduction
before the launch finds) needs one pass over chunks.

The numbers are reference_scaled.gated_linear_scaled's: act(a, b) in fp32, never rounded to
bf16, quantized with the reference's scale. Like fp8compile::linear_scaled_mm (scaled_mm_op.py)
the op is a torch.library.triton_op: traced into the graph (passes/inline.py), its body is the
launch (wrap_triton) and an aten._scaled_mm node that Inductor's generated code calls.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from ..numerics import AMAX_EPS, FP8_DTYPE, FP8_MAX, next_pow2
from .reference import gated
from .reference_scaled import act_scale, check_recipe
from .triton_quant import activation_code, load_activation, round_up_pow2

# Rows up to this many columns are quantized from registers, in one pass (32 fp32 values per
# thread of 32 warps for each of a, b and the product).
ONE_PASS_MAX = 32768
CHUNK = 4096  # columns per step of the two-pass and given-scale loops


@triton.jit
def _scale_from(amax, eps, fp8_max, amax_ub, CAP: tl.constexpr, E8M0: tl.constexpr):
    """reference_scaled.act_scale's dynamic scale from an amax (capped at amax_ub if CAP)."""
    if CAP:
        amax = tl.minimum(amax, amax_ub)
    scale = tl.maximum(amax, eps) / fp8_max
    if E8M0:
        scale = round_up_pow2(scale)
    return scale


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
        scale = _scale_from(tl.max(tl.abs(h), axis=1), eps, fp8_max, amax_ub, CAP, E8M0)
        tl.store(s_ptr + rows, scale)
        q = tl.clamp(h / scale[:, None], -fp8_max, fp8_max).to(tl.float8e4nv)
        tl.store(q_row + offs[None, :], q, mask=in_k)
    else:
        if GIVEN:
            scale = tl.load(given_ptr + rows * 0)
        else:
            amax = tl.zeros((1, BLOCK_K), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
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
            scale = _scale_from(tl.max(amax, axis=1), eps, fp8_max, amax_ub, CAP, E8M0)
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
) -> tuple[Tensor, Tensor]:
    """act(a, b) (M, K) (a itself if b is None) -> (x_fp8 (M, K), scale): each row's own (M,)
    fp32, or `given` (one scale) as it is. Launched through wrap_triton: traced, Inductor makes
    the launch."""
    m, k = a.shape
    b_ = a if b is None else b
    x_fp8 = torch.empty(m, k, dtype=FP8_DTYPE, device=a.device)
    scale = torch.empty(m, dtype=torch.float32, device=a.device) if given is None else given
    constexprs, options = quant_rows_launch(k, given is not None)
    if a.device.type == "cpu":  # Triton's interpreter takes no launch options
        options = {}
    wrap_triton(_quant_rows_kernel)[(m,)](
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
        ACT=activation_code(b, activation),
        GIVEN=given is not None,
        CAP=given is None and amax_ub > 0,
        E8M0=e8m0,
        **constexprs,
        **options,
    )
    return x_fp8, scale


@triton_op("fp8compile::gated_linear_scaled_mm", mutates_args=())
def gated_linear_scaled_mm(
    a: Tensor,
    b: Tensor,
    w_fp8: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    x_scale: Tensor | None = None,
    recipe: str = "rowwise",
    amax_ub: float = 0.0,
    e8m0: bool = False,
    fast_accum: bool = False,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> Tensor:
    """act(a, b) for bf16 a, b (M, K) times w_fp8 (N, K) with w_scale () or (N,) (+ bias) -> bf16
    (M, N): x_scale a static scale, else dynamic (per token for rowwise, over act(a, b) for
    tensor), as reference_scaled.gated_linear_scaled; fast_accum: _scaled_mm's use_fast_accum."""
    check_recipe(recipe)
    torch._check(a.shape == b.shape, lambda: "act(a, b) needs a and b of one shape")
    m = a.shape[0]
    given = x_scale
    if given is None and recipe == "tensor":  # one amax over all rows: a reduction before the launch
        given = act_scale(gated(a, b, activation, alpha, limit), "tensor", e8m0, None, amax_ub)
    x_fp8, sx = quant_rows(a, b, given, amax_ub, e8m0, activation, alpha, limit)
    if recipe == "rowwise":  # (M, 1) and (1, N); a given scale is the same for every row
        sa = sx.reshape(-1, 1) if given is None else sx.reshape(1, 1).expand(m, 1).contiguous()
        sb = w_scale.reshape(1, -1)
    else:
        sa, sb = sx.reshape(()), w_scale.reshape(())
    out = torch._scaled_mm(
        x_fp8, w_fp8.t(), scale_a=sa, scale_b=sb, out_dtype=a.dtype, use_fast_accum=fast_accum
    )
    return out if bias is None else out + bias


def gated_linear_scaled_cublas(
    a: Tensor,
    b: Tensor,
    w_fp8: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    recipe: str = "rowwise",
    x_scale: Tensor | None = None,
    amax_ub: float = 0.0,
    e8m0: bool = False,
    fast_accum: bool = False,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> Tensor:
    """fp8compile::gated_qlinear_scaled's cublas kernel: gated_linear_scaled_mm over a, b (..., K)."""
    a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    n = w_fp8.shape[0]
    if a2.shape[0] == 0:
        return a.new_empty(*a.shape[:-1], n)
    out = gated_linear_scaled_mm(
        a2, b2, w_fp8, w_scale, bias, x_scale, recipe, amax_ub, e8m0, fast_accum, activation, alpha, limit
    )
    return out.reshape(*a.shape[:-1], n)
