"""The sum all-reduce on symmetric memory with no barrier, alone or with the residual add and the
RMSNorm after it, in one Triton kernel: each rank pushes its row into every peer's buffer and
waits on the values themselves. What follows a row-sharded linear (o or down projection) in a
tensor-parallel decoder, where otherwise a step runs symmetric memory's one-shot all-reduce, then
Inductor's kernel for the residual add and the RMSNorm.

As in TensorRT-LLM's "Lamport" one-shot all-reduce, a rank writes its row straight into its slot
of every peer's buffer and reads the rows it needs from its own memory: one crossing of NVLink. A
kernel that pulled instead (each rank staging its row in its own buffer, meeting every peer on
the signal pads, reading each peer's row, and meeting them again before the buffer could be
written anew: three round trips) took 7.2 us for a row of 4096 at two ranks where this one takes
4.7 with the norm (`bench allreduce`), and a TP2 step of Llama-3-8B widths at batch 1 2.61 ms
with it against 2.44-2.45 with this one (2 x H200, BENCHMARKS.md, "Tensor parallel at 32 layers:
the all-reduce pushed"). Symmetric memory's one-shot kernel, which reads every peer's buffer
between two barriers, took 6.6 us for the sum alone there, and more than this kernel with the
norm at every size measured (up to 128 rows of 4096 and 64 of 8192), so the sum alone runs here
too.

What makes it safe:
- Every element of a buffer holds either a peer's value or the sentinel, -0.0 (its bits: the
  sign bit alone; symmetric.SENTINEL_BITS). A rank waits until no element of the slots it reads
  holds the sentinel. So a value pushed as -0.0 travels as +0.0: the sum of partials changes
  only where every partial was a zero (then +0.0 where NCCL could give -0.0).
- Having read its slots, a rank puts the sentinel back in them.
- A buffer is three thirds, taken in turn by the calls (an epoch: each rank's own count of its
  calls, in its own memory, advanced by the last of a call's programs to finish). Every rank makes
  the same calls in the same order, so the counts agree. A peer runs at most one call ahead of
  this rank (its next call waits on this rank's row of this one), so while this rank reads a
  third, a peer pushes into the next one at most, which this rank read and cleared two calls
  before, in a kernel that ended before this one began.
- The buffers hold the sentinel before any kernel runs: symmetric.push_buffers fills them and
  waits for the device before the rendezvous lets a peer write.

Rounding follows the eager model: the partials added in fp32 in rank order (the same bits on
every rank, and at two ranks NCCL's) and rounded to the dtype once, the residual sum rounded, the
normalized row rounded before the weight multiplies it (transformers' RMSNorm).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...numerics import next_pow2
from .symmetric import SENTINEL_BITS, THIRDS

NUM_WARPS = 8
# Each rank's buffer is a pointer argument of its own (b0 ... b7): Triton then knows their alignment
# and writes a peer 16 bytes a store. Passed as integers from a table, a buffer was accessed one
# bf16 at a time (2 x H200, 2026-11-29: the fused step 1.04x slower than unfused).
MAX_WORLD = 8


@triton.jit
def _buffer(b0, b1, b2, b3, b4, b5, b6, b7, RANK: tl.constexpr):
    """Rank RANK's buffer among the arguments (RANK known when the kernel compiles)."""
    if RANK == 0:
        return b0
    elif RANK == 1:
        return b1
    elif RANK == 2:
        return b2
    elif RANK == 3:
        return b3
    elif RANK == 4:
        return b4
    elif RANK == 5:
        return b5
    elif RANK == 6:
        return b6
    else:
        return b7


