"""Triton block-scaled FP8 GEMMs, twins of reference.gemm_block / reference.linear_block.

Two kernels, because decode and prefill are different problems:
- gemm_large_m: a tiled GEMM (BLOCK_M x BLOCK_N tiles, one 128-wide K group per step, TMA
  loads, a persistent grid). Each group's tensor-core dot is promoted to fp32 registers and
  scaled there, as DeepGEMM does, so the hardware's limited FP8 accumulation precision never
  spans more than 128 K. With a fixed config every output element sees the same instruction
  sequence whatever M is (M only changes which program computes a tile): this is the
  batch-invariant kernel.
- linear_small_m: decode (M <= 64) is a stream over the FP8 weight. swapAB: the weight tile is
  the MMA's M side (BLOCK_N rows), the few tokens its N side (padded to 16/32/64), and the
  activation is quantized 1x128 inside the kernel, group by group, as the weight streams by:
  one launch, no bf16 or FP8 activation round trip through memory. Weight tiles (and a plain
  linear's activation tiles) come through TMA descriptors (bulk copies) inside CUDA graphs,
  where the tensors allow. Split-K spreads a short N
  over the SMs; each split writes fp32 partials and the last to arrive at an N tile (an atomic
  counter) sums them in split order and writes bf16: still one launch, and deterministic.

Shape letters: M tokens, N output features, K input features, G = K / 128.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch.utils._python_dispatch import _disable_current_modes

from ...numerics import AMAX_EPS, BLOCK, FP8_MAX, ceil_div
from ..launch import Launcher, capability, device_index, num_sms, shared_memory
from ..quant.triton_quant import activation_code, load_activation, quant_act, quant_group


@triton.jit
def _tile_position(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped tile order: GROUP_M row-tiles share each weight column-tile while it is in L2."""
    in_group = GROUP_M * num_n
    first_m = (tile // in_group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    return first_m + (tile % in_group) % size_m, (tile % in_group) // size_m


@triton.jit
def _gemm_large_m_kernel(
    a_ptr,
    a_desc,
    a_s_ptr,
    b_ptr,
    b_desc,
    b_s_ptr,
    bias_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_asg,
    stride_bn,
    stride_bsn,
    stride_bsg,
    stride_cm,
    HAS_BIAS: tl.constexpr,
    TMA: tl.constexpr,
    FLATTEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # One tile per program, or, on a persistent grid, every num_programs-th tile. FLATTEN lets
    # the pipeliner fetch the next tile's first groups while this tile's epilogue runs.
    for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = _tile_position(tile, num_m, num_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        safe_m = offs_m % M  # wrapped rows load real data and are never stored: loads need no mask
        safe_n = offs_n % N
        a_s_ptrs = a_s_ptr + safe_m * stride_asm
        # BLOCK_N divides the 128-row weight block: one weight scale per (tile, group), so the
        # promotion below is one FMA per accumulator element.
        b_s_ptrs = b_s_ptr + (pid_n * BLOCK_N // BLOCK_K) * stride_bsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for g in range(0, K // BLOCK_K):
            if TMA:  # bulk tensor copies; rows past M or N arrive as zeros
                a = a_desc.load([pid_m * BLOCK_M, g * BLOCK_K])
                b = b_desc.load([pid_n * BLOCK_N, g * BLOCK_K])
            else:
                a = tl.load(a_ptr + safe_m[:, None] * stride_am + (g * BLOCK_K + offs_k)[None, :])
                b = tl.load(b_ptr + safe_n[:, None] * stride_bn + (g * BLOCK_K + offs_k)[None, :])
            scale = tl.load(a_s_ptrs + g * stride_asg) * tl.load(b_s_ptrs + g * stride_bsg)
            acc += tl.dot(a, tl.trans(b)) * scale[:, None]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + safe_n).to(tl.float32)[None, :]
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(
            c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask
        )


@triton.jit
def _prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at ptrs (no registers filled, nothing waited on)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _linear_small_m_kernel(
    x_ptr,
    x_desc,
    b_ptr,
    w_ptr,
    w_desc,
    w_s_ptr,
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
    stride_wsn,
    stride_wsg,
    stride_om,
    eps,
    fp8_max,
    alpha,
    limit,
    E8M0: tl.constexpr,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    TMA: tl.constexpr,
    ACT_TMA: tl.constexpr,
    PDL: tl.constexpr,
    TRIGGER: tl.constexpr,
    PREFETCH: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    # Float arguments in fp32 whatever the launcher typed them as (Inductor passes Python floats as fp64).
    eps, fp8_max = tl.cast(eps, tl.float32), tl.cast(fp8_max, tl.float32)
    alpha, limit = tl.cast(alpha, tl.float32), tl.cast(limit, tl.float32)
    groups = K // GROUP
    per_split = tl.cdiv(groups, SPLIT_K)
    g0 = pid_k * per_split
    g1 = min(g0 + per_split, groups)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, GROUP)
    safe_n = offs_n % N
    if PDL:
        # Launched while the previous kernel still runs (programmatic dependent launch). Only
        # the weight, which no kernel writes, may be touched before gdc_wait: pull this
        # program's first PREFETCH groups into L2 so the stream starts at speed. Everything else
        # (x, b, the split-K buffers, out) waits for the previous kernel to finish and flush.
        ahead = tl.minimum(g0 + tl.arange(0, PREFETCH), groups - 1)
        _prefetch_l2(w_ptr + safe_n[:, None] * stride_wn + (ahead * GROUP)[None, :])
        tl.extra.cuda.gdc_wait()
    if TRIGGER:
        # A next kernel launched as a dependent may start now (after our own wait, so at most
        # one kernel runs ahead); one launched plainly still waits for us to finish.
        tl.extra.cuda.gdc_launch_dependents()
    w_ptrs = w_ptr + safe_n[:, None] * stride_wn + (g0 * GROUP + offs_k)[None, :]
    # The tile's weight scales are one or two scalars a group (a 128-row scale block, or two for
    # 256-row tiles), each loaded one group ahead: the load's latency overlaps a group's wait
    # for its tiles, and the scalars broadcast over the accumulator with no layout conversion.
    tl.static_assert(BLOCK_N <= 2 * GROUP, "a tile spans at most two weight-scale blocks")
    s_ptr = w_s_ptr + (pid_n * BLOCK_N // GROUP) * stride_wsn
    s2_ptr = w_s_ptr + tl.minimum(pid_n * BLOCK_N // GROUP + 1, (N - 1) // GROUP) * stride_wsn
    ahead = tl.minimum(g0, groups - 1)
    s_next = tl.load(s_ptr + ahead * stride_wsg)
    s2_next = tl.load(s2_ptr + ahead * stride_wsg) if BLOCK_N > GROUP else s_next

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # swapAB: out^T tile
    for g in range(g0, g1):
        s, s2 = s_next, s2_next
        ahead = tl.minimum(g + 1, groups - 1)
        s_next = tl.load(s_ptr + ahead * stride_wsg)
        if BLOCK_N > GROUP:
            s2_next = tl.load(s2_ptr + ahead * stride_wsg)
        if ACT_TMA:  # pipelined with the weight tiles; rows past M arrive as zeros
            tl.static_assert(ACT == 0, "TMA activation tiles serve plain linears only")
            x = x_desc.load([0, g * GROUP]).to(tl.float32)
        else:
            x = load_activation(
                x_ptr,
                b_ptr,
                offs_m,
                g * GROUP + offs_k,
                stride_xm,
                stride_xk,
                stride_bm,
                stride_bk,
                offs_m[:, None] < M,
                alpha,
                limit,
                ACT,
            )
        x_fp8, x_s = quant_group(x, eps, fp8_max, E8M0)  # padding rows: zeros, finite scale
        if TMA:  # bulk tensor copy; rows past N arrive as zeros
            w = w_desc.load([pid_n * BLOCK_N, g * GROUP])
        else:
            w = tl.load(w_ptrs)
        if BLOCK_N > GROUP:
            w_s = tl.where(tl.arange(0, BLOCK_N) < GROUP, s, s2)
            acc += tl.dot(w, tl.trans(x_fp8)) * w_s[:, None] * x_s[None, :]
        else:
            acc += tl.dot(w, tl.trans(x_fp8)) * s * x_s[None, :]
        w_ptrs += GROUP

    arrivals_ptr = counters_ptr(arrivals_hi, arrivals_lo)
    store_split_k(
        acc, out_ptr, partial_ptr, arrivals_ptr, bias_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS, SPLIT_K
    )


@triton.jit
def counters_ptr(arrivals_hi, arrivals_lo):
    """The split-K counters' pointer from the address split_k_counters gives in two int32 halves."""
    address = tl.cast(arrivals_hi, tl.int64) * ADDRESS_SPLIT + tl.cast(arrivals_lo, tl.int64)
    return address.to(tl.pointer_type(tl.int32))


@triton.jit
def store_split_k(
    acc,
    out_ptr,
    partial_ptr,
    arrivals_ptr,
    bias_ptr,
    offs_m,
    offs_n,
    M,
    N,
    stride_om,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """Epilogue of a swapAB decode program (acc: its fp32 out^T tile, BLOCK_N x BLOCK_M) in split-K
    program_id(1) of SPLIT_K over N tile program_id(0): (+ bias) written to out in its dtype. With
    SPLIT_K > 1 each split publishes its partial sums; the last split to arrive at the N tile adds
    all of them in split order (deterministic), then resets the counter for the next call.
    arrivals_ptr: the int32 counters, one per N tile (counters_ptr)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    safe_n = offs_n % N
    mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    if SPLIT_K > 1:
        tile = offs_m[None, :] * N + offs_n[:, None]
        tl.store(partial_ptr + pid_k * M * N + tile, acc, mask=mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            acc = tl.zeros(acc.shape, dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # unrolled: the loads fly together, the sum keeps split order
                acc += tl.load(partial_ptr + s * M * N + tile, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(bias_ptr + safe_n).to(tl.float32)[:, None]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(arrivals_ptr + pid_n, 0)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + safe_n).to(tl.float32)[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# Large-M tile config. BLOCK_K is the 128-wide scale group. `bench tune --kernels large_m` on an
# H200 (BENCHMARKS.md; benchmarks/tune_large_m_h200.json, benchmarks/tune_large_m_h200_variants.json,
# benchmarks/tune_large_m_tiles_h200.json), 13 candidates x 5 shapes x M = 1024,
# 4096, DeepGEMM timed in the same run: 128x128 tiles, 8 warps, 3 stages, TMA loads, one
# persistent program per SM is the best by geometric mean in both runs (0.66-0.70x DeepGEMM at
# M = 4096). Before (64x128, 4 warps, pointer loads, a weight scale per column): 0.54-0.59x.
# Half-width double accumulators, 128x256 and 256x128 tiles, and Triton's warp_specialize were
# slower or no faster (second run). Overlapping the next group's dot with the scaling of the
# previous one (two accumulators) measured 4-10x slower with Triton 3.6, so the loop stays plain.
# Under the CPU interpreter every op of every program is a Python call on NumPy arrays, so fewer,
# larger programs run faster: 32x64 tiles, small enough that a test's small shapes still span
# several in M and N (16x32 took twice the time: triton_scaled_gemm.INTERPRETER_CONFIG).
LARGE_M_CONFIG = dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=3, persistent=1)
# Up to TILE_SWITCH_M rows the 64-row tiles of the earlier config: 128-row tiles leave SMs
# idle there (M = 128, N = 4096, K = 7168: 32 tiles for 132 SMs, 37.4 us against 24.6 us with
# 64-row tiles; 1.05-1.59x at M <= 256 on the five shapes, BENCHMARKS.md). Both tilings give
# every output element the same instruction sequence (same bits, tests/test_triton_kernels.py),
# so the switch keeps the kernel batch-invariant.
# `bench tune --kernels tiles` chose the threshold.
SMALL_TILE_CONFIG = dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=4)
TILE_SWITCH_M = 512
INTERPRETER_CONFIG = dict(BLOCK_M=32, BLOCK_N=64, GROUP_M=4)

# Small-M: rows of the weight per program, and the number of programs the launcher aims for
# (split-K fills in when N / BLOCK_N alone gives fewer). `bench tune` on an H200 (BENCHMARKS.md):
# (BLOCK_N 128, 2 programs per SM, 3 stages) is the best fixed choice by geometric mean over the
# five benchmark shapes at M = 1, 16, 32, and within 3% of the best config at every point except
# N=7168 K=2048 at M = 16 and 32 (8% and 5%; benchmarks/tune_small_m_h200.json). TMA weight
# loads at the same config: 3-8% faster than pointer loads on all ten points of
# 9d201bf:scripts/decode_probe.py (M = 1, 16), geometric mean 5.5%; also the best of 24 variants there.
SMALL_M_BLOCK_N = 128
SMALL_M_PROGRAMS_PER_SM = 2
# Gated (act(a, b) fused, the MLP's down projection): every weight tile also costs two activation
# loads, the activation and the quantization of its group; 256-row tiles, one program per SM,
# halve that per weight byte. 9d201bf:scripts/decode_tiles_probe.py on an H200: 1.02-1.29x faster than
# (128, 2) at all 14 gated points (7 shapes, M = 1 and 16), 0.90-1.00x on the plain ones.
SMALL_M_GATED_BLOCK_N = 256
SMALL_M_GATED_PROGRAMS_PER_SM = 1
SMALL_M_NUM_STAGES = 3
# One warpgroup a program. Over Llama-3-8B's five decode shapes (lm_head included) at M = 1 and
# 16, plain and gated, 4 or 8 warps x 3 or 4 stages x 1, 2 or 4 programs an SM: the best 8-warp
# config took 0.96-1.08x the default's time, and the default was within 4.5% of the best config
# at every point (H200, 2026-11-29, a504459;
# benchmarks/decode_kernel_warps_h200_2026-11-29_a504459.json).
SMALL_M_NUM_WARPS = 4
SMALL_M_MAX = 64  # the kernel pads M to 16, 32 or 64 rows
# Programmatic dependent launch (PDL, Hopper and newer). Every decode kernel lets the next kernel
# launch as soon as it starts (after its own wait); a kernel launched as a dependent (pdl=True)
# starts while its predecessor drains, pulls its first SMALL_M_PDL_PREFETCH weight groups into L2,
# then waits. No kernel is launched as a dependent by default. The gated kernel (the MLP's down
# projection after the gate|up GEMM) was, on 9d201bf:scripts/decode_options_probe.py's isolated
# pair (1.01-1.02x at M <= 16, H200); in whole models under CUDA graphs it cost 31 us a layer:
# Mistral-7B-v0.1 widths, 8 layers, reduce-overhead, batch 1, the linears' GPU time per decode
# step 0.86 ms launched as a dependent, 0.61 ms plain (`bench model --profile`, H200, 2026-11-27;
# BENCHMARKS.md, "Decode kernels in whole models"). Plain kernels measured 0.78-1.02x as
# dependents in the probe. USE_PDL = False turns the trigger off too.
USE_PDL = True
SMALL_M_PDL_PREFETCH = 1
# With TMA weight loads (in a CUDA graph), a plain kernel's activation tiles come through TMA
# too, so the pipeliner fetches them stages ahead with the weight instead of at the start of each
# group. Same probe: 1.00-1.08x at M = 32 (>= 1.02x on four of seven shapes; the MLP pair
# 1.03x), 0.99-1.01x at M <= 16. Gated kernels (two activation tiles, act() in registers)
# measured 0.93-1.01x with TMA activation tiles and keep plain loads.
ACT_TMA = True
# Above TILE_SWITCH_M rows on sm_90, gemm_large_m runs the warp-specialized Gluon kernel
# (gluon_gemm.py): 0.79-0.95x DeepGEMM at M = 4096 against this kernel's 0.64-0.71x, and the same
# bits (9d201bf:scripts/gluon_probe.py, BENCHMARKS.md). False keeps this file's kernel everywhere.
USE_GLUON = True


def _interpreting(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def gemm_large_m(x_fp8, x_scale, w_fp8, w_scale, bias=None, out_dtype=torch.bfloat16, config=None, tma=None):
    """Block-scaled x_fp8 (M, K) @ w_fp8 (N, K).T (+ bias) -> (M, N) out_dtype.

    x_scale (M, G) and w_scale (ceil(N/128), G) may have any strides (row- or MN-major).
    config: tile constants (LARGE_M_CONFIG's keys, BLOCK_N dividing 128, optionally "tma");
    default: SMALL_TILE_CONFIG up to TILE_SWITCH_M rows, LARGE_M_CONFIG above.
    tma: TMA loads (True), pointer loads (False), or, if neither it nor config says,
    tma_pays_off(). With neither config nor tma given, M > TILE_SWITCH_M on Hopper runs
    gluon_gemm.gemm (warp-specialized, 1.2-1.4x this kernel; the same bits)."""
    m, k = x_fp8.shape
    n = w_fp8.shape[0]
    if config is None and tma is None and m > TILE_SWITCH_M and _gluon_runs(x_fp8, w_fp8, out_dtype):
        from . import gluon_gemm

        return gluon_gemm.gemm(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype)
    out = torch.empty(m, n, dtype=out_dtype, device=x_fp8.device)
    if m == 0:
        return out
    cfg = dict(
        config
        or (
            INTERPRETER_CONFIG
            if _interpreting(x_fp8)
            else SMALL_TILE_CONFIG
            if m <= TILE_SWITCH_M
            else LARGE_M_CONFIG
        )
    )
    from_config = cfg.pop("tma", None)
    tma = from_config if tma is None else tma
    tma = (tma_pays_off(x_fp8.device) if tma is None else tma) and use_tma(x_fp8) and use_tma(w_fp8)
    per_sm = cfg.pop("persistent", 0)
    if BLOCK % cfg["BLOCK_N"]:
        raise ValueError(f"BLOCK_N={cfg['BLOCK_N']} must divide the {BLOCK}-row weight scale block")
    tiles = ceil_div(m, cfg["BLOCK_M"]) * ceil_div(n, cfg["BLOCK_N"])
    sms = 1 if _interpreting(x_fp8) else num_sms(x_fp8.device.index or 0)  # the interpreter: 1 "SM"
    programs = min(tiles, per_sm * sms) if per_sm else tiles
    descriptors = (
        (_descriptor(x_fp8, cfg["BLOCK_M"]), _descriptor(w_fp8, cfg["BLOCK_N"])) if tma else (x_fp8, w_fp8)
    )
    _gemm_large_m_kernel[(programs,)](
        x_fp8,
        descriptors[0],
        x_scale,
        w_fp8,
        descriptors[1],
        w_scale,
        bias if bias is not None else w_scale,
        out,
        m,
        n,
        k,
        x_fp8.stride(0),
        x_scale.stride(0),
        x_scale.stride(1),
        w_fp8.stride(0),
        w_scale.stride(0),
        w_scale.stride(1),
        out.stride(0),
        HAS_BIAS=bias is not None,
        TMA=tma,
        FLATTEN=programs < tiles,
        BLOCK_K=BLOCK,
        **cfg,
    )
    return out


def _gluon_runs(x_fp8, w_fp8, out_dtype) -> bool:
    """Whether gemm_large_m hands these operands to the Gluon kernel (USE_GLUON and it can run)."""
    if not USE_GLUON or x_fp8.device.type != "cuda":
        return False
    from . import gluon_gemm

    return gluon_gemm.why_not(x_fp8, w_fp8, out_dtype) is None


def large_m_kernel(m: int, n: int, device: torch.device) -> str:
    """Which kernel gemm_large_m runs for M rows and N outputs (`python -m fp8compile backends`)."""
    if m > TILE_SWITCH_M and USE_GLUON and device.type == "cuda" and n % 8 == 0:
        from . import gluon_gemm

        if gluon_gemm.IMPORT_ERROR is None and torch.cuda.get_device_capability(device)[0] == 9:
            cfg = gluon_gemm.pick_config(m, n, num_sms(device.index or 0))
            return f"Gluon warp-specialized GEMM, {cfg['BLOCK_M']}x{cfg['BLOCK_N']} tiles"
    cfg = SMALL_TILE_CONFIG if m <= TILE_SWITCH_M else LARGE_M_CONFIG
    return f"Triton GEMM, {cfg['BLOCK_M']}x{cfg['BLOCK_N']} tiles"


def linear_large_m(x, w_fp8, w_scale, bias=None, e8m0=False):
    """Triton quantization (row-major scales) then gemm_large_m."""
    x2 = x.reshape(-1, x.shape[-1])
    x_fp8, x_scale = quant_act(x2, e8m0)
    return gemm_large_m(x_fp8, x_scale, w_fp8, w_scale, bias, x.dtype).reshape(*x.shape[:-1], w_fp8.shape[0])


@functools.lru_cache(maxsize=1024)
def small_m_split(
    n: int,
    k: int,
    device: torch.device,
    block_n: int = SMALL_M_BLOCK_N,
    programs_per_sm: int = SMALL_M_PROGRAMS_PER_SM,
) -> int:
    """Split-K factor: enough programs to keep every SM streaming, never more splits than groups."""
    if device.type != "cuda":
        return 2  # exercise the split path under the interpreter
    n_blocks = ceil_div(n, block_n)
    target = programs_per_sm * num_sms(device.index or 0)
    return max(1, min(k // BLOCK, round(target / n_blocks)))


# Every counter buffer ever handed out, per device: none is freed, because a traced launch keeps
# the address it was given for as long as its compiled graph lives.
_ARRIVALS: dict[torch.device, list[torch.Tensor]] = {}


def _arrival_counters(device: torch.device, n_tiles: int) -> torch.Tensor:
    """Zeroed int32 counters, one per N tile, reused across calls (the kernel leaves them at 0).
    One buffer per device: split-K launches on one device must not overlap on two streams.
    Allocated at compile time (prepare_small_m): a buffer first allocated in a CUDA graph's
    warm-up run or capture would live in that graph's memory pool, which reuses it. Made outside
    whatever tracing mode is active (a traced launch reads the real buffer's address)."""
    buffers = _ARRIVALS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < n_tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the decode kernel's split-K counters would be allocated inside a CUDA graph capture: "
                "run the op once on this device before capturing"
            )
        with _disable_current_modes():
            buffers.append(torch.zeros(max(n_tiles, 4096), dtype=torch.int32, device=device))
    return buffers[-1]


# split_k_counters gives an address in two parts below 2**31: every launcher then takes them as
# int32 (Inductor 2.11 fails on a wider constant argument of a kernel it launches: its 32-bit check
# asks the Python int for a symbolic hint).
ADDRESS_SPLIT: tl.constexpr = tl.constexpr(2**31)


def split_k_counters(device: torch.device, n_tiles: int, split: int) -> tuple[int, int]:
    """The decode kernels' (arrivals_hi, arrivals_lo): the address of the split-K counters,
    hi * 2**31 + lo ((0, 0) without a split). An address, not a tensor, so that a traced launch
    (decode_op) stays a functional op with no per-call zero fill: the counters are scratch each
    launch leaves as it found them, and a tensor argument the kernel writes would be cloned per
    call by the functionalization of user Triton kernels. The address is a constant of the
    compiled graph, part of its cache key."""
    address = _arrival_counters(device, n_tiles).data_ptr() if split > 1 else 0
    return divmod(address, ADDRESS_SPLIT.value)


def prepare_small_m(request) -> None:
    """registry hook, at compile time: the split-K counters for a call site of N outputs (one per
    N tile of the plain or gated kernel), before any CUDA graph's warm-up could allocate them."""
    if request.device.type == "cuda":
        _arrival_counters(request.device, ceil_div(request.n, min(SMALL_M_BLOCK_N, SMALL_M_GATED_BLOCK_N)))


@functools.cache
def _hopper_or_newer(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def use_tma(w: torch.Tensor) -> bool:
    """Whether a TMA descriptor can address w: Hopper or newer (or the interpreter), row-major,
    16-byte aligned base and row stride."""
    hopper = not w.is_cuda or _hopper_or_newer(w.device.index or 0)
    return (
        hopper and w.stride(1) == 1 and (w.stride(0) * w.element_size()) % 16 == 0 and w.data_ptr() % 16 == 0
    )


def pdl_supported(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 or newer: griddepcontrol is sm_90+, and the CPU
    interpreter has no grid dependencies to control."""
    return device.type == "cuda" and _hopper_or_newer(device.index or 0)


def pdl_available(device: torch.device) -> bool:
    """Whether the decode kernels let a dependent launch start early (gdc_launch_dependents): USE_PDL,
    where supported."""
    return USE_PDL and pdl_supported(device)


def tma_pays_off(device: torch.device) -> bool:
    """TMA loads by default only while a CUDA graph is being captured (and in the interpreter).

    Triton's launcher encodes every TMA descriptor on the host at every launch. Measured by
    scripts/host_probe.py (now `bench host`) on an H200 machine (BENCHMARKS.md, "Host cost"): the
    decode kernel costs 65 us of host time per call with its TMA descriptor, 46-48 without, against 9-11 us
    of GPU time, so outside a CUDA graph a decode step waits on the host. In a graph the
    descriptor is encoded once at capture, and TMA loads are faster on the GPU: 5.6% for the
    decode kernel (decode probe), 13% for the large-M GEMM at M = 4096."""
    return device.type == "cpu" or torch.cuda.is_current_stream_capturing()


def _descriptor(t: torch.Tensor, rows: int):
    """A TMA descriptor over row-major t (R, K) that loads (rows, 128) tiles."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, [rows, BLOCK])


@functools.lru_cache(maxsize=4096)
def _small_m_tiles(
    m: int, n: int, k: int, gated: bool, device: torch.device, block_n: int | None, split_k: int | None
) -> tuple[int, int, int, int]:
    """(block_m, block_n, split, n_tiles) of the decode kernel for one call signature (cached:
    outside a CUDA graph the launcher's host work is on the critical path)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    # the interpreter: 64-row tiles, for the reason INTERPRETER_CONFIG gives (a test of
    # tests/test_linear_pass.py at M = 40 took 11 s with 32-row tiles, 5 s with these)
    block_n = block_n or (64 if device.type == "cpu" else SMALL_M_GATED_BLOCK_N if gated else SMALL_M_BLOCK_N)
    split = split_k or small_m_split(
        n, k, device, block_n, SMALL_M_GATED_PROGRAMS_PER_SM if gated else SMALL_M_PROGRAMS_PER_SM
    )
    return block_m, block_n, split, ceil_div(n, block_n)


def small_m_shared_bytes(block_m: int, block_n: int, gated: bool, stages: int, major: int) -> int:
    """An upper bound of the decode kernel's shared memory with pointer loads (TMA off, as the
    traced op launches it), in bytes: the weight tiles (block_n x 128 FP8) and activation tiles
    (block_m x 128 bf16, two when gated) in flight, a scratch of block_m x 128 bytes, and 8 KiB
    of room. Compiled by Triton 3.7.1 the kernel asks exactly that less the room: for sm_90
    (compute capability 9 and above here) `stages` weight tiles and stages - 1 activation
    tiles, for sm_89 stages - 1 of each (tests/test_triton_kernels.py)."""
    weight, activation = block_n * BLOCK, (2 if gated else 1) * block_m * BLOCK * 2
    in_flight = max(1, stages - 1)
    weights = stages if major >= 9 else in_flight
    return weights * weight + in_flight * activation + block_m * BLOCK + 8192


@functools.lru_cache(maxsize=256)
def small_m_stages(block_m: int, block_n: int, gated: bool, device: torch.device) -> int:
    """SMALL_M_NUM_STAGES, or fewer where the GPU's shared memory cannot hold them: on an Ada GPU
    (99 KiB a block) the gated kernel's 3 stages at 32 and 64 rows ask 100 and 136 KiB, more than
    Triton can load (cached: the eager decode path asks on every call). On an H100 or H200
    (227 KiB) every tile of the kernel takes all three (168 KiB at most)."""
    if device.type != "cuda":
        return SMALL_M_NUM_STAGES
    index = device_index(device)
    major, budget = capability(index)[0], shared_memory(index)
    stages = SMALL_M_NUM_STAGES
    while stages > 1 and small_m_shared_bytes(block_m, block_n, gated, stages, major) > budget:
        stages -= 1
    return stages


def linear_small_m(
    x,
    w_fp8,
    w_scale,
    bias=None,
    e8m0=False,
    split_k=None,
    block_n=None,
    num_stages=None,
    b=None,
    activation="silu",
    alpha=1.702,
    limit=7.0,
    tma=None,
    pdl=False,
    prefetch=SMALL_M_PDL_PREFETCH,
):
    """Fused 1x128 activation quantization + block-scaled GEMM for M <= 64, in one launch:
    bf16 x (..., K) -> bf16 (..., N). With b (same shape as x) the activation is act(x, b).
    tma: force TMA weight loads on or off (default: tma_pays_off()); pdl: launch as a dependent of
    the kernel before (default: a plain launch; USE_PDL says why); prefetch: weight groups a
    dependent launch pulls into L2 before it waits."""
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    n = w_fp8.shape[0]
    if m > SMALL_M_MAX:
        raise ValueError(f"linear_small_m serves M <= {SMALL_M_MAX}, got M={m}")
    b2 = x2 if b is None else b.reshape(-1, k)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    gated = b is not None
    block_m, block_n, split, n_tiles = _small_m_tiles(m, n, k, gated, x.device, block_n, split_k)
    partial = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    arrivals = split_k_counters(x.device, n_tiles, split)
    launch = (
        {}
        if _interpreting(x2)
        else dict(
            num_warps=SMALL_M_NUM_WARPS,
            num_stages=num_stages or small_m_stages(block_m, block_n, gated, x.device),
        )
    )
    tma = tma_pays_off(x.device) and use_tma(w_fp8) if tma is None else tma
    trigger = pdl_available(x.device)
    if pdl:
        if prefetch < 1 or prefetch & (prefetch - 1):
            raise ValueError(
                f"prefetch must be a power of two >= 1 (weight groups per program), got {prefetch}"
            )
        if not pdl_supported(x.device):
            raise ValueError(
                "programmatic dependent launch needs a CUDA GPU of compute capability 9.0 or newer"
            )
        launch["launch_pdl"] = True
    act_tma = tma and ACT_TMA and not gated and use_tma(x2)
    _small_m_launch(
        (n_tiles, split),
        (
            x2,
            _descriptor(x2, block_m) if act_tma else x2,
            b2,
            w_fp8,
            _descriptor(w_fp8, block_n) if tma else w_fp8,
            w_scale,
            bias if bias is not None else w_scale,
            out,
            partial,
            *arrivals,
            m,
            n,
            k,
            x2.stride(0),
            x2.stride(1),
            b2.stride(0),
            b2.stride(1),
            w_fp8.stride(0),
            w_scale.stride(0),
            w_scale.stride(1),
            out.stride(0),
            AMAX_EPS,
            FP8_MAX,
            float(alpha),
            float(limit),
        ),
        dict(
            E8M0=e8m0,
            ACT=activation_code(b, activation),
            HAS_BIAS=bias is not None,
            TMA=tma,
            ACT_TMA=act_tma,
            PDL=pdl,
            TRIGGER=trigger or pdl,
            PREFETCH=prefetch,
            SPLIT_K=split,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            GROUP=BLOCK,
        ),
        **launch,
    )
    return out.reshape(*x.shape[:-1], n)


_small_m_launch = Launcher(_linear_small_m_kernel)


def gated_linear_small_m(
    a, b, w_fp8, w_scale, bias=None, e8m0=False, activation="silu", alpha=1.702, limit=7.0
):
    """Gated-MLP down projection for M <= 64: act(a, b), quantization and GEMM in one launch."""
    return linear_small_m(a, w_fp8, w_scale, bias, e8m0, b=b, activation=activation, alpha=alpha, limit=limit)


def gated_linear_large_m(
    a, b, w_fp8, w_scale, bias=None, e8m0=False, activation="silu", alpha=1.702, limit=7.0
):
    """Triton act(a, b) + 1x128 quantization in one pass, then gemm_large_m."""
    a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    h_fp8, h_scale = quant_act(a2, e8m0, b=b2, activation=activation, alpha=alpha, limit=limit)
    return gemm_large_m(h_fp8, h_scale, w_fp8, w_scale, bias, a.dtype).reshape(*a.shape[:-1], w_fp8.shape[0])
