"""Triton kernels of the FP8 MQA logits (mqa_logits/reference.py has the definitions and layouts).

Both kernels treat a query token's H heads as H rows of q in one FP8 tensor-core GEMM against a
tile of keys, in fp32, then relu, times each head's weight, summed over each token's heads,
times each key's scale. The weights arrive with q's scales already folded in (a positive scale
passes through the relu), so the epilogue holds one multiply per head and one per key.

mqa_logits (contiguous keys, prefill): one program per block of BLOCK_Q tokens, its
(BLOCK_Q * H, D) queries held for the whole program, streams the keys that the block's windows
reach, BLOCK_N at a time, with STAGES tiles of keys in flight: S^T = k_tile (BLOCK_N, D) @ q^T,
so the keys are the GEMM's rows and a token's sum over its heads runs along each thread's own
registers and two lane shuffles (with the heads as rows it crossed warps). Blocks of the last
tokens start first (in a causal prefill their windows are the longest). In the compressed
layout (max_seqlen_k > 0) each token reads its own keys (ks[m] + j), so a program holds one
token. On an H100 this gives DeepGEMM's time at prefill (0.98x at M = N = 4096, 1.01x at 8192);
the earlier one-tile-per-program kernel gave 0.27x (BENCHMARKS.md, "Indexer logits").

paged_mqa_logits (decode): one program per (sequence, SPLIT positions): it holds the sequence's
next_n * H queries and streams its positions BLOCK_N keys a step, each key found through the
block table (a step may span several cache blocks), with the same keys-as-rows GEMM and STAGES
steps of keys in flight; with clean_logits it writes -inf past the sequence's length, so every
position below max_context_len is written by some program. The schedule metadata of the op
(paged_schedule, an equal split of the work for a persistent kernel) is not read: the grid
splits by position, and the GPU's own scheduler spreads the programs. On an H100: 2.1-3.3x the
earlier persistent kernel (one 64-key block at a time, heads as rows); with 128 keys a step and
two stages (the sweep's choice, _paged_tiles) 0.86-1.34x the speed of DeepGEMM's paged kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...numerics import next_pow2
from ..launch import num_sms
from .reference import index_cache_views, schedule_split


@triton.jit
def _mqa_logits_kernel(
    q_ptr,
    k_ptr,
    k_s_ptr,
    w_ptr,
    ks_ptr,
    ke_ptr,
    out_ptr,
    M,
    N,
    N_OUT,
    stride_om,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
    COMPRESSED: tl.constexpr,
    CLEAN: tl.constexpr,
):
    # The last token blocks first: in a causal prefill they hold the longest windows.
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    R: tl.constexpr = BLOCK_Q * H
    rows = pid * R + tl.arange(0, R)  # (token, head) rows of q (M * H, D)
    tokens = pid * BLOCK_Q + tl.arange(0, BLOCK_Q)
    token_ok = tokens < M
    ks = tl.load(ks_ptr + tokens, mask=token_ok, other=0)
    ke = tl.load(ke_ptr + tokens, mask=token_ok, other=0)
    if COMPRESSED:  # BLOCK_Q == 1: output column j is key ks + j, for j < ke - ks
        first = tl.sum(ks)
        lo = 0
        hi = tl.maximum(tl.minimum(tl.sum(ke), N) - first, 0)
    else:  # the columns are the keys; every window of the block lies in [lo, hi)
        first = 0
        hi = tl.max(tl.where(token_ok, ke, 0))
        lo = tl.minimum(tl.min(tl.where(token_ok, ks, N)), hi)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + rows[:, None].to(tl.int64) * D + d[None, :], mask=(rows < M * H)[:, None], other=0.0)
    w = tl.load(w_ptr + rows, mask=rows < M * H, other=0.0)
    j = tl.arange(0, BLOCK_N)
    out_rows = out_ptr + tokens[None, :].to(tl.int64) * stride_om
    lo_tile = (lo // BLOCK_N) * BLOCK_N
    for c0 in tl.range(lo_tile, hi, BLOCK_N, num_stages=STAGES):
        cols = c0 + j
        keys = first + cols
        key_ok = keys < N
        k = tl.load(k_ptr + keys[:, None].to(tl.int64) * D + d[None, :], mask=key_ok[:, None], other=0.0)
        # The keys are the GEMM's rows and the (token, head) pairs its columns, so a token's sum
        # over heads runs along each thread's registers and a few lanes, not across warps.
        s = tl.dot(k, tl.trans(q))  # (BLOCK_N, R) fp32
        s = tl.maximum(s, 0.0) * w[None, :]
        logits = tl.sum(tl.reshape(s, (BLOCK_N, BLOCK_Q, H)), axis=2)  # (BLOCK_N, BLOCK_Q)
        logits = logits * tl.load(k_s_ptr + keys, mask=key_ok, other=0.0)[:, None]
        if COMPRESSED:
            inside = (cols < hi)[:, None] & token_ok[None, :]
        else:
            inside = (cols[:, None] >= ks[None, :]) & (cols[:, None] < ke[None, :])
        store_ok = token_ok[None, :] & (cols < N_OUT)[:, None]
        if CLEAN:
            tl.store(out_rows + cols[:, None], tl.where(inside, logits, float("-inf")), mask=store_ok)
        else:
            tl.store(out_rows + cols[:, None], logits, mask=store_ok & inside)
    if CLEAN:  # the columns no window of the block reaches
        minus_inf = tl.full((BLOCK_N, BLOCK_Q), float("-inf"), tl.float32)
        for c0 in tl.range(0, lo_tile, BLOCK_N):
            tl.store(out_rows + (c0 + j)[:, None], minus_inf, mask=token_ok[None, :])
        hi_tile = tl.maximum(tl.cdiv(hi, BLOCK_N) * BLOCK_N, lo_tile)
        for c0 in tl.range(hi_tile, N_OUT, BLOCK_N):
            cols = c0 + j
            tl.store(out_rows + cols[:, None], minus_inf, mask=token_ok[None, :] & (cols < N_OUT)[:, None])


def _check_heads(h: int, d: int) -> None:
    if h & (h - 1) or d & (d - 1) or d < 16:
        raise ValueError(f"the Triton MQA kernels take a power-of-two H and D >= 16, got H={h}, D={d}")


def _mqa_tiles(h: int, compressed: bool, device: torch.device) -> tuple[int, int, int, int]:
    """(tokens a program holds, keys a step, warps, stages): 256 GEMM columns of (token, head)
    against 64 keys a step, one warpgroup, three stages of keys in flight (a compressed row reads
    keys of its own, so one token). Measured on an H100 at M = N = 4096 and 8192, causal, against
    nine other tilings (BENCHMARKS.md, "Indexer logits")."""
    block_q = 1 if compressed else max(1, 256 // h)
    if device.type == "cpu":  # the interpreter: small steps, so that ragged windows cross them
        return block_q, 32, 4, 1
    return block_q, 64, 4, 3


def mqa_logits(
    q_fp8: Tensor,
    k_fp8: Tensor,
    k_scale: Tensor,
    weights: Tensor,
    ks: Tensor,
    ke: Tensor,
    clean_logits: bool = True,
    max_seqlen_k: int = 0,
    tiles: tuple[int, int, int, int] | None = None,
) -> Tensor:
    """fp8compile::mqa_logits's Triton kernel (reference_mqa.mqa_logits defines it); tiles:
    (tokens a program holds, keys a step, warps, stages), default _mqa_tiles."""
    m, h, d = q_fp8.shape
    n = k_fp8.shape[0]
    _check_heads(h, d)
    n_out = max_seqlen_k if max_seqlen_k > 0 else n
    out = torch.empty(m, n_out, dtype=torch.float32, device=q_fp8.device)
    if m == 0 or n_out == 0:
        return out
    compressed = max_seqlen_k > 0
    block_q, block_n, warps, stages = tiles or _mqa_tiles(h, compressed, q_fp8.device)
    if compressed and block_q != 1:
        raise ValueError(
            f"the compressed layout reads keys of each token's own: one token a program, not {block_q}"
        )
    _mqa_logits_kernel[(triton.cdiv(m, block_q),)](
        q_fp8.contiguous(),
        k_fp8.contiguous(),
        k_scale.float().contiguous(),
        weights.float().contiguous(),
        ks.to(torch.int32).contiguous(),
        ke.to(torch.int32).contiguous(),
        out,
        m,
        n,
        n_out,
        out.stride(0),
        H=h,
        D=d,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        STAGES=stages,
        COMPRESSED=compressed,
        CLEAN=clean_logits,
        num_warps=warps,
    )
    return out


def _paged_tiles(batch: int, max_context_len: int, device: torch.device) -> tuple[int, int, int, int]:
    """(keys a step, keys a program, warps, stages) of the paged kernel: 128 keys a step, two
    stages, and enough positions a program (128 to 1024) for about four programs an SM. Measured
    (`bench tune --kernels mqa_paged`, H100, 2026-11-25 (833267e)): 128 keys a step and two stages
    were the best at all six of bench mqa's decode points, and this split the best or within 5% of
    it at each: 0.68-0.96x the time of the 64-key, three-stage tiling before."""
    if device.type == "cpu":  # the interpreter: small steps, so that blocks and lengths cross them
        return 16, 64, 4, 1
    per_program = batch * max_context_len // (4 * num_sms(device.index or 0))
    return 128, min(1024, max(128, next_pow2(max(per_program, 1)))), 4, 2


def schedule_programs(device: torch.device) -> int:
    """Programs of the persistent paged kernel: one per SM (4 under the CPU interpreter)."""
    return 4 if device.type == "cpu" else num_sms(device.index or 0)


@triton.jit
def _paged_mqa_logits_kernel(
    q_ptr,
    key_ptr,
    scale_ptr,
    w_ptr,
    lens_ptr,
    tables_ptr,
    out_ptr,
    stride_table,
    stride_om,
    max_context_len,
    NEXT_N: tl.constexpr,
    NEXT_N_P2: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    STAGES: tl.constexpr,
    CLEAN: tl.constexpr,
):
    seq = tl.program_id(0)
    start = tl.program_id(1) * SPLIT  # this program's positions: [start, start + SPLIT)
    length = tl.load(lens_ptr + seq)
    jq = tl.arange(0, NEXT_N_P2)
    n = tl.arange(0, BLOCK_N)
    out_rows = out_ptr + (seq * NEXT_N + jq)[None, :].to(tl.int64) * stride_om
    query_ok = (jq < NEXT_N)[None, :]
    end = tl.minimum(start + SPLIT, length)
    if start < end:
        R: tl.constexpr = NEXT_N_P2 * H
        r = tl.arange(0, R)
        d = tl.arange(0, D)
        row_ok = r < NEXT_N * H
        q_rows = seq * NEXT_N * H + r
        q = tl.load(q_ptr + q_rows[:, None].to(tl.int64) * D + d[None, :], mask=row_ok[:, None], other=0.0)
        w = tl.load(w_ptr + q_rows, mask=row_ok, other=0.0)
        last = length - NEXT_N + jq  # each query's own position: it sees the keys at or before it
        block_bytes: tl.constexpr = BLOCK_KV * (D + 4)
        table = tables_ptr + seq.to(tl.int64) * stride_table
        for p0 in tl.range(start, end, BLOCK_N, num_stages=STAGES):
            pos = p0 + n
            ok = pos < end
            # Each key through its block: a step of BLOCK_N keys may span several cache blocks.
            block = tl.load(table + pos // BLOCK_KV, mask=ok, other=0).to(tl.int64)
            slot = pos % BLOCK_KV
            k = tl.load(
                key_ptr + (block * block_bytes + slot * D)[:, None] + d[None, :], mask=ok[:, None], other=0.0
            )
            k_s = tl.load(scale_ptr + (block * block_bytes + BLOCK_KV * D) // 4 + slot, mask=ok, other=0.0)
            # Keys as the GEMM's rows: a query's sum over its heads stays in a thread's registers.
            s = tl.dot(k, tl.trans(q))  # (BLOCK_N, R) fp32
            s = tl.maximum(s, 0.0) * w[None, :]
            logits = tl.sum(tl.reshape(s, (BLOCK_N, NEXT_N_P2, H)), axis=2) * k_s[:, None]
            visible = pos[:, None] <= last[None, :]
            in_out = query_ok & (ok & (pos < max_context_len))[:, None]
            if CLEAN:
                tl.store(out_rows + pos[:, None], tl.where(visible, logits, float("-inf")), mask=in_out)
            else:
                tl.store(out_rows + pos[:, None], logits, mask=in_out & visible)
    if CLEAN:  # the positions past the sequence's length
        minus_inf = tl.full((BLOCK_N, NEXT_N_P2), float("-inf"), tl.float32)
        for p0 in tl.range(tl.maximum(end, start), start + SPLIT, BLOCK_N):
            pos = p0 + n
            past = (pos < start + SPLIT) & (pos < max_context_len)
            tl.store(out_rows + pos[:, None], minus_inf, mask=query_ok & past[:, None])


def paged_mqa_logits(
    q_fp8: Tensor,
    kv_cache: Tensor,
    weights: Tensor,
    context_lens: Tensor,
    block_tables: Tensor,
    schedule: Tensor,
    max_context_len: int,
    clean_logits: bool = True,
    tiles: tuple[int, int, int, int] | None = None,
) -> Tensor:
    """fp8compile::paged_mqa_logits's Triton kernel (reference_mqa.paged_mqa_logits defines it).
    It splits each sequence by position, so it reads nothing of `schedule` (the op's metadata,
    taken for the op's contract). tiles: (keys a step, keys a program, warps, stages), default
    _paged_tiles."""
    b, next_n, h, d = q_fp8.shape
    _check_heads(h, d)
    keys, scales = index_cache_views(kv_cache)
    block_size = keys.shape[1]
    schedule_split(block_size)
    # Every position below max_context_len is written: a score, or -inf with clean_logits.
    out = torch.empty((b * next_n, max_context_len), dtype=torch.float32, device=q_fp8.device)
    if b == 0 or max_context_len == 0:
        return out
    block_n, split, warps, stages = tiles or _paged_tiles(b, max_context_len, q_fp8.device)
    flat = kv_cache.view(-1)
    tables = block_tables.to(torch.int32)  # its own strides: a copy may not keep the input's
    _paged_mqa_logits_kernel[(b, triton.cdiv(max_context_len, split))](
        q_fp8.contiguous(),
        flat.view(q_fp8.dtype),
        flat.view(torch.float32),
        weights.float().contiguous(),
        context_lens.reshape(-1).to(torch.int32).contiguous(),
        tables,
        out,
        tables.stride(0),
        out.stride(0),
        max_context_len,
        NEXT_N=next_n,
        NEXT_N_P2=next_pow2(next_n),
        H=h,
        D=d,
        BLOCK_KV=block_size,
        BLOCK_N=block_n,
        SPLIT=split,
        STAGES=stages,
        CLEAN=clean_logits,
        num_warps=warps,
    )
    return out
