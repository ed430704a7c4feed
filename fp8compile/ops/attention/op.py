"""fp8compile::gqa_decode_attention: grouped-query decode attention split along the keys, as an
op Inductor launches itself (a torch.library.triton_op: traced, its body is the launches of
the split kernel and, with more than one chunk, of the combine kernel).

Its definition is sdpa over repeat_kv'd keys and values with the query heads of a K/V head as
its rows (passes/gqa_attention.grouped_sdpa); the kernel is ops/attention/triton_attention.py. The chunk
length is fixed when the op is traced, from the batch and key count it sees (their hints when
symbolic), so one compiled graph computes every batch with one order of summation.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import triton_op, wrap_triton

from ...numerics import size_hint
from . import triton_attention


@triton_op("fp8compile::gqa_decode_attention", mutates_args=())
def gqa_decode_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, rep: int, chunk: int = 0
) -> Tensor:
    """q (B, KV, R, D), R = rep x S query rows per K/V head (row r: head rep * g + r // S, token
    r % S); k, v (B, KV, L, D); mask None, or boolean or additive broadcasting to (B, KV * rep,
    S, L) -> (B, KV, R, D) in q's dtype. chunk: keys per program (a multiple of
    triton_attention.BLOCK_L; 0 = triton_attention.chunk_keys's choice)."""
    launch = triton_attention.launch_on(q.device, q.shape[2], q.shape[3], mask)
    if launch is None:  # the pass asks triton_attention.supports first
        raise ValueError(
            f"no launch of the split-KV kernel fits this GPU's shared memory at D = {q.shape[3]}"
        )
    return split_kv_attention(q, k, v, mask, scale, rep, chunk, launch)


def split_kv_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    scale: float,
    rep: int,
    chunk: int,
    launch: triton_attention.Launch,
) -> Tensor:
    """The op's body, launched as `launch` says (the op: triton_attention.launch_on's; `bench
    tune --kernels gqa_decode` times others); chunk a multiple of launch.block_l, or 0."""
    b, kv, rows, d = q.shape
    length = k.shape[2]
    if rows % rep:
        raise ValueError(f"{rows} query rows are not a multiple of rep = {rep}")
    s = rows // rep
    chunk = int(chunk)  # a constant of the trace (a symbolic one is specialized)
    if chunk == 0:
        chunk = triton_attention.chunk_keys(size_hint(length), size_hint(b), kv, q.device, launch)
    elif chunk % launch.block_l:
        raise ValueError(f"chunk = {chunk} is not a multiple of {launch.block_l}")
    if mask is not None:  # (B, H, S, L) through its strides: 0 where it broadcasts
        mask = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape)).expand(b, kv * rep, s, length)
    # The kernel reads the head dimension at unit stride; the pass hands it such keys and values
    # (triton_attention.supports), a direct caller may not.
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    chunks = -(-length // chunk)
    one = isinstance(chunks, int) and chunks == 1
    if one:
        o = torch.empty(b, kv, rows, d, dtype=q.dtype, device=q.device)
        lse = None
    else:
        o = torch.empty(b, kv, chunks, rows, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(b, kv, chunks, rows, dtype=torch.float32, device=q.device)
    programs = triton_attention.programs_to_fill(q.device, launch)
    grid, args, constexprs = triton_attention.gqa_decode_arguments(
        q, k, v, mask, o, lse, scale, rep, chunk, programs, launch.block_l
    )
    wrap_triton(triton_attention._gqa_decode_kernel)[grid](
        *args, **constexprs, num_warps=launch.num_warps, num_stages=launch.num_stages
    )
    if one:
        return o
    out = torch.empty(b, kv, rows, d, dtype=q.dtype, device=q.device)
    grid, args, constexprs = triton_attention.combine_arguments(o, lse, out)
    wrap_triton(triton_attention._gqa_combine_kernel)[grid](*args, **constexprs, num_warps=4)
    return out
