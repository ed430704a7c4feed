"""Triton routed-experts kernels: the "triton" backend of fp8compile::moe (twin of reference.moe_block).

One call, T tokens routed to k experts each (S = T * k slots):
  1. route:   slots sorted by expert, each expert's run padded to a multiple of BLOCK_M
              (`slots`, with S on padding), and the expert of every BLOCK_M-row block
              (`block_expert`, -1 past the end). No host sync: the sizes depend on S and E
              only, so the call can be captured in a CUDA graph. Decode: one Triton program
              (a histogram, prefix sums, a sort); more slots: per-chunk histograms, one scan,
              then every slot placed by its chunk (three launches).
  2. quantize x 1x128 once per token (not per slot).
  3. grouped GEMM 1: each program takes one row block of one expert and one 128-wide N tile;
              it reads its rows of x_fp8 through the slot -> token map (no permuted copy of x)
              and writes gate|up rows at their slot, bias added.
  4. act(gate, up) in fp32 and its 1x128 quantization in one pass (triton_quant).
  5. grouped GEMM 2, the same kernel over the slots.
  6. per token, the sum over its k slots of routing weight x (output + bias), in fp32 and in
              slot order: deterministic.
Padding costs at most BLOCK_M - 1 rows per active expert; BLOCK_M follows the tokens per
expert (16 for decode, up to 64), so decode does not pay for 128-row blocks.

From GLUON_MIN_SLOTS_PER_EXPERT slots per expert on an sm_90 GPU (moe_gluon), steps 3 and 5 are
gluon_gemm's warp-specialized grouped GEMM instead: TMA cannot gather rows through the slot map,
so the tokens are quantized straight into routed order (gather_quant), and the top-k sum reads
each slot's row back through the inverse map. Same 128-wide products, scaled per group, as the
Triton kernel's path (calc_diff < 1e-4 between them), and DeepGEMM's numbers (calc_diff 0.0
between the two ops on an H100).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...numerics import AMAX_EPS, BLOCK, FP8_DTYPE, FP8_MAX, ceil_div, next_pow2
from ..launch import Launcher
from .tiles import (  # noqa: F401  (the tile choices, triton-free for the passes; named here too)
    BATCH_INVARIANT_BLOCK_M,
    BLOCK_M_CHOICES,
    GLUON_MIN_SLOTS_PER_EXPERT,
    ROUTE_CHUNK,
    ROUTE_KERNEL_MAX_SLOTS,
    ROUTE_ONE_PROGRAM_MAX_SLOTS,
    block_m_for,
    route_capacity,
)
from ..activations import act_operands
from ..quant.triton_quant import quant_act, quant_group


def route(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1. On the GPU, Triton kernels: one program up to ROUTE_ONE_PROGRAM_MAX_SLOTS slots
    (decode pays one launch), three launches over chunks of slots above; torch ops on the CPU.
    All give the same tensors, element for element."""
    if not topk_ids.is_cuda:
        return route_torch(topk_ids, num_experts, block_m)
    if topk_ids.numel() <= ROUTE_ONE_PROGRAM_MAX_SLOTS:
        return route_kernel(topk_ids, num_experts, block_m)
    return route_chunked(topk_ids, num_experts, block_m)


