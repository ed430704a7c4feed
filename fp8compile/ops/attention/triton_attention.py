"""Decode attention over a KV cache, split along the keys (flash-decoding), for grouped queries.

At decode a sequence has one query token; with the query heads of a K/V head as its rows
(passes/gqa_attention.py) sdpa's kernels split the work over sequences and K/V heads only: 8
row blocks for Llama-3-8B at batch 1, each walking the whole cache. On an H200 at context 1152
cuDNN's kernel takes 27 us a layer for 4.7 MB of keys and values (0.17 TB/s), 0.86 ms of a
5 ms FP8 step over 32 layers (BENCHMARKS.md, "2026-11-26 (01816bf)").

Here the keys are cut into chunks as well. A work item is (sequence, K/V head, chunk): it holds
that head's R = rep x S query rows, walks its chunk BLOCK_L keys a step with the online
softmax, and writes its rows' output normalized within the chunk plus their log-sum-exp; a
persistent grid of two programs per SM takes the items in turn. With one chunk the kernel
writes the output itself. Otherwise a second kernel, _gqa_combine_kernel, weighs the chunks by
exp(lse - max lse): the same softmax, summed in another order. On the H200, Llama-3-8B's 8 K/V
heads of 4 query heads: 7.5 / 10.6 / 24.0 / 73.6 us at batch 1 / 4 / 16 / 64 and context 1152,
where cuDNN's kernel takes 27.3 / 27.6 / 32.8 / 109.8 (measured with the combine of ATen ops
that came before the combine kernel).

The combine was ATen ops at first, which Inductor lowered and generated a kernel for at every
layer. In a 32-layer Llama that cost the first call 6.7 s of its 33.8 on an H200, 4.1 s of it in
code generation. With the fixed kernel the first call took 27.1 s, with sdpa's kernel 27.8
(BENCHMARKS.md, "2026-11-26 (9414b3b)").

The mask is sdpa's: additive (float, -inf for a masked key) or boolean (True = attend), any
shape that broadcasts to (B, H, S, L), read through its strides (0 where it broadcasts): as a
tile of a work item's rows a key step, or, where they all share one mask row and the tile's rows
are not 16-byte aligned, as that one row (one_mask_row). Shape letters: B sequences, KV K/V
heads, rep query heads per K/V head, S query tokens, R = rep * S rows per K/V head, L keys, D
head size, C chunks.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ...numerics import next_pow2
from ..launch import device_index, num_sms, shared_memory


@dataclasses.dataclass(frozen=True)
class Launch:
    """How _gqa_decode_kernel is launched: keys a step (BLOCK_L), warps, pipeline stages, and
    persistent programs an SM, which also sets how many chunks the keys are cut into
    (chunk_keys)."""

    block_l: int = 64
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 2


# `bench tune --kernels gqa_decode` on an H200 (2026-11-29): 24 launches (64 or 128 keys a step,
# 4 or 8 warps, 2, 3 or 4 stages, 2 or 4 programs an SM) at batch 1, 16, 64 and 1088 keys, batch
# 1 and 16 at 4096, Llama-3-8B's heads, keys and values cold: this one is the best fixed launch
# by geometric mean, within 1.9% of each point's best, the best at batch 16; the slowest launch
# took 1.06-1.35x its time (BENCHMARKS.md, "Decode attention";
# benchmarks/tune_gqa_decode_h200_2026-11-29.json).
LAUNCH = Launch()
# Heads wider than 128 (Gemma-2's and Gemma-3's 256): the same sweep with Gemma's heads (8 K/V
# heads of 2 query heads) at batch 1 and 16 over 1057 keys and batch 16 over 1024 (Gemma-3's
# window), H200, 2026-11-29, Triton 3.6: the best fixed launch by geometric mean, 11.2 / 43.4 /
# 35.9 us where LAUNCH takes 14.0 / 53.6 / 43.0, and LAUNCH with one program an SM 11.6 / 47.6 /
# 36.5 (benchmarks/tune_gqa_decode_gemma_heads_h200_2026-11-29_8c2499f.json). One program an SM
# is what fits: at D = 256 a program asks 138 KiB of shared memory (Triton 3.7.1, sm_90), and an
# SM holds 228, so LAUNCH's second program an SM cannot be resident beside the first (inferred
# from the compile; the times above agree). In Gemma-3-12B's 8-layer batch-16 decode step its
# attention took 0.86x LAUNCH's time and the step 0.95x (BENCHMARKS.md, "The wide-head attention
# launch in Gemma-3").
WIDE_LAUNCH = Launch(num_warps=8, programs_per_sm=1)
BLOCK_L = LAUNCH.block_l  # keys a step
# Chunks the combine kernel reads a step. Not tuned: chunk_keys makes about 2 x SMs / (B x KV)
# chunks at the batch a graph is compiled for (33 for Llama-3-8B at batch 1 on an H100 or H200),
# a few steps.
COMBINE_STEP = 16
MASK_NONE, MASK_ADD, MASK_BOOL = 0, 1, 2


@triton.jit
def _gqa_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    mask_ptr,
    o_ptr,
    lse_ptr,
    L,
    CHUNK,
    n_items,
    stride_qb,
    stride_qg,
    stride_qr,
    stride_kb,
    stride_kg,
    stride_kl,
    stride_vb,
    stride_vg,
    stride_vl,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_ml,
    stride_ob,
    stride_og,
    stride_oc,
    stride_or,
    SCALE: tl.constexpr,
    KV: tl.constexpr,
    REP: tl.constexpr,
    S: tl.constexpr,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
    MASK: tl.constexpr,
    MASK_ROW: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    num_chunks = tl.cdiv(L, CHUNK)
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    row_ok = r < REP * S
    d_ok = d < D
    s = r % S
    # Work items (sequence, K/V head, chunk), every num_programs-th one per program.
    for item in tl.range(tl.program_id(0), n_items, tl.num_programs(0)):
        c = item % num_chunks
        b = (item // num_chunks // KV).to(tl.int64)
        g = item // num_chunks % KV
        head = g * REP + r // S
        q = tl.load(
            q_ptr + b * stride_qb + g * stride_qg + r[:, None] * stride_qr + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if DOT_F32:
            q = q.to(tl.float32)
        m_i = tl.full((BLOCK_R,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_R,), tl.float32)
        acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
        lo = c * CHUNK
        hi = tl.minimum(lo + CHUNK, L)
        for start in range(lo, hi, BLOCK_L):
            keys = start + tl.arange(0, BLOCK_L)
            key_ok = keys < hi
            kv_mask = key_ok[:, None] & d_ok[None, :]
            if MASK_ROW:  # one mask row serves every query row: BLOCK_L loads, not BLOCK_R x BLOCK_L
                m_row = tl.load(mask_ptr + b * stride_mb + keys * stride_ml, mask=key_ok, other=0)
            k = tl.load(
                k_ptr + b * stride_kb + g * stride_kg + keys[:, None] * stride_kl + d[None, :],
                mask=kv_mask,
                other=0.0,
            )
            if DOT_F32:
                k = k.to(tl.float32)
            scores = tl.dot(q, tl.trans(k)) * SCALE
            if MASK_ROW:
                if MASK == 1:
                    scores += m_row.to(tl.float32)[None, :]
                else:
                    key_ok = key_ok & (m_row != 0)
            elif MASK != 0:
                m_ptrs = (
                    mask_ptr
                    + b * stride_mb
                    + head[:, None] * stride_mh
                    + s[:, None] * stride_ms
                    + keys[None, :] * stride_ml
                )
                m_ok = row_ok[:, None] & key_ok[None, :]
                if MASK == 1:
                    scores += tl.load(m_ptrs, mask=m_ok, other=0.0).to(tl.float32)
                else:
                    scores = tl.where(tl.load(m_ptrs, mask=m_ok, other=0) != 0, scores, float("-inf"))
            scores = tl.where(key_ok[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            # A row with no key left so far keeps -inf: exponents are taken from 0 instead.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(scores - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_ptr + b * stride_vb + g * stride_vg + keys[:, None] * stride_vl + d[None, :],
                mask=kv_mask,
                other=0.0,
            )
            p = p.to(v.dtype)
            if DOT_F32:
                p, v = p.to(tl.float32), v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # rows with no key: 0
        o_ptrs = o_ptr + b * stride_ob + g * stride_og + c * stride_oc + r[:, None] * stride_or + d[None, :]
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        if WRITE_LSE:
            lse = tl.where(l_i > 0, m_i + tl.log(l_i), float("-inf"))
            tl.store(lse_ptr + ((b * KV + g) * num_chunks + c) * (REP * S) + r, lse, mask=row_ok)


def chunk_keys(length: int, batch: int, kv: int, device: torch.device, launch: Launch = LAUNCH) -> int:
    """Keys per chunk: enough chunks that B x KV x C work items fill the launch's programs (two
    an SM: the GPU about twice), each at least one step of keys (length and batch: sizes or
    their hints)."""
    programs = max(1, batch * kv)
    chunks = max(1, programs_to_fill(device, launch) // programs)
    return triton.cdiv(triton.cdiv(length, chunks), launch.block_l) * launch.block_l


def programs_to_fill(device: torch.device, launch: Launch = LAUNCH) -> int:
    """The persistent grid: launch.programs_per_sm an SM on a GPU; a few in Triton's CPU
    interpreter."""
    if device.type != "cuda":
        return 4
    return launch.programs_per_sm * num_sms(device_index(device))


def shared_bytes(launch: Launch, rows: int, d: int, mask_size: int) -> int:
    """An upper bound of the shared memory _gqa_decode_kernel asks for, in bytes, launched as
    `launch` for `rows` query rows per K/V head of width d, over a mask of mask_size-byte
    elements (0: none): the key and value tiles in flight (one at one stage; at s stages, s - 1
    of each), the mask tiles in flight, and the query tile and the probability and layout
    conversion buffers. Compiled by Triton 3.7.1, with every size and stride a multiple of 16,
    the kernel asked 6-12% less for sm_90 at the launches tests/test_decode_attention.py
    compiles, a third less at one stage, and 11-19% less for sm_89."""
    block_r, block_d, block_l = max(16, next_pow2(rows)), max(16, next_pow2(d)), launch.block_l
    stages = launch.num_stages
    kv_tiles = max(1, 2 * (stages - 1))
    return (
        kv_tiles * block_l * block_d * 2
        + (stages - 1) * block_r * block_l * mask_size
        + block_r * block_d * 2
        + block_r * block_l * (4 + block_d // 16)
    )


def fitted(launch: Launch, rows: int, d: int, mask_size: int, budget: int) -> Launch | None:
    """`launch`, or the nearest launch whose shared memory (shared_bytes) fits in budget bytes:
    down to two stages first, then fewer keys a step (down to 16), then one stage; None if even
    that does not fit. At D = 256 the op's launch fits an H100's or H200's 227 KiB for up to 32
    query rows; for 64 Triton 3.7.1 asks 237568 bytes, more than the 232448 there, and the
    fitted launch has two stages. On an Ada GPU (99 KiB) Gemma's heads at decode ask 145408
    bytes (sm_89), and the fitted launch's two stages 77824."""
    while shared_bytes(launch, rows, d, mask_size) > budget:
        if launch.num_stages > 2:
            launch = dataclasses.replace(launch, num_stages=launch.num_stages - 1)
        elif launch.block_l > 16:
            launch = dataclasses.replace(launch, block_l=launch.block_l // 2)
        elif launch.num_stages > 1:
            launch = dataclasses.replace(launch, num_stages=1)
        else:
            return None
    return launch


def launch_for(d: int) -> Launch:
    """The tuned launch for heads of width d: LAUNCH up to 128, WIDE_LAUNCH beyond."""
    return LAUNCH if d <= 128 else WIDE_LAUNCH


def launch_on(device: torch.device, rows: int, d: int, mask: Tensor | None) -> Launch | None:
    """The op's launch (launch_for(d)) fitted to the device's shared memory; unfitted in
    Triton's CPU interpreter. Its keys a step divide BLOCK_L, so a chunk of BLOCK_L's serves it."""
    if device.type != "cuda":
        return launch_for(d)
    size = 0 if mask is None else mask.element_size()
    return fitted(launch_for(d), rows, d, size, shared_memory(device_index(device)))


def mask_code(mask: Tensor | None) -> int:
    if mask is None:
        return MASK_NONE
    return MASK_BOOL if mask.dtype == torch.bool else MASK_ADD


def one_mask_row(mask: Tensor | None, s: int) -> bool:
    """Whether the kernel loads one mask row a key step for all of a work item's query rows
    (BLOCK_L values) instead of a BLOCK_R x BLOCK_L tile: where every row reads the same mask row
    (one query token, the mask broadcast over heads: a static cache's (B, 1, 1, L) mask at decode)
    and the tile's rows do not all start on 16 bytes: then the tile comes in one element a load,
    not pipelined, where aligned rows come by cp.async with the keys (the sm_90 code, Triton 3.7).

    Llama-3-8B's heads on an H200, keys and values cold, the combine included (BENCHMARKS.md,
    "Decode attention", 2026-11-29): at 1057 keys, rows unaligned, the tile took 35.5 / 37.5 us
    at batch 16 with a boolean / bf16 per-sequence mask, the row 29.3 / 26.2 (batch 64: 115 / 111
    against 75 / 74); at 1088 keys, rows aligned, the tile was 3-8% faster with a boolean mask at
    batch 16 and 64 (26.1 us against the row's 28.3 at batch 16), within 4% either way elsewhere."""
    if mask is None or s != 1 or not statically_known_true(mask.stride(1) == 0):
        return False
    size = mask.element_size()
    return not all(statically_known_true(st * size % 16 == 0) for st in mask.stride()[:3])


def gqa_decode_arguments(
    q, k, v, mask, o, lse, scale: float, rep: int, chunk: int, programs: int, block_l: int = BLOCK_L
):
    """(grid, args, constexprs) of _gqa_decode_kernel: q (B, KV, R, D), k and v (B, KV, L, D),
    mask broadcast to (B, H, S, L) or None, o (B, KV, C, R, D) (C = 1: (B, KV, R, D) in q's dtype),
    lse (B, KV, C, R) fp32 or None; block_l keys a step."""
    b, kv, rows, d = q.shape
    length = k.shape[2]
    chunks = o.shape[2] if o.dim() == 5 else 1
    o_strides = (
        (o.stride(0), o.stride(1), o.stride(2), o.stride(3))
        if o.dim() == 5
        else (
            o.stride(0),
            o.stride(1),
            0,
            o.stride(2),
        )
    )
    m_strides = tuple(mask.stride()) if mask is not None else (0, 0, 0, 0)
    args = (
        q,
        k,
        v,
        mask if mask is not None else q,
        o,
        lse if lse is not None else o,
        length,
        chunk,
        b * kv * chunks,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        *m_strides,
        *o_strides,
    )
    constexprs = dict(
        SCALE=float(scale),
        KV=kv,
        REP=rep,
        S=rows // rep,
        D=d,
        BLOCK_R=max(16, next_pow2(rows)),
        BLOCK_D=max(16, next_pow2(d)),
        BLOCK_L=block_l,
        MASK=mask_code(mask),
        MASK_ROW=one_mask_row(mask, rows // rep),
        WRITE_LSE=lse is not None,
        # Triton's CPU interpreter multiplies bf16 dot operands wrongly (3.9): fp32 operands there,
        # the same bf16 values.
        DOT_F32=q.device.type != "cuda",
    )
    return (programs,), args, constexprs


@triton.jit
def _gqa_combine_kernel(
    o_ptr,
    lse_ptr,
    out_ptr,
    C,
    stride_ob,
    stride_og,
    stride_oc,
    stride_or,
    stride_outb,
    stride_outg,
    stride_outr,
    KV: tl.constexpr,
    R: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    STEP_C: tl.constexpr,
):
    # One program per output row (sequence, K/V head, row): its C chunk rows weighed by
    # exp(lse - max lse). C is a run-time size (a symbolic key count gives a symbolic chunk
    # count), so the chunks are read STEP_C a step, each of the STEP_C lanes keeping a running
    # max, weight sum and output rescaled as its max grows; the lanes are merged at the end. A
    # chunk with no key (lse -inf) weighs 0; a row with no key at all gives 0. lse is
    # (B, KV, C, R), contiguous, as _gqa_decode_kernel writes it.
    row = tl.program_id(0)
    r = row % R
    bg = (row // R).to(tl.int64)
    b = bg // KV
    g = bg % KV
    d = tl.arange(0, BLOCK_D)
    top = tl.full((STEP_C,), float("-inf"), tl.float32)
    total = tl.zeros((STEP_C,), tl.float32)
    acc = tl.zeros((STEP_C, BLOCK_D), tl.float32)
    for start in range(0, C, STEP_C):
        cs = start + tl.arange(0, STEP_C)
        lse = tl.load(lse_ptr + (bg * C + cs) * R + r, mask=cs < C, other=float("-inf"))
        new_top = tl.maximum(top, lse)
        safe = tl.where(new_top == float("-inf"), 0.0, new_top)  # no key so far: exponents from 0
        alpha = tl.exp(top - safe)
        w = tl.exp(lse - safe)
        o = tl.load(
            o_ptr + b * stride_ob + g * stride_og + cs[:, None] * stride_oc + r * stride_or + d[None, :],
            mask=(cs < C)[:, None] & (d < D)[None, :],
            other=0.0,
        )
        total = total * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o
        top = new_top
    overall = tl.max(top, 0)
    overall = tl.where(overall == float("-inf"), 0.0, overall)
    lane = tl.exp(top - overall)
    weight = tl.sum(total * lane, 0)
    out = tl.sum(acc * lane[:, None], 0) / tl.where(weight > 0, weight, 1.0)
    tl.store(
        out_ptr + b * stride_outb + g * stride_outg + r * stride_outr + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < D,
    )


def combine_arguments(o: Tensor, lse: Tensor, out: Tensor):
    """(grid, args, constexprs) of _gqa_combine_kernel: the chunks' outputs o (B, KV, C, R, D)
    fp32, each normalized within its chunk, their log-sum-exp lse (B, KV, C, R) fp32 contiguous,
    into out (B, KV, R, D): the attention over all keys. C may be symbolic."""
    b, kv, chunks, rows, d = o.shape
    args = (o, lse, out, chunks, *o.stride()[:4], *out.stride()[:3])
    constexprs = dict(KV=kv, R=rows, D=d, BLOCK_D=max(16, next_pow2(d)), STEP_C=COMBINE_STEP)
    return (b * kv * rows,), args, constexprs


MAX_ROWS = 64  # query rows per K/V head a program holds


def supports(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, rep: int) -> str | None:
    """Why the kernel cannot serve this attention, or None. q (B, H, S, D) before regrouping."""
    if q.device.type != "cuda":
        return "not on a CUDA device"
    if not (q.dtype == k.dtype == v.dtype and q.dtype in (torch.bfloat16, torch.float16)):
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype} (bf16 or fp16 only)"
    if q.shape[-1] > 256 or q.shape[-1] < 16:
        return f"head size {q.shape[-1]} (16..256)"
    if rep * q.shape[2] > MAX_ROWS:
        return f"{rep * q.shape[2]} query rows per K/V head (up to {MAX_ROWS})"
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        return "keys or values not contiguous along the head dimension"
    if mask is not None and (mask.dim() > 4 or not statically_known_true(mask.shape[-1] == k.shape[2])):
        return f"mask of shape {tuple(mask.shape)} for {k.shape[2]} keys"
    if launch_on(q.device, rep * q.shape[2], q.shape[-1], mask) is None:
        return f"no launch fits the GPU's shared memory for head size {q.shape[-1]}"
    return None
