"""Pure-PyTorch definitions of the FP8 MQA logits of sparse-attention indexers (DeepSeek-V3.2's
"lightning indexer"), the contiguous and the paged form. Every kernel of fp8compile::mqa_logits
and fp8compile::paged_mqa_logits is tested against these.

The indexer scores key n for query row m as

    logits[m, n] = sum_h weights[m, h] * relu(q[m, h] . k[n])

with H query heads sharing one key head (MQA), head size D. In FP8, q holds e4m3fn values
quantized per (token, head) and k per token, each with an fp32 scale; a positive scale passes
through the relu, so q's scale is folded into the weights (weights[m, h] * q_scale[m, h]) and
k's multiplies the sum:

    logits[m, n] = k_scale[n] * sum_h weights[m, h] * relu(q_fp8[m, h] . k_fp8[n])

Layouts (M query rows, N keys, H heads, D head size):
  contiguous: q_fp8 (M, H, D), k_fp8 (N, D), k_scale (N,), weights (M, H) fp32, and per query a
              window of keys [ks[m], ke[m]) (int32); keys outside it are -inf with
              clean_logits=True, left unwritten (any value) with clean_logits=False.
              max_seqlen_k > 0 asks for the compressed form: (M, max_seqlen_k), column j of row m
              holding key ks[m] + j (DeepGEMM's layout), for windows of at most that length.
  paged:      q_fp8 (B, next_n, H, D): the next_n newest tokens of each of B sequences; the keys in
              a cache of blocks of block_size tokens, kv_cache (blocks, block_size, 1, D + 4) uint8
              whose bytes per block are the block_size * D FP8 values (token-major), then the
              block_size fp32 scales (DeepGEMM's layout); block_tables (B, max_blocks) int32 gives
              each sequence's blocks in order, context_lens (B,) int32 its length. Query j of
              sequence b sits at position context_lens[b] - next_n + j and sees the keys at
              positions <= its own; output (B * next_n, max_context_len) fp32, -inf past a query's
              position with clean_logits=True.
"""

from __future__ import annotations

import torch

from ...numerics import FP8_DTYPE, FP8_MAX, scale_from_amax

# Keys scored per chunk in the references: bounds their (H, M, chunk) fp32 temporary.
_CHUNK_ELEMENTS = 1 << 26


