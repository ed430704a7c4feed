"""The all-reduce, the residual add and the RMSNorm after it in one Triton kernel, on symmetric
memory: what follows a row-sharded linear (o or down projection) in a tensor-parallel decoder.

Unfused, a decode step runs three things there: symmetric memory's one-shot all-reduce (a kernel
and its barriers), then Inductor's kernel for the residual add and the RMSNorm, which reads the
sum back. Here one program a row: it writes its row of this rank's partial into the rank's
symmetric buffer, meets every peer's program of the same row (a barrier on the signal pads),
reads the row from every rank's buffer and adds them in rank order (fp32, rounded to the dtype
once, so every rank gets the same bits, and at two ranks NCCL's), adds the residual, and
normalizes the row; a second barrier keeps the buffer's row until every peer has read it.

The barrier is the one PyTorch's symmetric-memory kernels use on the same signal pads: a program
sets its word in each peer's pad from 0 to 1 (spinning while a peer has not yet taken the
previous one) and takes each peer's word in its own pad from 1 back to 0, every peer at once, a
thread each (one after another, the round trips added up); every barrier leaves
the pads as it found them, so these kernels and PyTorch's may share one buffer on one stream.
Rounding follows the eager model: the reduced partials rounded to the dtype, the residual sum
rounded, the normalized row rounded before the weight multiplies it (transformers' RMSNorm).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...numerics import next_pow2

NUM_WARPS = 8
# The kernel takes each rank's buffer as a pointer argument of its own (b0 ... b7): Triton then
# knows their alignment and reads a peer's row 16 bytes a load. Passed as integers from a table,
# the buffers were read one bf16 a load (ld.volatile.global.b16 in the PTX; 2 x H200, 2026-11-29:
# the step 1.04x slower fused than not, BENCHMARKS.md, "Tensor parallel at 32 layers").
MAX_WORLD = 8


# A value no signal word holds: a CAS that compares with it changes nothing (the lanes of _meet
# that are done, or that stand for no rank).
_NEVER: tl.constexpr = tl.constexpr(7)


@triton.jit
def _meet(pads, slot, rank, WORLD: tl.constexpr, PEERS: tl.constexpr):
    """Every rank's program `slot` gets here before any goes on; what each wrote before is
    visible to every peer after. One lane a peer (PEERS: WORLD rounded up to a power of two), so
    the signals to all peers, and then the waits on them, go out at once rather than one peer
    after another: each is a round trip over NVLink."""
    tl.debug_barrier()  # the program's writes are done before its signals release them
    lanes = tl.arange(0, PEERS)
    peer = tl.minimum(lanes, WORLD - 1)  # a lane past the world repeats the last rank, as a no-op
    theirs = tl.load(pads + peer).to(tl.pointer_type(tl.int32))
    _swap_each(theirs + slot * WORLD + rank, lanes < WORLD, 0, 1, "release")  # this rank's word in theirs
    mine = tl.load(pads + rank).to(tl.pointer_type(tl.int32))
    _swap_each(mine + slot * WORLD + peer, lanes < WORLD, 1, 0, "acquire")  # each peer's word in this pad
    tl.debug_barrier()


@triton.jit
def _swap_each(words, live, expect, new, SEM: tl.constexpr):
    """Each live lane's word from `expect` to `new` (sys-scope compare-and-swap, spinning until
    it holds `expect`); a lane done, or not live, compares with a value no word holds."""
    done = live == 0
    while tl.min(done.to(tl.int32), axis=0) == 0:
        old = tl.atomic_cas(
            words, tl.where(done, _NEVER, expect), tl.where(done, _NEVER, new), sem=SEM, scope="sys"
        )
        done = done | (old == expect)


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
def _all_reduce_rms_norm_kernel(
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
    pads,
    rank,
    H,
    eps,
    WORLD: tl.constexpr,
    PEERS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    offsets = row.to(tl.int64) * H + cols
    tl.store(own_ptr + offsets, tl.load(x_ptr + offsets, mask=mask), mask=mask)
    _meet(pads, row, rank, WORLD, PEERS)
    total = tl.zeros([BLOCK], tl.float32)
    for peer in tl.static_range(WORLD):  # rank order on every rank: the same bits everywhere
        theirs = _buffer(b0, b1, b2, b3, b4, b5, b6, b7, peer)
        # .cg: past this SM's L1, which may hold the row an earlier call read
        total += tl.load(theirs + offsets, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    reduced = total.to(dtype).to(tl.float32)
    summed = (tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32) + reduced).to(dtype)
    tl.store(summed_ptr + offsets, summed, mask=mask)
    h = summed.to(tl.float32)
    normalized = (h * tl.rsqrt(tl.sum(h * h, axis=0) / H + eps)).to(dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(normed_ptr + offsets, (weight * normalized.to(tl.float32)).to(dtype), mask=mask)
    # every peer has read this rank's row: the buffer may be written again
    _meet(pads, row, rank, WORLD, PEERS)


def all_reduce_rms_norm(
    x: Tensor,
    residual: Tensor,
    weight: Tensor,
    eps: float,
    buffers: tuple[Tensor, ...],
    pads: Tensor,
    rank: int,
) -> tuple[Tensor, Tensor]:
    """(weight * rms_norm(residual + sum over ranks of x), residual + that sum) for x and residual
    (M, H) contiguous. buffers: every rank's symmetric buffer as a tensor of x's dtype on x's
    device, in rank order (at most MAX_WORLD); pads: every rank's signal pad address (int64, on
    x's device). Every rank of the group calls it with the same M and H; the caller checks that
    the rows fit the buffer and the pads (op.py)."""
    m, h = x.shape
    world = len(buffers)
    if not 1 <= world <= MAX_WORLD:
        raise ValueError(f"all_reduce_rms_norm takes 1 to {MAX_WORLD} ranks, got {world}")
    normed, summed = torch.empty_like(x), torch.empty_like(x)
    peers = (*buffers, *(buffers[0],) * (MAX_WORLD - world))
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        _all_reduce_rms_norm_kernel[(m,)](
            x,
            residual,
            weight,
            normed,
            summed,
            buffers[rank],
            *peers,
            pads,
            rank,
            h,
            eps,
            WORLD=world,
            PEERS=max(2, next_pow2(world)),
            BLOCK=next_pow2(h),
            num_warps=NUM_WARPS,
        )
    return normed, summed