def route_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots (R,) int32, block_expert (R / block_m,) int32) for topk_ids (T, k): rows sorted by
    expert, each expert's rows padded to a multiple of block_m. slots holds the slot index
    t * k + j of each row (S = T * k on padding); block_expert the expert of each block of
    block_m rows (-1 for blocks past the last expert). Ids outside [0, E) get no row.
    R = the most rows any routing can need, so shapes depend on S and E only."""
    s = topk_ids.numel()
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    bucket = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # E: dropped
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    capacity = route_capacity(s, num_experts, block_m)
    order = torch.argsort(bucket, stable=True)
    sorted_bucket = bucket[order]
    rank = torch.arange(s, device=device) - (counts.cumsum(0) - counts)[sorted_bucket]
    row_start = torch.cat([padded_end - padded, padded.new_zeros(1)])
    row = torch.where(
        sorted_bucket < num_experts, row_start[sorted_bucket] + rank, capacity
    )  # dropped: spare row
    slots = torch.full((capacity + 1,), s, dtype=torch.int32, device=device)
    slots.scatter_(0, row, order.int())
    block_start = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).int()
    return slots[:capacity], block_expert


@triton.jit
def _store_block_experts(
    block_expert_ptr, padded_end, offs_e, num_experts, capacity, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr
):
    """block_expert[b] = how many experts end at or before block b's first row (searchsorted
    right over padded_end), -1 past the last expert."""
    for b0 in range(0, capacity // BLOCK_M, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        ended = (padded_end[None, :] <= offs_b[:, None] * BLOCK_M) & (offs_e[None, :] < num_experts)
        e_of_b = tl.sum(ended.to(tl.int32), 1)
        tl.store(
            block_expert_ptr + offs_b,
            tl.where(e_of_b < num_experts, e_of_b, -1),
            mask=offs_b < capacity // BLOCK_M,
        )


@triton.jit
def _route_kernel(
    ids_ptr,
    slots_ptr,
    block_expert_ptr,
    num_slots,
    num_experts,
    capacity,
    BLOCK_M: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """route_torch in one program, for S <= BLOCK_S: a histogram, two prefix sums and one sort of
    (expert, slot) keys give every slot its row; no global memory between the steps."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_e = tl.arange(0, BLOCK_E)
    ids = tl.load(ids_ptr + offs_s, mask=offs_s < num_slots, other=-1).to(tl.int32)
    bucket = tl.where((ids >= 0) & (ids < num_experts), ids, num_experts)  # E: dropped or padding
    counts = tl.histogram(bucket, BLOCK_E)  # BLOCK_E > E: the dropped bucket has a bin too
    counts = tl.where(offs_e < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    count_start = tl.cumsum(counts, 0) - counts
    # Sorting the keys expert * BLOCK_S + slot orders slots by expert, then by slot: a stable sort.
    keys = tl.sort(bucket * BLOCK_S + offs_s)
    expert = keys // BLOCK_S
    routed = expert < num_experts
    e_safe = tl.where(routed, expert, 0)
    row = tl.gather(padded_end - padded, e_safe, 0) + offs_s - tl.gather(count_start, e_safe, 0)
    for r in range(0, capacity, BLOCK_S):
        tl.store(slots_ptr + r + offs_s, num_slots, mask=r + offs_s < capacity)
    tl.debug_barrier()  # padding written before the slots land on their rows
    tl.store(slots_ptr + row, keys % BLOCK_S, mask=routed)
    _store_block_experts(block_expert_ptr, padded_end, offs_e, num_experts, capacity, BLOCK_M, BLOCK_B)


_route_launch = Launcher(_route_kernel)


def route_kernel(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """route_torch in one launch (S <= ROUTE_KERNEL_MAX_SLOTS): the same two tensors, element for element."""
    s = topk_ids.numel()
    if s > ROUTE_KERNEL_MAX_SLOTS:
        raise ValueError(f"route_kernel serves up to {ROUTE_KERNEL_MAX_SLOTS} slots, got {s}")
    capacity = route_capacity(s, num_experts, block_m)
    slots = torch.empty(capacity, dtype=torch.int32, device=topk_ids.device)
    block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=topk_ids.device)
    _run(
        _route_launch,
        *route_kernel_arguments(topk_ids.contiguous(), slots, block_expert, num_experts, block_m, s),
    )
    return slots, block_expert


def _run(launcher: Launcher, grid, args, constexprs, options) -> None:
    """launcher(...) on what an *_arguments function below returns."""
    launcher(grid, args, constexprs, **options)


def route_kernel_arguments(topk_ids, slots, block_expert, num_experts: int, block_m: int, max_slots: int):
    """(grid, args, constexprs, options) of _route_kernel routing topk_ids (contiguous) into slots
    and block_expert, its sort sized for up to max_slots slots. The one place its arguments are
    laid out: route_kernel launches them through our Launcher, moe_decode_op through wrap_triton."""
    block_s = max(16, next_pow2(max_slots))
    args = (topk_ids, slots, block_expert, topk_ids.numel(), num_experts, slots.shape[0])
    constexprs = dict(BLOCK_M=block_m, BLOCK_S=block_s, BLOCK_E=next_pow2(num_experts + 1), BLOCK_B=32)
    return (1,), args, constexprs, dict(num_warps=4 if block_s <= 1024 else 8)


@triton.jit
def _route_count_kernel(
    ids_ptr, hist_ptr, num_slots, num_experts, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr
):
    """hist[c, e] = slots of chunk c routed to expert e (bin E and above: routed nowhere)."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1).to(tl.int32)
    bucket = tl.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    tl.store(hist_ptr + c * BLOCK_E + tl.arange(0, BLOCK_E), tl.histogram(bucket, BLOCK_E))


_route_count_launch = Launcher(_route_count_kernel)


@triton.jit
def _route_scan_kernel(
    hist_ptr,
    start_ptr,
    slots_ptr,
    block_expert_ptr,
    num_slots,
    num_experts,
    num_chunks,
    capacity,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_FILL: tl.constexpr,
):
    """One program: hist[c, e] becomes the slots of expert e in chunks before c (a scan down the
    chunks), start[e] the first row of expert e; slots is filled with the padding value and
    block_expert written, as in _route_kernel."""
    offs_e = tl.arange(0, BLOCK_E)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        ptrs = hist_ptr + offs_c[:, None] * BLOCK_E + offs_e[None, :]
        in_range = offs_c[:, None] < num_chunks
        h = tl.load(ptrs, mask=in_range, other=0)
        tl.store(ptrs, counts[None, :] + tl.cumsum(h, 0) - h, mask=in_range)
        counts += tl.sum(h, 0)
    counts = tl.where(offs_e < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    tl.store(start_ptr + offs_e, padded_end - padded)
    for r in range(0, capacity, BLOCK_FILL):
        offs_r = r + tl.arange(0, BLOCK_FILL)
        tl.store(slots_ptr + offs_r, num_slots, mask=offs_r < capacity)
    _store_block_experts(block_expert_ptr, padded_end, offs_e, num_experts, capacity, BLOCK_M, BLOCK_B)


_route_scan_launch = Launcher(_route_scan_kernel)


@triton.jit
def _route_place_kernel(
    ids_ptr,
    hist_ptr,
    start_ptr,
    slots_ptr,
    num_slots,
    num_experts,
    CHUNK: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Each slot of chunk c to its row: its expert's first row + the expert's slots in earlier
    chunks + those earlier in this chunk (a stable order, as route_torch's sort)."""
    c = tl.program_id(0)
    offs_i = tl.arange(0, CHUNK)
    slot = c * CHUNK + offs_i
    ids = tl.load(ids_ptr + slot, mask=slot < num_slots, other=-1).to(tl.int32)
    routed = (ids >= 0) & (ids < num_experts)
    bucket = tl.where(routed, ids, num_experts)
    earlier_same = (bucket[:, None] == bucket[None, :]) & (offs_i[None, :] < offs_i[:, None])
    rank = tl.sum(earlier_same.to(tl.int32), 1)
    e = tl.where(routed, bucket, 0)
    row = tl.load(start_ptr + e) + tl.load(hist_ptr + c * BLOCK_E + e) + rank
    tl.store(slots_ptr + row, slot, mask=routed)


_route_place_launch = Launcher(_route_place_kernel)


def route_chunked(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """route_torch in three launches over chunks of ROUTE_CHUNK slots (count, scan, place), for
    any number of slots: the same two tensors, element for element."""
    s = topk_ids.numel()
    capacity = route_capacity(s, num_experts, block_m)
    slots = torch.empty(capacity, dtype=torch.int32, device=topk_ids.device)
    block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=topk_ids.device)
    scratch = route_chunked_scratch(s, num_experts, topk_ids.device)
    for launcher, launch in zip(
        (_route_count_launch, _route_scan_launch, _route_place_launch),
        route_chunked_arguments(topk_ids.contiguous(), slots, block_expert, *scratch, num_experts, block_m),
    ):
        _run(launcher, *launch)
    return slots, block_expert


def route_chunked_scratch(num_slots, num_experts: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(hist (chunks x BLOCK_E,), start (BLOCK_E,)) int32: the chunked routing's working memory,
    hist one row of BLOCK_E per chunk. num_slots >= 1 may be symbolic (moe_gluon_op traces
    this): hist is flat because a (chunks, BLOCK_E) tensor has a dimension that may be 1, and
    checking its contiguity guards on it (chunks == 1, i.e. T <= 16 for top-4): the compiled
    graph would then hold only on one side of that and recompile past it."""
    block_e = next_pow2(num_experts + 1)
    chunks = ceil_div(num_slots, ROUTE_CHUNK)
    if isinstance(chunks, int):  # no slots: one chunk still fills the padding and block_expert
        chunks = max(1, chunks)
    hist = torch.empty(chunks * block_e, dtype=torch.int32, device=device)
    return hist, torch.empty(block_e, dtype=torch.int32, device=device)


def route_chunked_arguments(topk_ids, slots, block_expert, hist, start, num_experts: int, block_m: int):
    """The (grid, args, constexprs, options) of the count, scan and place launches routing
    topk_ids (contiguous, at least one slot) into slots and block_expert; the one place their
    arguments are laid out (route_chunked, moe_gluon_op)."""
    s = topk_ids.numel()
    block_e = start.shape[0]
    num_chunks = hist.shape[0] // block_e
    capacity = slots.shape[0]
    return (
        ((num_chunks,), (topk_ids, hist, s, num_experts), dict(CHUNK=ROUTE_CHUNK, BLOCK_E=block_e), {}),
        (
            (1,),
            (hist, start, slots, block_expert, s, num_experts, num_chunks, capacity),
            dict(
                BLOCK_M=block_m, BLOCK_C=max(1, 8192 // block_e), BLOCK_E=block_e, BLOCK_B=32, BLOCK_FILL=1024
            ),
            dict(num_warps=8),
        ),
        (
            (num_chunks,),
            (topk_ids, hist, start, slots, s, num_experts),
            dict(CHUNK=ROUTE_CHUNK, BLOCK_E=block_e),
            {},
        ),
    )


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    a_s_ptr,
    w_ptr,
    w_s_ptr,
    bias_ptr,
    c_ptr,
    slots_ptr,
    block_expert_ptr,
    num_slots,
    K,
    rows_per_a,
    stride_am,
    stride_asm,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_be,
    stride_cm,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """c[slot, n tile] = a[slot // rows_per_a] @ w[e].T (block-scaled) + bias[e] for the rows of one block."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    slots = tl.load(slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < num_slots
    rows = tl.where(valid, slots, 0) // rows_per_a  # padding rows read row 0 and are never stored
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    a_s_ptrs = a_s_ptr + rows * stride_asm
    w_s_ptrs = w_s_ptr + e * stride_wse + pid_n * stride_wsn  # BLOCK_N = 128: one weight scale per K group
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, K // BLOCK_K):
        a = tl.load(a_ptrs)
        w = tl.load(w_ptrs)
        acc += tl.dot(a, w) * tl.load(a_s_ptrs + g)[:, None] * tl.load(w_s_ptrs + g)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e * stride_be + offs_n).to(tl.float32)[None, :]
    c_ptrs = c_ptr + slots.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None])


