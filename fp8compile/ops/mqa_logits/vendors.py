"""DeepGEMM's FP8 MQA logits kernel behind fp8compile::mqa_logits (the contract is
mqa_logits/reference.py's; DeepGEMM's layout is the same: q (M, H, D) e4m3fn, keys (N, D) with an fp32
scale each). Imported by the registry only when asked for.

Its paged kernel (fp8_paged_mqa_logits) is behind fp8compile::paged_mqa_logits too, after our
Triton kernel in the order (registry.PAGED_MQA_ORDER: a tie on an H100). sgl-deep-gemm 0.1.5's
sm_90 path takes (B, next_n) lengths, one per query (per_query_lengths), but asserts
`not is_context_lens_2d` when asked to clean the logits (the 2026-11-25 (833267e) GPU test), so
the adapter sets -inf past each query's length itself. Its kernel reads blocks of 64 tokens and
next_n 1 or 2 only (refused otherwise, with the reason). `bench mqa` times it through the op
(bench/mqa.py, _deep_gemm_paged) and alone (_deep_gemm_paged_kernel); its logits are ours to
calc_diff 4e-15 (BENCHMARKS.md, "Indexer logits")."""

from __future__ import annotations

import torch

from ..vendors import require


def mqa_logits_deep_gemm(q_fp8, k_fp8, k_scale, weights, ks, ke, clean_logits=True, max_seqlen_k=0):
    deep_gemm = require("deep_gemm")
    ks, ke = ks.to(torch.int32).contiguous(), ke.to(torch.int32).contiguous()
    # DeepGEMM cleans only the full layout (it asserts `not clean_logits` for the compressed one):
    # there, the columns past each window are set to -inf here.
    logits = deep_gemm.fp8_mqa_logits(
        q_fp8.contiguous(),
        (k_fp8.contiguous(), k_scale.float().contiguous()),
        weights.float().contiguous(),
        ks,
        ke,
        clean_logits=clean_logits and max_seqlen_k <= 0,
        max_seqlen_k=max_seqlen_k,
    )
    if clean_logits and max_seqlen_k > 0:
        _minus_inf_past(logits, ke - ks)
    return _as_the_op_lays_it_out(logits)


def _as_the_op_lays_it_out(logits: torch.Tensor) -> torch.Tensor:
    """DeepGEMM returns its logits as a view of rows padded to its tile of keys (32 keys came back
    with a row stride of 256: H200, sgl-deep-gemm 0.1.5), where the op (its fake, and Inductor's
    check of each extern op's output) says contiguous rows: a copy where the rows are padded."""
    return logits.contiguous()


def _minus_inf_past(logits: torch.Tensor, lengths: torch.Tensor) -> None:
    """-inf in place in each row's columns from its length on (the cleaning DeepGEMM leaves out)."""
    past = torch.arange(logits.shape[-1], device=logits.device)[None, :] >= lengths.reshape(-1, 1)
    logits.masked_fill_(past, float("-inf"))


# DeepGEMM's sm_90 paged kernel reads the cache in blocks of this many tokens (a static assert).
DEEP_GEMM_PAGED_BLOCK = 64


def per_query_lengths(context_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    """(B, next_n) int32, the form DeepGEMM's sm_90 paged path takes: query j of sequence b sits at
    position context_lens[b] - next_n + j, so it sees that many keys plus one. At next_n = 1 that
    is context_lens itself, a view: no kernel on a decode step (the adapter's launches are a
    measurable part of a 3-10 us call)."""
    lens = context_lens.reshape(-1, 1).to(torch.int32).contiguous()
    if next_n == 1:
        return lens
    j = torch.arange(1 - next_n, 1, dtype=torch.int32, device=context_lens.device)
    return (lens + j[None, :]).clamp_(min=0)


def paged_mqa_logits_metadata_deep_gemm(context_lens, block_size, num_sms):
    """DeepGEMM's schedule for its paged kernel. It reads each sequence's last query's length,
    the sequence's own, and cuts the work the same way for next_n 1 and 2 (one next_n atom)."""
    _check_block(block_size)
    deep_gemm = require("deep_gemm")
    return deep_gemm.get_paged_mqa_logits_metadata(per_query_lengths(context_lens, 1), block_size, num_sms)


def paged_mqa_logits_deep_gemm(
    q_fp8,
    kv_cache,
    weights,
    context_lens,
    block_tables,
    schedule_metadata,
    max_context_len,
    clean_logits=True,
):
    next_n = q_fp8.shape[1]
    if next_n > 2:
        raise ValueError(
            f"DeepGEMM's paged MQA logits here take next_n 1 or 2 (its schedule's), got {next_n}"
        )
    _check_block(kv_cache.shape[1])
    deep_gemm = require("deep_gemm")
    lengths = per_query_lengths(context_lens, next_n)
    logits = deep_gemm.fp8_paged_mqa_logits(
        q_fp8.contiguous(),
        kv_cache,
        weights.float().contiguous(),
        lengths,
        block_tables.to(torch.int32),
        schedule_metadata,
        max_context_len,
        clean_logits=False,  # it cleans only with one length per sequence; the rows are cleaned here
    )
    if clean_logits:
        _minus_inf_past(logits, lengths)
    return _as_the_op_lays_it_out(logits)


def _check_block(block_size: int) -> None:
    if block_size != DEEP_GEMM_PAGED_BLOCK:
        raise ValueError(
            f"DeepGEMM's sm_90 paged MQA logits read cache blocks of {DEEP_GEMM_PAGED_BLOCK} tokens, "
            f"got {block_size}"
        )
