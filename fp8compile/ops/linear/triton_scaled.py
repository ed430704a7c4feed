"""Decode kernel of the scaled recipes ("tensor", "rowwise"; reference_scaled.py), M <= 64.

Decode streams the FP8 weight once; what a recipe adds on top is its activation quantization
and its scale arithmetic. One scale spans all of K here, so the kernel quantizes x itself
(in one launch with the GEMM, as the block recipe's decode kernel does) and scales the
accumulator once, in the epilogue, instead of once per 128-wide group. A dynamic scale needs
each token's amax over all of K before any of it is quantized: a small launch before the GEMM
writes it (row_amax, one program per row), or, traced, Inductor's reduction. (Read by every
GEMM program in a prologue over K instead, it measured 2.4x the block recipe's time at K =
14336 on an H100: a loop of dependent loads.) Then each program streams its weight tile over
its part of K: swapAB (the weight tile is the MMA's M side, the tokens its N side), split-K over the SMs
with fp32 partials that the last program to arrive at an N tile sums in split order
(deterministic): triton_gemm.store_split_k, the block recipe's decode kernel's epilogue.

A gated MLP's down projection is the exception: act(gate, up) is quantized first, by the
per-token quantization kernel (triton_quant_rows: act, amax and the FP8 row in one launch, in
place of the amax launch), and the GEMM streams FP8 x (QUANTIZE_GATED_FIRST, measured there).

linear_scaled_small_m is fp8compile::qlinear_scaled's triton_small_m kernel; linear_scaled_decode
is the same launch as a torch.library.triton_op, which the pass traces into the graph in both
compile modes (passes/inline.py), so Inductor launches it with no Python of ours around it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from ...numerics import AMAX_EPS, FP8_MAX
from ..launch import Launcher
from ..activations import gated
from .reference_scaled import check_recipe
from .triton_gemm import (
    SMALL_M_MAX,
    small_m_stages,
    split_k_counters,
    _interpreting,
    _small_m_tiles,
    counters_ptr,
    store_split_k,
)
from ..quant.triton_quant import activation_code, load_activation
from ..quant.triton_quant_rows import act_row_amax, quantize, scale_from

BLOCK_K = 128
# How the activation scale is found: from each token's amax, from the amax over x, or given.
ACT_PER_TOKEN, ACT_PER_TENSOR, ACT_STATIC = 0, 1, 2


@triton.jit
def _scaled_small_m_kernel(
    x_ptr,
    b_ptr,
    w_ptr,
    w_s_ptr,
    x_s_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    arrivals_hi,
    arrivals_lo,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_bm,
    stride_bk,
    stride_wn,
    stride_om,
    eps,
    fp8_max,
    amax_ub,
    alpha,
    limit,
    ACT: tl.constexpr,
    W_ROWWISE: tl.constexpr,
    X_QUANTIZED: tl.constexpr,
    ACT_SCALE: tl.constexpr,
    CAP: tl.constexpr,
    E8M0: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    # Float arguments in fp32 whatever the launcher typed them as (Inductor passes Python floats as fp64).
    eps, fp8_max, amax_ub = (
        tl.cast(eps, tl.float32),
        tl.cast(fp8_max, tl.float32),
        tl.cast(amax_ub, tl.float32),
    )
    alpha, limit = tl.cast(alpha, tl.float32), tl.cast(limit, tl.float32)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = offs_m < M
    safe_n = offs_n % N

    if X_QUANTIZED:  # x is FP8 already; x_s_ptr holds its scales: one per row, or one (ACT_SCALE 2)
        if ACT_SCALE == 2:
            x_s = tl.load(x_s_ptr + offs_m * 0)
        else:
            x_s = tl.load(x_s_ptr + offs_m, mask=rows, other=1.0)
    elif ACT_SCALE == 2:
        x_s = tl.load(x_s_ptr + offs_m * 0)  # the static scale, on every row
    else:
        # Each row's amax, which a launch before this one wrote there (row_amax).
        amax = tl.load(x_s_ptr + offs_m, mask=rows, other=0.0)
        if ACT_SCALE == 1:  # padding rows hold zeros: the max over the tile is the max over x
            amax = tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.max(amax, axis=0)
        x_s = scale_from(amax, eps, fp8_max, amax_ub, CAP, E8M0)

    chunks = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(chunks, SPLIT_K)
    c0 = pid_k * per_split
    c1 = tl.minimum(c0 + per_split, chunks)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # swapAB: out^T tile
    for c in range(c0, c1):
        cols = c * BLOCK_K + offs_k
        if EVEN_K:  # whole steps: the weight loads need no mask
            x_mask = rows[:, None]
            w = tl.load(w_ptr + safe_n[:, None] * stride_wn + cols[None, :])
        else:
            in_k = cols < K
            x_mask = rows[:, None] & in_k[None, :]
            w = tl.load(w_ptr + safe_n[:, None] * stride_wn + cols[None, :], mask=in_k[None, :], other=0.0)
        if X_QUANTIZED:
            x_fp8 = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + cols[None, :] * stride_xk, mask=x_mask, other=0.0
            )
        else:  # x itself, or a gated MLP's act(x, b) in fp32 (the down projection's input)
            x = load_activation(
                x_ptr,
                b_ptr,
                offs_m,
                cols,
                stride_xm,
                stride_xk,
                stride_bm,
                stride_bk,
                x_mask,
                alpha,
                limit,
                ACT,
            )
            x_fp8 = tl.clamp(x / x_s[:, None], -fp8_max, fp8_max).to(tl.float8e4nv)
        acc += tl.dot(w, tl.trans(x_fp8))
    if W_ROWWISE:
        acc = acc * tl.load(w_s_ptr + safe_n)[:, None]
    else:
        acc = acc * tl.load(w_s_ptr)
    acc = acc * x_s[None, :]

    arrivals_ptr = counters_ptr(arrivals_hi, arrivals_lo)
    store_split_k(
        acc, out_ptr, partial_ptr, arrivals_ptr, bias_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS, SPLIT_K
    )


@triton.jit
def _row_amax_kernel(
    x_ptr,
    b_ptr,
    amax_ptr,
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
    """amax[m] = max |x[m, :]| (or of act(x, b)[m, :]), one program per row, BLOCK elements per load."""
    rows = tl.program_id(0) + tl.arange(0, 1)
    alpha, limit = tl.cast(alpha, tl.float32), tl.cast(limit, tl.float32)
    amax = act_row_amax(
        x_ptr, b_ptr, rows, K, stride_xm, stride_xk, stride_bm, stride_bk, alpha, limit, ACT, BLOCK
    )
    tl.store(amax_ptr + rows, amax)


AMAX_BLOCK = 2048
_amax_launch = Launcher(_row_amax_kernel)


def row_amax(x2: Tensor, b: Tensor | None = None, act: tuple = ("silu", 1.702, 7.0)) -> Tensor:
    """max |x| per row of x (M, K), or of act(x, b) (act: (activation, alpha, limit)), fp32 (M,):
    what the GEMM kernel makes dynamic scales from."""
    m, k = x2.shape
    amax = torch.empty(m, dtype=torch.float32, device=x2.device)
    b_ = x2 if b is None else b
    launch = {} if _interpreting(x2) else dict(num_warps=4)
    args = (x2, b_, amax, k, x2.stride(0), x2.stride(1), b_.stride(0), b_.stride(1), *map(float, act[1:]))
    _amax_launch((m,), args, {"ACT": activation_code(b, act[0]), "BLOCK": AMAX_BLOCK}, **launch)
    return amax


def _act_mode(recipe: str, x_scale: Tensor | None) -> int:
    check_recipe(recipe)
    if x_scale is not None:
        return ACT_STATIC
    return ACT_PER_TOKEN if recipe == "rowwise" else ACT_PER_TENSOR


# A gated down projection's act(gate, up) is quantized first, by one launch of the per-token
# quantization kernel (triton_quant_rows), and the GEMM streams FP8 x; False: every GEMM program
# computes act over its part of K as it loads it (the block recipe's way), after an amax launch:
# act is then computed once per N tile. The compiled rowwise MLP on an H100 (BENCHMARKS.md, W8A8
# recipes, "2026-11-26 (c669568)"): Llama-3-8B 75.3 / 80.4 us at M = 1 / 16 against 77.5 / 83.9,
# Qwen2.5-7B 93.4 against 97.7 at M = 16. The launch count is the same either way.
QUANTIZE_GATED_FIRST = True

# The gated activation (reference.gated) of a down projection: (activation, alpha, limit).
NO_ACT = ("silu", 1.702, 7.0)


def _launch_arguments(x2, b, act, w_fp8, w_scale, bias, recipe, x_scale, amax_ub, e8m0, out, tiles, traced):
    """(grid, args, constexprs) of the launch writing `out` from x2 (M, K), or from act(x2, b)
    with act = (activation, alpha, limit) where b is given; x_scale: the static scale or None;
    tiles = (block_m, block_n, split, n_tiles). What the launch needs first: act(x2, b)
    quantized (_quantized: the GEMM then streams FP8 x, with its scales), else for a dynamic
    scale each row's amax: Inductor's reduction where traced (it can fuse it with what made x),
    our row_amax launch where not."""
    block_m, block_n, split, n_tiles = tiles
    m, k = x2.shape
    n = w_fp8.shape[0]
    partial = torch.empty(split, m, n, dtype=torch.float32, device=x2.device) if split > 1 else out
    arrivals = split_k_counters(x2.device, n_tiles, split)
    act_mode, quantized = _act_mode(recipe, x_scale), b is not None and QUANTIZE_GATED_FIRST
    if quantized:
        x2, x_scale, per_row = _quantized(x2, b, act, recipe, x_scale, amax_ub, e8m0, traced)
        b, act, act_mode = None, NO_ACT, ACT_PER_TOKEN if per_row else ACT_STATIC
    elif x_scale is None and traced:  # each row's amax
        x_scale = (x2 if b is None else gated(x2, b, *act)).abs().amax(dim=1).float()
    elif x_scale is None:
        x_scale = row_amax(x2, b, act)
    b_ = x2 if b is None else b
    args = (
        x2,
        b_,
        w_fp8,
        w_scale,
        x_scale,  # the static scale, each row's amax, or (quantized) x2's scales
        bias if bias is not None else w_scale,
        out,
        partial,
        *arrivals,
        m,
        n,
        k,
        x2.stride(0),
        x2.stride(1),
        b_.stride(0),
        b_.stride(1),
        w_fp8.stride(0),
        out.stride(0),
        AMAX_EPS,
        FP8_MAX,
        float(amax_ub),
        float(act[1]),
        float(act[2]),
    )
    constexprs = dict(
        ACT=activation_code(b, act[0]),
        W_ROWWISE=recipe == "rowwise",
        X_QUANTIZED=quantized,
        ACT_SCALE=act_mode,
        CAP=act_mode != ACT_STATIC and not quantized and amax_ub > 0,
        E8M0=e8m0,
        HAS_BIAS=bias is not None,
        EVEN_K=k % BLOCK_K == 0,
        SPLIT_K=split,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=BLOCK_K,
    )
    return (n_tiles, split), args, constexprs


_launch = Launcher(_scaled_small_m_kernel)


def _quantized(x2, b2, act, recipe, x_scale, amax_ub, e8m0, traced):
    """A gated down projection's input act(x2, b2) quantized as the recipe says, by one launch
    of the per-token quantization kernel (triton_quant_rows.quantize; traced: through
    wrap_triton): (x_fp8, its scales, whether they are one per token). The GEMM then
    streams FP8 x instead of computing act again in every program over its part of K."""
    x_fp8, scale = quantize(x2, b2, recipe, x_scale, amax_ub, e8m0, act, traced)
    return x_fp8, scale, recipe == "rowwise" and x_scale is None


def _small_m(
    x,
    b,
    act,
    w_fp8,
    w_scale,
    bias,
    recipe,
    x_scale,
    amax_ub,
    e8m0,
    block_n=None,
    split_k=None,
    num_stages=None,
) -> Tensor:
    """The eager launch over x (..., K), or act(x, b): (..., N) in x.dtype. block_n, split_k,
    num_stages: the tiles, for a sweep (`bench tune --kernels scaled_small_m`; default: the
    decode kernel's)."""
    x2 = x.reshape(-1, x.shape[-1])
    b2 = None if b is None else b.reshape(x2.shape)
    m, k = x2.shape
    n = w_fp8.shape[0]
    if m > SMALL_M_MAX:
        raise ValueError(f"the scaled decode kernel serves M <= {SMALL_M_MAX}, got M={m}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    tiles = _small_m_tiles(m, n, k, False, x.device, block_n, split_k)
    grid, args, constexprs = _launch_arguments(
        x2, b2, act, w_fp8, w_scale, bias, recipe, x_scale, amax_ub, e8m0, out, tiles, traced=False
    )
    stages = num_stages or small_m_stages(tiles[0], tiles[1], b is not None, x.device)
    launch = {} if _interpreting(x2) else dict(num_warps=4, num_stages=stages)
    _launch(grid, args, constexprs, **launch)
    return out.reshape(*x.shape[:-1], n)


def linear_scaled_small_m(
    x: Tensor,
    w_fp8: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    recipe: str = "rowwise",
    x_scale: Tensor | None = None,
    amax_ub: float = 0.0,
    e8m0: bool = False,
    fast_accum: bool = False,
    *,
    block_n: int | None = None,
    split_k: int | None = None,
    num_stages: int | None = None,
) -> Tensor:
    """bf16 x (..., K), at most 64 rows, times w_fp8 (N, K) with w_scale () or (N,) (+ bias) ->
    bf16 (..., N): quantization and GEMM in one launch. fast_accum is cuBLAS's option
    (Fp8Config.fast_accum), not this kernel's: Triton already keeps all of K in the tensor cores'
    FP8 accumulator here (BENCHMARKS.md, 2026-11-25 (395d9b7)). block_n, split_k, num_stages:
    tiles for a sweep (default: the kernel's own)."""
    tiles = dict(block_n=block_n, split_k=split_k, num_stages=num_stages)
    return _small_m(x, None, NO_ACT, w_fp8, w_scale, bias, recipe, x_scale, amax_ub, e8m0, **tiles)


def gated_linear_scaled_small_m(
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
    *,
    block_n: int | None = None,
    split_k: int | None = None,
    num_stages: int | None = None,
) -> Tensor:
    """linear_scaled_small_m of a gated MLP's act(a, b) (reference.gated): the product is
    computed in fp32 and written only as its FP8 quantization (QUANTIZE_GATED_FIRST; else each
    tile of it is computed where the GEMM loads it), never in bf16."""
    act = (activation, alpha, limit)
    tiles = dict(block_n=block_n, split_k=split_k, num_stages=num_stages)
    return _small_m(a, b, act, w_fp8, w_scale, bias, recipe, x_scale, amax_ub, e8m0, **tiles)


@triton_op("fp8compile::linear_scaled_decode", mutates_args=())
def linear_scaled_decode(
    x: Tensor,
    w_fp8: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    x_scale: Tensor | None = None,
    recipe: str = "rowwise",
    amax_ub: float = 0.0,
    e8m0: bool = False,
    max_m: int = 16,
    b: Tensor | None = None,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> Tensor:
    """linear_scaled_small_m for x (M, K), M <= max_m <= 64, as a launch Inductor makes: the tile
    height and split are fixed at trace time from max_m (M is the dispatch's symbol there); the
    split-K counters are the eager path's, by address (triton_gemm.split_k_counters). With b
    (M, K): gated_linear_scaled_small_m, on act(x, b)."""
    if not 1 <= max_m <= SMALL_M_MAX:
        raise ValueError(f"linear_scaled_decode serves 1 <= M <= {SMALL_M_MAX}, asked for M up to {max_m}")
    m = x.shape[0]
    n, k = (int(size) for size in w_fp8.shape)
    tiles = _small_m_tiles(max_m, n, k, False, x.device, None, None)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    act = (activation, alpha, limit)
    grid, args, constexprs = _launch_arguments(
        x, b, act, w_fp8, w_scale, bias, recipe, x_scale, amax_ub, e8m0, out, tiles, traced=True
    )
    stages = small_m_stages(tiles[0], tiles[1], b is not None, x.device)  # the decode GEMM's bound holds
    launch = {} if x.device.type == "cpu" else dict(num_warps=4, num_stages=stages)
    wrap_triton(_scaled_small_m_kernel)[grid](*args, **constexprs, **launch)
    return out