_moe_gemm_launch = Launcher(_moe_gemm_kernel)


@triton.jit
def _gather_quant_kernel(
    x_ptr,
    slots_ptr,
    block_expert_ptr,
    a_ptr,
    a_s_ptr,
    rows_ptr,
    num_slots,
    rows_per_a,
    stride_xm,
    stride_am,
    stride_asm,
    eps,
    fp8_max,
    E8M0: tl.constexpr,
    BLOCK_M: tl.constexpr,
    GROUP: tl.constexpr,
):
    """Rows [i * BLOCK_M, (i + 1) * BLOCK_M) of a, group program_id(1): x's row
    slot // rows_per_a for each slot of block i, quantized (quant_group, the numbers of
    quant_act on that row); padding rows quantize zeros. Group 0 also writes rows[slot], the
    slot's row of a. Blocks of no expert: nothing."""
    eps, fp8_max = tl.cast(eps, tl.float32), tl.cast(fp8_max, tl.float32)
    i = tl.program_id(0)
    if tl.load(block_expert_ptr + i) < 0:
        return
    g = tl.program_id(1)
    offs_m = i * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(slots_ptr + offs_m)
    valid = slots < num_slots
    src = (tl.where(valid, slots, 0) // rows_per_a).to(tl.int64)
    cols = g * GROUP + tl.arange(0, GROUP)
    x = tl.load(x_ptr + src[:, None] * stride_xm + cols[None, :], mask=valid[:, None], other=0.0).to(
        tl.float32
    )
    x_fp8, scale = quant_group(x, eps, fp8_max, E8M0)
    tl.store(a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + cols[None, :], x_fp8)
    tl.store(a_s_ptr + offs_m * stride_asm + g, scale)
    if g == 0:
        tl.store(rows_ptr + slots, offs_m, mask=valid)


_gather_quant_launch = Launcher(_gather_quant_kernel)


def gather_quant(x, slots, block_expert, num_slots: int, rows_per_a: int, block_m: int, e8m0: bool = False):
    """(a (R, K) fp8, a_scale (R, K/128) fp32, rows (S,) int32) in routed order: row r of a is x's
    row slots[r] // rows_per_a quantized 1x128 (bit for bit quant_act's row; zeros quantized on
    padding; rows of blocks of no expert unwritten), and rows[slot] the row that holds slot
    (unwritten for slots routed nowhere). What the grouped Gluon GEMM reads with TMA, which
    cannot gather rows through slots itself; one pass where quantizing and gathering took two."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    r, k = slots.numel(), x.shape[1]
    a = torch.empty(r, k, dtype=FP8_DTYPE, device=x.device)
    a_scale = torch.empty(r, k // BLOCK, dtype=torch.float32, device=x.device)
    rows = torch.empty(num_slots, dtype=torch.int32, device=x.device)
    _run(
        _gather_quant_launch,
        *gather_quant_arguments(x, slots, block_expert, a, a_scale, rows, rows_per_a, block_m, e8m0),
    )
    return a, a_scale, rows


def gather_quant_arguments(
    x, slots, block_expert, a, a_scale, rows, rows_per_a: int, block_m: int, e8m0: bool
):
    """(grid, args, constexprs, options) of _gather_quant_kernel (x row-major); the one place its
    arguments are laid out (gather_quant, moe_gluon_op)."""
    r, k = a.shape
    args = (
        x,
        slots,
        block_expert,
        a,
        a_scale,
        rows,
        rows.shape[0],
        rows_per_a,
        x.stride(0),
        a.stride(0),
        a_scale.stride(0),
        AMAX_EPS,
        FP8_MAX,
    )
    return (r // block_m, k // BLOCK), args, dict(E8M0=e8m0, BLOCK_M=block_m, GROUP=BLOCK), dict(num_warps=4)


@triton.jit
def _topk_sum_kernel(
    c_ptr,
    rows_ptr,
    ids_ptr,
    weights_ptr,
    bias_ptr,
    out_ptr,
    H,
    num_experts,
    stride_cm,
    stride_be,
    stride_om,
    TOP_K: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """out[t] = sum_j weights[t, j] * (c[row of slot t*k+j] + bias[e]) over the slots routed to
    an expert in [0, E), in fp32 and in slot order."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        slot = t * TOP_K + j
        e = tl.load(ids_ptr + slot).to(tl.int64)
        if (e >= 0) & (e < num_experts):
            row = tl.load(rows_ptr + slot).to(tl.int64) if HAS_ROWS else slot.to(tl.int64)
            y = tl.load(c_ptr + row * stride_cm + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                y += tl.load(bias_ptr + e * stride_be + offs, mask=mask, other=0.0).to(tl.float32)
            acc += y * tl.load(weights_ptr + slot).to(tl.float32)
    tl.store(out_ptr + t * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


_topk_sum_launch = Launcher(_topk_sum_kernel)


def topk_sum(
    c: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    bias: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    out_dtype=torch.bfloat16,
) -> torch.Tensor:
    """Step 6: (T, H) from the per-slot outputs c (rows[slot], or row = slot if rows is None)."""
    t = topk_ids.shape[0]
    out = torch.empty(t, c.shape[1], dtype=out_dtype, device=c.device)
    if t:
        _run(
            _topk_sum_launch,
            *topk_sum_arguments(
                c, topk_ids.contiguous(), topk_weights.contiguous(), num_experts, bias, rows, out
            ),
        )
    return out


def topk_sum_arguments(c, topk_ids, topk_weights, num_experts: int, bias, rows, out):
    """(grid, args, constexprs, options) of _topk_sum_kernel writing out (T, H) (ids and weights
    contiguous); the one place its arguments are laid out (topk_sum, moe_decode_op)."""
    t, k = topk_ids.shape
    h = c.shape[1]
    block_h = min(1024, next_pow2(h))
    args = (
        c,
        topk_ids if rows is None else rows,
        topk_ids,
        topk_weights,
        c if bias is None else bias,
        out,
        h,
        num_experts,
        c.stride(0),
        0 if bias is None else bias.stride(0),
        out.stride(0),
    )
    constexprs = dict(TOP_K=k, HAS_ROWS=rows is not None, HAS_BIAS=bias is not None, BLOCK_H=block_h)
    return (t, ceil_div(h, block_h)), args, constexprs, dict(num_warps=4)


def grouped_gemm(
    a, a_scale, w_fp8, w_scale, bias, slots, block_expert, num_slots: int, rows_per_a: int, block_m: int
) -> torch.Tensor:
    """(S, N) bf16: row `slot` = a[slot // rows_per_a] @ w[expert of its block].T (+ bias); rows of
    slots routed nowhere are left unwritten."""
    c = torch.empty(num_slots, w_fp8.shape[1], dtype=torch.bfloat16, device=a.device)
    _run(
        _moe_gemm_launch,
        *grouped_gemm_arguments(
            a, a_scale, w_fp8, w_scale, bias, c, slots, block_expert, num_slots, rows_per_a, block_m
        ),
    )
    return c


def grouped_gemm_arguments(
    a, a_scale, w_fp8, w_scale, bias, c, slots, block_expert, num_slots, rows_per_a, block_m: int
):
    """(grid, args, constexprs, options) of _moe_gemm_kernel writing c (S, N); the one place its
    arguments are laid out (grouped_gemm, moe_decode_op)."""
    k = w_fp8.shape[2]
    args = (
        a,
        a_scale,
        w_fp8,
        w_scale,
        c if bias is None else bias,
        c,
        slots,
        block_expert,
        num_slots,
        k,
        rows_per_a,
        a.stride(0),
        a_scale.stride(0),
        w_fp8.stride(0),
        w_fp8.stride(1),
        w_scale.stride(0),
        w_scale.stride(1),
        0 if bias is None else bias.stride(0),
        c.stride(0),
    )
    constexprs = dict(HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=BLOCK, BLOCK_K=BLOCK)
    return (block_expert.shape[0], w_fp8.shape[1] // BLOCK), args, constexprs, dict(num_warps=4, num_stages=3)


def _gluon_runs(x, w13_fp8, w2_fp8, num_slots: int, batch_invariant: bool) -> bool:
    if batch_invariant or num_slots < GLUON_MIN_SLOTS_PER_EXPERT * w13_fp8.shape[0] or not x.is_cuda:
        return False
    # What the Gluon kernel accepts depends on the weights' layouts and the GPU only: asked once
    # per layout, not on every call (33 us of host time a call on an H100 lease's host).
    key = (_layout_key(w13_fp8), _layout_key(w2_fp8), x.get_device())
    fits = _GLUON_FITS.get(key)
    if fits is None:
        from ..linear import gluon_gemm

        fits = _GLUON_FITS[key] = all(
            gluon_gemm.why_not_grouped(torch.empty(0, w.shape[2], dtype=w.dtype, device=x.device), w) is None
            for w in (w13_fp8, w2_fp8)
        )
    return fits


_GLUON_FITS: dict[tuple, bool] = {}


def _layout_key(w: torch.Tensor) -> tuple:
    return tuple(w.shape), w.stride(), w.dtype, w.data_ptr() % 16 == 0


def moe_gluon(
    x,
    topk_ids,
    topk_weights,
    w13_fp8,
    w13_scale,
    w2_fp8,
    w2_scale,
    b13=None,
    b2=None,
    e8m0=False,
    activation="silu",
    alpha=1.702,
    limit=7.0,
    config=None,
):
    """Steps 1-6 with the GEMMs of gluon_gemm.grouped_gemm: the tokens are quantized into
    routed order in one pass (gather_quant), both GEMMs run on row blocks of that order (64 or 128
    rows: gluon_gemm.grouped_config, or config), and the top-k sum reads each slot's row
    through the `rows` map."""
    from ..linear import gluon_gemm

    t, k = topk_ids.shape
    num_experts, n13, _ = w13_fp8.shape
    s = t * k
    config = config or gluon_gemm.grouped_config(n13, w2_fp8.shape[1])
    block_m = config["BLOCK_M"]
    slots, block_expert = route(topk_ids, num_experts, block_m)
    a, a_scale, rows = gather_quant(x, slots, block_expert, s, k, block_m, e8m0)
    c1 = gluon_gemm.grouped_gemm(a, a_scale, w13_fp8, w13_scale, block_expert, b13, config=config)
    del a, a_scale
    gate, up = act_operands(c1, activation)
    h_fp8, h_scale = quant_act(gate, e8m0, "row", b=up, activation=activation, alpha=alpha, limit=limit)
    del c1, gate, up  # freed before c2 is made: see moe_triton
    c2 = gluon_gemm.grouped_gemm(h_fp8, h_scale, w2_fp8, w2_scale, block_expert, config=config)
    return topk_sum(c2, topk_ids, topk_weights, num_experts, b2, rows=rows, out_dtype=x.dtype)


def moe_triton(
    x,
    topk_ids,
    topk_weights,
    w13_fp8,
    w13_scale,
    w2_fp8,
    w2_scale,
    b13=None,
    b2=None,
    e8m0=False,
    activation="silu",
    alpha=1.702,
    limit=7.0,
    batch_invariant=False,
):
    """fp8compile::moe on the GPU (see the module docstring for the steps)."""
    t, k = topk_ids.shape
    num_experts = w13_fp8.shape[0]
    s = t * k
    if s == 0:
        return x.new_zeros(x.shape)
    if _gluon_runs(x, w13_fp8, w2_fp8, s, batch_invariant):
        return moe_gluon(
            x,
            topk_ids,
            topk_weights,
            w13_fp8,
            w13_scale,
            w2_fp8,
            w2_scale,
            b13,
            b2,
            e8m0,
            activation,
            alpha,
            limit,
        )
    block_m = block_m_for(s, num_experts, batch_invariant)
    slots, block_expert = route(topk_ids, num_experts, block_m)
    x_fp8, x_scale = quant_act(x.contiguous(), e8m0, "row")
    c1 = grouped_gemm(x_fp8, x_scale, w13_fp8, w13_scale, b13, slots, block_expert, s, k, block_m)
    gate, up = act_operands(c1, activation)
    h_fp8, h_scale = quant_act(gate, e8m0, "row", b=up, activation=activation, alpha=alpha, limit=limit)
    # The grouped buffers have a row for every slot plus each expert's padding to a whole block
    # (Qwen3-30B-A3B, 1024 tokens in 64-row blocks: 16256 rows; its gate|up products 50 MB, the
    # down projections' 67 MB). Dropped here, c1 is freed before c2 is made, not held beside it
    # to the end of the call.
    del c1, gate, up
    c2 = grouped_gemm(h_fp8, h_scale, w2_fp8, w2_scale, None, slots, block_expert, s, 1, block_m)
    return topk_sum(c2, topk_ids, topk_weights, num_experts, b2, out_dtype=x.dtype)
