"""The registered FP8 MQA-logits ops of sparse-attention indexers (reference.py defines them), each
with its fake implementation below it, in the torch.library namespace of ops/library.py.

    torch.ops.fp8compile.mqa_logits(q_fp8, k_fp8, k_scale, weights, ks, ke,
                                    clean_logits, max_seqlen_k, backend)
    torch.ops.fp8compile.paged_mqa_logits_metadata(context_lens, block_size, num_sms, backend)
    torch.ops.fp8compile.paged_mqa_logits(q_fp8, kv_cache, weights, context_lens, block_tables,
                                          schedule_metadata, max_context_len, clean_logits, backend)
    torch.ops.fp8compile.index_cache_write(kv_cache, k, slots, e8m0)   # in place

`backend` names the registry's kernel ("triton", "deep_gemm", "reference"); a schedule is made for
the backend that reads it (the same name for both calls).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import kernels
from . import reference as reference_mqa
from ..library import LIB, fake, op


def _check_mqa(
    q_fp8: Tensor, k_fp8: Tensor, k_scale: Tensor, weights: Tensor, ks: Tensor, ke: Tensor
) -> None:
    torch._check(q_fp8.dim() == 3, lambda: f"q_fp8 is (M, H, D), got {tuple(q_fp8.shape)}")
    m, h, d = q_fp8.shape
    torch._check(
        k_fp8.dim() == 2 and k_fp8.shape[1] == d, lambda: f"k_fp8 is (N, {d}), got {tuple(k_fp8.shape)}"
    )
    torch._check(
        tuple(k_scale.shape) == (k_fp8.shape[0],),
        lambda: f"k_scale is ({k_fp8.shape[0]},), got {tuple(k_scale.shape)}",
    )
    torch._check(tuple(weights.shape) == (m, h), lambda: f"weights is ({m}, {h}), got {tuple(weights.shape)}")
    torch._check(
        tuple(ks.shape) == (m,) and tuple(ke.shape) == (m,),
        lambda: f"ks and ke are ({m},), got {tuple(ks.shape)} and {tuple(ke.shape)}",
    )


@op
def mqa_logits(
    q_fp8: Tensor,
    k_fp8: Tensor,
    k_scale: Tensor,
    weights: Tensor,
    ks: Tensor,
    ke: Tensor,
    clean_logits: bool = True,
    max_seqlen_k: int = 0,
    backend: str = "reference",
) -> Tensor:
    """(M, N) fp32 logits, or (M, max_seqlen_k) compressed (reference_mqa.mqa_logits)."""
    _check_mqa(q_fp8, k_fp8, k_scale, weights, ks, ke)
    return kernels.implementation("mqa_logits", backend)(
        q_fp8, k_fp8, k_scale, weights, ks, ke, clean_logits, max_seqlen_k
    )


@fake(mqa_logits)
def _(q_fp8, k_fp8, k_scale, weights, ks, ke, clean_logits=True, max_seqlen_k=0, backend="reference"):
    _check_mqa(q_fp8, k_fp8, k_scale, weights, ks, ke)
    n = max_seqlen_k if max_seqlen_k > 0 else k_fp8.shape[0]
    return q_fp8.new_empty(q_fp8.shape[0], n, dtype=torch.float32)


@op
def paged_mqa_logits_metadata(
    context_lens: Tensor, block_size: int, num_sms: int, backend: str = "reference"
) -> Tensor:
    """(num_sms + 1, 2) int32: how `backend`'s paged kernel spreads these sequences over num_sms
    programs."""
    return kernels.implementation("paged_mqa_logits_metadata", backend)(context_lens, block_size, num_sms)


@fake(paged_mqa_logits_metadata)
def _(context_lens, block_size, num_sms, backend="reference"):
    return context_lens.new_empty(num_sms + 1, 2, dtype=torch.int32)


def _check_paged(
    q_fp8: Tensor, kv_cache: Tensor, weights: Tensor, context_lens: Tensor, block_tables: Tensor
):
    torch._check(q_fp8.dim() == 4, lambda: f"q_fp8 is (B, next_n, H, D), got {tuple(q_fp8.shape)}")
    b, next_n, h, d = q_fp8.shape
    torch._check(
        kv_cache.dim() == 4 and kv_cache.shape[2] == 1 and kv_cache.shape[3] == d + 4,
        lambda: f"kv_cache is (blocks, block_size, 1, {d + 4}) uint8, got {tuple(kv_cache.shape)}",
    )
    torch._check(
        tuple(weights.shape) == (b * next_n, h),
        lambda: f"weights is ({b * next_n}, {h}), got {tuple(weights.shape)}",
    )
    torch._check(
        context_lens.numel() == b, lambda: f"context_lens has {b} entries, got {tuple(context_lens.shape)}"
    )
    torch._check(
        block_tables.dim() == 2 and block_tables.shape[0] == b,
        lambda: f"block_tables is ({b}, max_blocks), got {tuple(block_tables.shape)}",
    )


@op
def paged_mqa_logits(
    q_fp8: Tensor,
    kv_cache: Tensor,
    weights: Tensor,
    context_lens: Tensor,
    block_tables: Tensor,
    schedule_metadata: Tensor,
    max_context_len: int,
    clean_logits: bool = True,
    backend: str = "reference",
) -> Tensor:
    """(B * next_n, max_context_len) fp32 logits (reference_mqa.paged_mqa_logits)."""
    _check_paged(q_fp8, kv_cache, weights, context_lens, block_tables)
    return kernels.implementation("paged_mqa_logits", backend)(
        q_fp8, kv_cache, weights, context_lens, block_tables, schedule_metadata, max_context_len, clean_logits
    )


@fake(paged_mqa_logits)
def _(
    q_fp8,
    kv_cache,
    weights,
    context_lens,
    block_tables,
    schedule_metadata,
    max_context_len,
    clean_logits=True,
    backend="reference",
):
    _check_paged(q_fp8, kv_cache, weights, context_lens, block_tables)
    return q_fp8.new_empty(q_fp8.shape[0] * q_fp8.shape[1], max_context_len, dtype=torch.float32)


LIB.define("index_cache_write(Tensor(a!) kv_cache, Tensor k, Tensor slots, bool e8m0=False) -> ()")


def _index_cache_write(kv_cache: Tensor, k: Tensor, slots: Tensor, e8m0: bool = False) -> None:
    """Quantize keys k (T, D) per token into the index cache at slots (T,) (reference_mqa)."""
    reference_mqa.write_index_cache(kv_cache, k, slots, e8m0)


LIB.impl("index_cache_write", _index_cache_write, "CompositeExplicitAutograd")


@torch.library.register_fake("fp8compile::index_cache_write", lib=LIB)
def _(kv_cache, k, slots, e8m0=False):
    return None
