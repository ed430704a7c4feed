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
previous one) and takes each peer's word in its own pad from 1 back to 0; every barrier leaves
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


@triton.jit
def _meet(pads, slot, rank, WORLD: tl.constexpr):
    """Every rank's program `slot` gets here before any goes on; what each wrote before is
    visible to every peer after."""
    tl.debug_barrier()  # the program's writes are done before its signal releases them
    for peer in tl.static_range(WORLD):
        theirs = tl.load(pads + peer).to(tl.pointer_type(tl.int32))
        while tl.atomic_cas(theirs + slot * WORLD + rank, 0, 1, sem="release", scope="sys") != 0:
            pass
    mine = tl.load(pads + rank).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD):
        while tl.atomic_cas(mine + slot * WORLD + peer, 1, 0, sem="acquire", scope="sys") != 1:
            pass
    tl.debug_barrier()


@triton.jit
def _all_reduce_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    normed_ptr,
    summed_ptr,
    buffers,
    pads,
    rank,
    H,
    eps,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    offsets = row.to(tl.int64) * H + cols
    dtype = x_ptr.dtype.element_ty
    mine = tl.load(buffers + rank).to(tl.pointer_type(dtype))
    tl.store(mine + offsets, tl.load(x_ptr + offsets, mask=mask), mask=mask)
    _meet(pads, row, rank, WORLD)
    total = tl.zeros([BLOCK], tl.float32)
    for peer in tl.static_range(WORLD):  # rank order on every rank: the same bits everywhere
        theirs = tl.load(buffers + peer).to(tl.pointer_type(dtype))
        total += tl.load(theirs + offsets, mask=mask, other=0.0, volatile=True).to(tl.float32)
    reduced = total.to(dtype).to(tl.float32)
    summed = (tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32) + reduced).to(dtype)
    tl.store(summed_ptr + offsets, summed, mask=mask)
    h = summed.to(tl.float32)
    normalized = (h * tl.rsqrt(tl.sum(h * h, axis=0) / H + eps)).to(dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(normed_ptr + offsets, (weight * normalized.to(tl.float32)).to(dtype), mask=mask)
    _meet(pads, row, rank, WORLD)  # every peer has read this rank's row: the buffer may be written again


def all_reduce_rms_norm(
    x: Tensor,
    residual: Tensor,
    weight: Tensor,
    eps: float,
    buffers: Tensor,
    pads: Tensor,
    rank: int,
    world: int,
) -> tuple[Tensor, Tensor]:
    """(weight * rms_norm(residual + sum over ranks of x), residual + that sum) for x and residual
    (M, H) contiguous, on symmetric memory whose buffers and signal pads every rank's pointers in
    `buffers` and `pads` (int64, on x's device) address; every rank of the group calls it with the
    same M and H. The caller checks that the rows fit the buffer and the pads (symmetric.py)."""
    m, h = x.shape
    normed, summed = torch.empty_like(x), torch.empty_like(x)
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        _all_reduce_rms_norm_kernel[(m,)](
            x,
            residual,
            weight,
            normed,
            summed,
            buffers,
            pads,
            rank,
            h,
            eps,
            WORLD=world,
            BLOCK=next_pow2(h),
            num_warps=NUM_WARPS,
        )
    return normed, summed