@triton.jit
def _push_all_reduce_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    normed_ptr,
    summed_ptr,
    own_ptr,
    b0,
    b1,
    b2,
    b3,
    b4,
    b5,
    b6,
    b7,
    epoch_ptr,
    rank,
    rows,
    H,
    third_numel,
    eps,
    WORLD: tl.constexpr,
    BITS: tl.constexpr,
    SENTINEL: tl.constexpr,
    NORM: tl.constexpr,
    THIRDS_OF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """NORM: normed = weight * rms_norm(residual + sum), summed = residual + sum; else summed =
    the sum alone (residual, weight and normed unread)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    offsets = row.to(tl.int64) * H + cols
    dtype = x_ptr.dtype.element_ty
    bits_type = tl.int16 if BITS == 16 else tl.int32
    epoch = tl.load(epoch_ptr, volatile=True)
    third = (epoch % THIRDS_OF).to(tl.int64) * third_numel
    slots = third + row.to(tl.int64) * WORLD * H  # this row's slots, one a rank, in every buffer

    # this rank's row into its slot of every buffer, the sentinel's bits sent as +0.0
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    x = tl.where(x.to(bits_type, bitcast=True) == SENTINEL, tl.zeros_like(x), x)
    for peer in tl.static_range(WORLD):
        tl.store(_buffer(b0, b1, b2, b3, b4, b5, b6, b7, peer) + slots + rank * H + cols, x, mask=mask)

    total = tl.zeros([BLOCK], tl.float32)
    for peer in tl.static_range(WORLD):  # rank order on every rank: the same bits everywhere
        theirs = own_ptr + slots + peer * H + cols
        value = tl.load(theirs, mask=mask, other=0.0, volatile=True)
        while tl.max(((value.to(bits_type, bitcast=True) == SENTINEL) & mask).to(tl.int32), axis=0) > 0:
            value = tl.load(theirs, mask=mask, other=0.0, volatile=True)
        total += value.to(tl.float32)
    sentinel = tl.full([BLOCK], SENTINEL, bits_type).to(dtype, bitcast=True)
    for peer in tl.static_range(WORLD):  # read: the slots wait for the call three epochs on
        tl.store(own_ptr + slots + peer * H + cols, sentinel, mask=mask)

    if NORM:
        reduced = total.to(dtype).to(tl.float32)
        summed = (tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32) + reduced).to(dtype)
        tl.store(summed_ptr + offsets, summed, mask=mask)
        h = summed.to(tl.float32)
        normalized = (h * tl.rsqrt(tl.sum(h * h, axis=0) / H + eps)).to(dtype)
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(normed_ptr + offsets, (weight * normalized.to(tl.float32)).to(dtype), mask=mask)
    else:
        tl.store(summed_ptr + offsets, total.to(dtype), mask=mask)

    # the last program of the call advances the epoch (every program read it before arriving)
    arrived = tl.atomic_add(epoch_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if arrived == rows - 1:
        tl.store(epoch_ptr + 1, 0)
        tl.store(epoch_ptr, epoch + 1)


def fits(rows: int, width: int, world: int, buffer_numel: int) -> bool:
    """Whether a call of (rows, width) at `world` ranks fits a third of a buffer of that many
    elements."""
    return rows * world * width <= buffer_numel // THIRDS


def all_reduce_rms_norm(
    x: Tensor,
    residual: Tensor,
    weight: Tensor,
    eps: float,
    buffers: tuple[Tensor, ...],
    epoch: Tensor,
    rank: int,
) -> tuple[Tensor, Tensor]:
    """(weight * rms_norm(residual + sum over ranks of x), residual + that sum) for x and residual
    (M, H) contiguous. buffers: every rank's push buffer as a flat tensor of x's dtype on x's
    device, in rank order (at most MAX_WORLD), holding the sentinel where no call has pushed;
    epoch: this rank's int32 pair (calls made, programs of this call done), zeros at first.
    Every rank of the group calls it (or all_reduce_sum) with the same M and H, in the same order."""
    normed, summed = torch.empty_like(x), torch.empty_like(x)
    _launch(x, residual, weight, normed, summed, eps, buffers, epoch, rank, norm=True)
    return normed, summed


def all_reduce_sum(x: Tensor, buffers: tuple[Tensor, ...], epoch: Tensor, rank: int) -> Tensor:
    """The sum over ranks of x (M, H) contiguous, a new tensor; buffers, epoch and the order of
    calls as all_reduce_rms_norm's, whose calls it shares them with."""
    out = torch.empty_like(x)
    _launch(x, x, x[0], out, out, 0.0, buffers, epoch, rank, norm=False)
    return out


def _launch(x, residual, weight, normed, summed, eps, buffers, epoch, rank, norm: bool) -> None:
    m, h = x.shape
    world = len(buffers)
    if not 1 <= world <= MAX_WORLD:
        raise ValueError(f"the push all-reduce takes 1 to {MAX_WORLD} ranks, got {world}")
    numel = buffers[rank].numel()
    if not fits(m, h, world, numel):
        raise ValueError(f"{m} rows of {h} at {world} ranks do not fit a third of {numel} elements")
    bits = x.element_size() * 8
    peers = (*buffers, *(buffers[0],) * (MAX_WORLD - world))
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        _push_all_reduce_kernel[(m,)](
            x,
            residual,
            weight,
            normed,
            summed,
            buffers[rank],
            *peers,
            epoch,
            rank,
            m,
            h,
            numel // THIRDS,
            eps,
            WORLD=world,
            BITS=bits,
            SENTINEL=SENTINEL_BITS[bits],
            NORM=norm,
            THIRDS_OF=THIRDS,
            BLOCK=next_pow2(h),
            num_warps=NUM_WARPS,
        )
