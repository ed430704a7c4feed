"""The routed experts at decode sizes as an op Inductor launches itself: fp8compile::moe_decode.

Outside CUDA graphs a decode step is host-bound, and fp8compile::moe pays a Python kernel around
its six launches (routing, quantization, two grouped GEMMs, the gated activation's
quantization, the top-k sum): 190-290 us of host time a call at one token on H100 leases' hosts,
where Inductor's wrapper launched each of them in 24-35 us under the profiler (BENCHMARKS.md,
"2026-11-24 (7810cf9)"). Like fp8compile::linear_decode (decode_op.py), this op is a torch.library.triton_op:
traced as AOTAutograd traces it (passes/inline.py), its body becomes the six launches, which
Inductor's wrapper calls with the buffers it allocates, and no Python of ours runs per call.

Everything the body decides is decided at trace time, from `max_tokens` (the top of the token
range the call site's side of the M dispatch serves): routing in one program (its sort holds
every slot, so up to triton_moe.ROUTE_ONE_PROGRAM_MAX_SLOTS slots) and the Triton kernel's
smallest row blocks (BLOCK_M_CHOICES[0]), which triton_moe.moe_triton itself picks at these
sizes, so the numbers are the op's, bit for bit (tests/test_moe_kernels.py). `decode_fits` says
where that holds. The expert weights come in FP8 (the graph's derived inputs), not as the bf16
parameters plus a lookup.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import triton_op

from ...numerics import next_pow2
from . import triton_moe
from .tiles import decode_fits
from ..activations import act_operands
from ..traced import launch, quant_act
from ..quant.triton_quant import QUANT_ROWS


@triton_op("fp8compile::moe_decode", mutates_args=())
def moe_decode(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w13_fp8: Tensor,
    w13_scale: Tensor,
    w2_fp8: Tensor,
    w2_scale: Tensor,
    b13: Tensor | None = None,
    b2: Tensor | None = None,
    e8m0: bool = False,
    max_tokens: int = 32,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> Tensor:
    """triton_moe.moe_triton for T <= max_tokens tokens (decode_fits): x (T, H), topk_ids and
    topk_weights (T, k), w13_fp8 (E, 2I, H) with w13_scale (E, 2I/128, H/128), w2_fp8 (E, H, I)
    with w2_scale, biases b13 (E, 2I) and b2 (E, H) in fp8_experts' row order -> (T, H) x.dtype."""
    t, top_k = topk_ids.shape
    num_experts, n13, h = (int(size) for size in w13_fp8.shape)
    if isinstance(t, int) and t == 0:
        return x.new_zeros(x.shape)
    if not decode_fits(num_experts, top_k, max_tokens):
        raise ValueError(
            f"moe_decode serves up to {triton_moe.ROUTE_ONE_PROGRAM_MAX_SLOTS} slots in "
            f"{triton_moe.BLOCK_M_CHOICES[0]}-row blocks; {max_tokens} tokens x top-{top_k} of "
            f"{num_experts} experts is past that"
        )
    if isinstance(t, int) and t > max_tokens:  # traced, T is the dispatch's symbol: its cond branch bounds it
        raise ValueError(f"moe_decode was built for up to {max_tokens} tokens, got {t}")
    block_m = triton_moe.BLOCK_M_CHOICES[0]
    topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.contiguous()  # read as flat slot arrays
    s = t * top_k
    device = x.device
    # 1. routing
    capacity = triton_moe.route_capacity(s, num_experts, block_m)
    slots = torch.empty(capacity, dtype=torch.int32, device=device)
    block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    launch(
        triton_moe._route_kernel,
        *triton_moe.route_kernel_arguments(
            topk_ids, slots, block_expert, num_experts, block_m, max_tokens * top_k
        ),
    )
    # 2. the tokens, quantized once
    rows = min(QUANT_ROWS, next_pow2(max_tokens))
    x_fp8, x_scale = quant_act(x, None, e8m0, "none", alpha, limit, rows)
    # 3. gate | up of every slot
    c1 = _grouped_gemm(x_fp8, x_scale, w13_fp8, w13_scale, b13, slots, block_expert, s, top_k, block_m)
    # 4. act(gate, up) (or act(up): non-gated), quantized
    h_fp8, h_scale = quant_act(*act_operands(c1, activation), e8m0, activation, alpha, limit, rows)
    # 5. down
    c2 = _grouped_gemm(h_fp8, h_scale, w2_fp8, w2_scale, None, slots, block_expert, s, 1, block_m)
    # 6. the top-k sum, in slot order
    out = torch.empty(t, h, dtype=x.dtype, device=device)
    launch(
        triton_moe._topk_sum_kernel,
        *triton_moe.topk_sum_arguments(c2, topk_ids, topk_weights, num_experts, b2, None, out),
    )
    return out


def _grouped_gemm(a, a_scale, w_fp8, w_scale, bias, slots, block_expert, num_slots, rows_per_a, block_m):
    """triton_moe.grouped_gemm as a traced launch: (S, N) bf16, row `slot` of its expert's product."""
    c = torch.empty(num_slots, int(w_fp8.shape[1]), dtype=torch.bfloat16, device=a.device)
    launch(
        triton_moe._moe_gemm_kernel,
        *triton_moe.grouped_gemm_arguments(
            a, a_scale, w_fp8, w_scale, bias, c, slots, block_expert, num_slots, rows_per_a, block_m
        ),
    )
    return c