def quant_rows(x: torch.Tensor, e8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) -> (x_fp8 (..., D), scale (...) fp32): one scale per row of D values (a token's
    key; a token's query head)."""
    x32 = x.float()
    scale = scale_from_amax(x32.abs().amax(dim=-1), e8m0)
    return (x32 / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def mqa_logits(
    q_fp8: torch.Tensor,
    k_fp8: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    clean_logits: bool = True,
    max_seqlen_k: int = 0,
) -> torch.Tensor:
    """The contiguous form (module docstring), in fp32 (products of FP8 values are exact in it)."""
    m, _, _ = q_fp8.shape
    n = k_fp8.shape[0]
    q = q_fp8.float()
    k = k_fp8.float()
    w = weights.float()
    full = torch.empty(m, n, dtype=torch.float32, device=q.device)
    chunk = max(1, _CHUNK_ELEMENTS // max(1, q.numel()))
    for n0 in range(0, n, chunk):
        score = torch.einsum("mhd,nd->mhn", q, k[n0 : n0 + chunk]).relu_()
        full[:, n0 : n0 + chunk] = torch.einsum("mhn,mh->mn", score, w) * k_scale[n0 : n0 + chunk].float()
    cols = torch.arange(n, device=q.device)
    inside = (cols[None, :] >= ks[:, None].long()) & (cols[None, :] < ke[:, None].long())
    full = full.masked_fill(~inside, float("-inf"))
    if max_seqlen_k <= 0:
        return full
    # Compressed: column j of row m is key ks[m] + j; past the window (or past N), -inf.
    j = torch.arange(max_seqlen_k, device=q.device)
    key = ks[:, None].long() + j[None, :]
    out = full.gather(1, key.clamp(max=max(n - 1, 0))) if n else full.new_empty(m, max_seqlen_k)
    return out.masked_fill(key >= ke[:, None].long(), float("-inf"))


def index_cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_cache (blocks, block_size, 1, D + 4) uint8 -> its FP8 keys (blocks, block_size, D) and
    their fp32 scales (blocks, block_size), as views of the same bytes."""
    blocks, block_size, heads, width = kv_cache.shape
    if heads != 1 or kv_cache.dtype != torch.uint8:
        raise ValueError(
            f"an index cache is (blocks, block_size, 1, D + 4) uint8, got {kv_cache.shape} {kv_cache.dtype}"
        )
    d = width - 4
    flat = kv_cache.view(blocks, block_size * width)
    keys = flat[:, : block_size * d].view(FP8_DTYPE).view(blocks, block_size, d)
    scales = flat[:, block_size * d :].view(torch.float32)
    return keys, scales


def quant_index_cache(k: torch.Tensor, e8m0: bool = False) -> torch.Tensor:
    """Keys (blocks, block_size, D) -> the index cache (blocks, block_size, 1, D + 4) uint8 that
    holds them in FP8, one fp32 scale per token (layout in the module docstring)."""
    blocks, block_size, d = k.shape
    cache = torch.empty(blocks, block_size, 1, d + 4, dtype=torch.uint8, device=k.device)
    write_index_cache(cache, k.reshape(-1, d), torch.arange(blocks * block_size, device=k.device), e8m0)
    return cache


def write_index_cache(
    kv_cache: torch.Tensor, k: torch.Tensor, slots: torch.Tensor, e8m0: bool = False
) -> None:
    """Quantize keys k (T, D) per token and store token t at slot slots[t] (block slots //
    block_size, row slots % block_size) of kv_cache, in place."""
    keys, scales = index_cache_views(kv_cache)
    block_size = keys.shape[1]
    k_fp8, k_scale = quant_rows(k, e8m0)
    slots = slots.long()
    keys[slots // block_size, slots % block_size] = k_fp8
    scales[slots // block_size, slots % block_size] = k_scale


def paged_mqa_logits(
    q_fp8: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    schedule: torch.Tensor | None,
    max_context_len: int,
    clean_logits: bool = True,
) -> torch.Tensor:
    """The paged form (module docstring): each sequence's keys gathered through its block table,
    then scored as the contiguous form scores them. schedule (how a kernel spreads the work over
    its programs) does not change the result, and is not read here."""
    b, next_n, h, d = q_fp8.shape
    keys, scales = index_cache_views(kv_cache)
    block_size = keys.shape[1]
    out = torch.full((b * next_n, max_context_len), float("-inf"), device=q_fp8.device)
    lens = context_lens.tolist()
    for i in range(b):
        length = min(int(lens[i]), max_context_len)
        if length <= 0:
            continue
        blocks = block_tables[i, : -(-length // block_size)].long()
        k = keys[blocks].reshape(-1, d)[:length]
        k_scale = scales[blocks].reshape(-1)[:length]
        rows = torch.arange(next_n, device=q_fp8.device, dtype=torch.int32)
        ke = (length - next_n + 1 + rows).clamp(min=0)
        out[i * next_n : (i + 1) * next_n, :length] = mqa_logits(
            q_fp8[i], k, k_scale, weights[i * next_n : (i + 1) * next_n], torch.zeros_like(ke), ke
        )
    return out


# Keys per unit of work in the paged schedule (a multiple of every block size it serves).
SPLIT_KV = 256


def schedule_split(block_size: int) -> int:
    """The keys per unit of work for blocks of block_size tokens (SPLIT_KV); a clear error for a
    block size the schedule cannot split into."""
    if block_size < 16 or block_size & (block_size - 1) or SPLIT_KV % block_size:
        raise ValueError(
            f"the paged MQA schedule takes power-of-two blocks of 16 to {SPLIT_KV} tokens, got {block_size}"
        )
    return SPLIT_KV


def paged_schedule(context_lens: torch.Tensor, block_size: int, programs: int) -> torch.Tensor:
    """fp8compile::paged_mqa_logits_metadata for the reference and triton backends: an equal
    split of the work over `programs` persistent programs (DeepGEMM's kind of metadata; neither
    backend's kernel reads it, the Triton one splits by position): sequence b is
    ceil(context_lens[b] / SPLIT_KV) units, all
    units are cut into `programs` equal runs, and row p of the (programs + 1, 2) int32 result is
    (sequence, unit) where run p starts; the last row is (B, 0). Tensor ops only: no value
    reaches the host, so a CUDA graph can hold it."""
    split = schedule_split(block_size)
    lens = context_lens.reshape(-1).long().clamp(min=0)
    units = torch.cumsum((lens + split - 1) // split, 0)  # inclusive prefix sums
    total = units[-1:] if units.numel() else lens.new_zeros(1)
    starts = torch.arange(programs + 1, device=lens.device) * total // programs
    seq = torch.searchsorted(units, starts, right=True)
    before = torch.cat([lens.new_zeros(1), units])[seq]
    return torch.stack([seq, starts - before], dim=1).to(torch.int32)
