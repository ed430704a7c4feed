"""DeepGEMM's FP8 MQA logits kernel behind fp8compile::mqa_logits (the contract is
reference_mqa.py's; DeepGEMM's layout is the same: q (M, H, D) e4m3fn, keys (N, D) with an fp32
scale each). Imported by the registry only when asked for.

Its paged kernel (fp8_paged_mqa_logits) is not behind fp8compile::paged_mqa_logits yet: on an
H100, sgl-deep-gemm 0.1.5's sm_90 path asserts context_lens.dim() == 2 (one length per query) in
both the metadata and the logits call. `bench mqa` times it as an anchor in that form
(bench/mqa.py, _deep_gemm_paged): on an H100 it gives our kernel's logits (calc_diff 4e-15) in
1.0-1.5x less time (BENCHMARKS.md, "Indexer logits"), so it is the next backend for the paged
op, once its GPU test (next_n 1 and 2, ragged lengths) has run behind the op."""

from __future__ import annotations

import torch

from .vendors import require


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
        past = torch.arange(max_seqlen_k, device=logits.device)[None, :] >= (ke - ks)[:, None]
        logits = logits.masked_fill(past, float("-inf"))
    return logits
