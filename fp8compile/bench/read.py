"""A plain read of an FP8 weight: what streaming its bytes costs on this GPU with nothing else to do,
the reference a decode GEMM (which must read every weight byte once) is measured against in `bench
gemm` (the `read` column) and `bench model` (its read limit). A reference, not a bound: DeepGEMM's GEMM
took less than it on the two tallest weights there (BENCHMARKS.md, Linear, "2026-11-26 (c3bf7be)").
Each program XORs its [BLOCK_N, BLOCK_K] tiles over its part of K, split over K as the decode kernels
are. READ_TILINGS: (BLOCK_N, BLOCK_K, programs per SM, warps). The 4-warp ones were the fastest of 30
tilings on Llama-3-8B's four decode weights on an H100 (2.14-2.89 TB/s, 64-86% of its HBM peak); on
an H200 they read 2 GB at 3.16-3.29 TB/s where 16 x 256 tiles with 8 warps read at 4.54-4.55 TB/s
(95% of its 4.8 peak; torch's sum of the same bytes 4.27-4.36; 72 tilings, H200, 2026-11-29, a504459;
benchmarks/read_rate_h200_2026-11-29_a504459.json). `bench gemm` times each on every shape and keeps
the fastest (fastest_tiling)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..numerics import ceil_div
from ..ops.launch import num_sms

# (BLOCK_N, BLOCK_K, programs per SM, warps): rows of 512 or 256 contiguous bytes.
READ_TILINGS = ((16, 512, 1, 4), (16, 512, 4, 4), (32, 256, 4, 4), (16, 256, 4, 8), (16, 256, 1, 8))


@triton.jit
def _read_kernel(
    w_ptr, out_ptr, N, K, stride_wn, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    steps = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(steps, SPLIT_K)
    s0 = pid_k * per_split
    s1 = tl.minimum(s0 + per_split, steps)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.int32)
    for s in range(s0, s1):
        cols = s * BLOCK_K + offs_k
        mask = (offs_n[:, None] < N) & (cols[None, :] < K)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + cols[None, :], mask=mask, other=0)
        acc = acc ^ w.to(tl.int32)
    tl.store(out_ptr + pid_n * SPLIT_K + pid_k, tl.xor_sum(tl.xor_sum(acc, 1), 0))


def plain_read(
    w: torch.Tensor, block_n: int = 16, block_k: int = 512, programs_per_sm: int = 4, num_warps: int = 4
) -> torch.Tensor:
    """Read every byte of w (N, K), one byte an element (FP8 or int8), rows contiguous: int32
    XORs, one per program (their XOR is the XOR of all of w's bytes)."""
    if w.dim() != 2 or w.element_size() != 1 or w.stride(1) != 1:
        raise ValueError(
            "plain_read reads a 2-D tensor of one-byte elements, rows contiguous; "
            f"got {w.dtype} {tuple(w.shape)} with strides {w.stride()}"
        )
    n, k = w.shape
    n_tiles = ceil_div(n, block_n)
    sms = num_sms(w.device.index or 0) if w.is_cuda else 1
    split = max(1, min(ceil_div(k, block_k), round(programs_per_sm * sms / n_tiles)))
    out = torch.empty(n_tiles * split, dtype=torch.int32, device=w.device)
    _read_kernel[(n_tiles, split)](
        w.view(torch.uint8),
        out,
        n,
        k,
        w.stride(0),
        SPLIT_K=split,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
    )
    return out


def fastest_tiling(weights: list[torch.Tensor]) -> tuple[int, int, int, int]:
    """The READ_TILINGS entry that reads these weight copies (all of one shape) fastest here."""
    from . import harness

    times = {t: harness.time_us([lambda w=w, t=t: plain_read(w, *t) for w in weights]) for t in READ_TILINGS}
    return min(((us, t) for t, us in times.items() if us is not None), default=(None, READ_TILINGS[0]))[1]
