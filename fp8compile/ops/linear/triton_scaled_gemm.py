"""Large-M Triton GEMM of the scaled recipes ("tensor", "rowwise"; reference_scaled.py): the
registry's "triton" kernels of fp8compile::qlinear_scaled and gated_qlinear_scaled.

cuBLAS (torch._scaled_mm) serves these recipes above the decode sizes and comes first in the
default order; this kernel is the one that serves every M with one tiling, so it is what
batch_invariant=True runs in the rowwise recipe (and in tensor with static scales). The
activation is quantized per token by triton_quant_rows.py (row by row: a row's scale and bits
do not depend on the others), then each program computes one BLOCK_M x BLOCK_N tile, summing K
in BLOCK_K steps in a fixed order, and scales the fp32 accumulator once in the epilogue: one
scale spans all of K, so there is no per-group promotion as in the block recipe's kernel. Tiles
and order are fixed whatever M is, so row i of the output is the same for every batch.
On an H100 (2026-11-26 (acad3b3), BENCHMARKS.md "W8A8 recipes") it gives the reference's numbers
(the GPU tests; calc_diff 2.1e-7..2.5e-7 against the reference at K = 4096 and 14336), and at
M = 4096 it took 612 / 648 us with the quantization for N x K = 14336 x 4096 / 4096 x 14336,
where cuBLAS's GEMM alone took 357 / 366 us: about 0.6x cuBLAS, as expected of plain pointer
loads and untuned tiles. Its speed below 4096 rows was not measured (that probe's eager calls
were host-bound, since cut by the quantization's own Launcher).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..launch import Launcher
from .reference_scaled import check_recipe
from .triton_gemm import _interpreting, _tile_position
from ..quant.triton_quant_rows import quantize

# One tiling for every M (batch invariance). The block recipe's large-M kernel's tiles
# (triton_gemm.SMALL_TILE_CONFIG), not tuned for this kernel. The interpreter's 32x64x64: with
# 16x32x32 tests/test_recipes.py's batch-invariance test took 20 s, with these 11 s (2026-11-27;
# triton_gemm.INTERPRETER_CONFIG says why).
CONFIG = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
INTERPRETER_CONFIG = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=4)


@triton.jit
def _scaled_gemm_kernel(
    a_ptr,
    a_s_ptr,
    b_ptr,
    b_s_ptr,
    bias_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    A_ROWWISE: tl.constexpr,
    B_ROWWISE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """c = (a @ b.T) * a_s[m or ()] * b_s[n or ()] (+ bias), a (M, K) and b (N, K) e4m3fn."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_position(tl.program_id(0), num_m, num_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    safe_m = offs_m % M  # wrapped rows load real data and are never stored
    safe_n = offs_n % N
    a_rows = a_ptr + safe_m[:, None].to(tl.int64) * stride_am
    b_rows = b_ptr + safe_n[:, None].to(tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + offs_k
        in_k = cols[None, :] < K
        a = tl.load(a_rows + cols[None, :], mask=in_k, other=0.0)
        b = tl.load(b_rows + cols[None, :], mask=in_k, other=0.0)
        acc += tl.dot(a, tl.trans(b))
    if A_ROWWISE:
        acc = acc * tl.load(a_s_ptr + safe_m)[:, None]
    else:
        acc = acc * tl.load(a_s_ptr)
    if B_ROWWISE:
        acc = acc * tl.load(b_s_ptr + safe_n)[None, :]
    else:
        acc = acc * tl.load(b_s_ptr)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + safe_n).to(tl.float32)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


_launch = Launcher(_scaled_gemm_kernel)


def gemm_scaled_large_m(
    x_fp8: Tensor, x_scale: Tensor, w_fp8: Tensor, w_scale: Tensor, bias: Tensor | None, out_dtype
) -> Tensor:
    """x_fp8 (M, K) @ w_fp8 (N, K).T scaled per row of x (x_scale (M,)) or once (()), per row of
    w (N,) or once (()) (+ bias) -> (M, N) out_dtype: reference_scaled.gemm_scaled's product,
    summed in fp32."""
    m, k = x_fp8.shape
    n = w_fp8.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=x_fp8.device)
    if m == 0:
        return out
    cfg = dict(INTERPRETER_CONFIG if _interpreting(x_fp8) else CONFIG)
    options = {key: cfg.pop(key) for key in ("num_warps", "num_stages") if key in cfg}
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    args = (
        x_fp8,
        x_scale,
        w_fp8,
        w_scale,
        bias if bias is not None else w_scale,
        out,
        m,
        n,
        k,
        x_fp8.stride(0),
        w_fp8.stride(0),
        out.stride(0),
    )
    constexprs = dict(
        A_ROWWISE=x_scale.dim() == 1, B_ROWWISE=w_scale.dim() == 1, HAS_BIAS=bias is not None, **cfg
    )
    _launch(grid, args, constexprs, **options)
    return out


def _linear(x, b, act, w_fp8, w_scale, bias, recipe, x_scale, amax_ub, e8m0) -> Tensor:
    check_recipe(recipe)
    x2 = x.reshape(-1, x.shape[-1])
    b2 = None if b is None else b.reshape(x2.shape)
    x_fp8, sx = quantize(x2, b2, recipe, x_scale, amax_ub, e8m0, act, traced=False)
    out = gemm_scaled_large_m(x_fp8, sx.float(), w_fp8, w_scale, bias, x.dtype)
    return out.reshape(*x.shape[:-1], w_fp8.shape[0])


def linear_scaled_large_m(
    x: Tensor,
    w_fp8: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    recipe: str = "rowwise",
    x_scale: Tensor | None = None,
    amax_ub: float = 0.0,
    e8m0: bool = False,
    fast_accum: bool = False,
) -> Tensor:
    """fp8compile::qlinear_scaled's triton kernel: bf16 x (..., K) times w_fp8 (N, K) with w_scale
    () or (N,) (+ bias) -> bf16 (..., N). fast_accum is cuBLAS's option: this kernel sums K in
    fp32 between its BLOCK_K steps either way."""
    return _linear(x, None, ("silu", 1.702, 7.0), w_fp8, w_scale, bias, recipe, x_scale, amax_ub, e8m0)


def gated_linear_scaled_large_m(
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
    """fp8compile::gated_qlinear_scaled's triton kernel: linear_scaled_large_m of act(a, b)."""
    act = (activation, alpha, limit)
    return _linear(a, b, act, w_fp8, w_scale, bias, recipe, x_scale, amax_ub, e8m0)
