"""The routed experts from the Gluon GEMMs' sizes up as launches Inductor makes: fp8compile::moe_gluon.

Outside CUDA graphs a prefill is host-bound, and fp8compile::moe on its Gluon path
(triton_moe.moe_gluon: eight launches, two of them the Gluon GEMM with its TMA descriptors) cost
418 us of host time a call at 2048 tokens alone, and 660 us a call inside a 4-layer Qwen3-MoE
prefill, whose host time fell from 5.5 to 2.9 ms with the op stubbed out (H100; BENCHMARKS.md,
"2026-11-24 (3997817)"). This op is a torch.library.triton_op like moe_decode (moe/decode_op.py):
traced into the graph (passes/inline.py), its routing (count, scan, place), the quantization
into routed order, the gated activation's quantization and the top-k sum become launches
Inductor's wrapper makes with the buffers it allocates. The two grouped GEMMs stay calls of
fp8compile::gluon_grouped_gemm, an opaque op: a Gluon kernel is not a function Inductor can
compile and launch. Outside CUDA graphs the kernel builds its TMA descriptors on the device, so
a call pays no descriptor encoding on the host (gluon_gemm.launch_args).

Everything is decided at trace time from `tokens_from` (the bottom of the token range the call
site's side of the M dispatch serves, min_tokens or more): from there up moe_triton takes the
Gluon path (`fits`), and the body makes its choices (tiles, row blocks, chunked routing), so the
numbers are the op's, bit for bit (tests/test_gpu.py).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import triton_op

from ...numerics import BLOCK
from ..linear import gluon_gemm
from . import triton_moe
from ..library import fake, op
from .tiles import gluon_min_tokens as min_tokens
from ..activations import act_operands
from ..traced import launch, quant_act
from ..quant.triton_quant import QUANT_ROWS


def fits(
    num_experts: int, top_k: int, tokens_from: int, n13: int, inter: int, hidden: int, device: torch.device
) -> bool:
    """Whether moe_gluon serves every token count from tokens_from up as moe_triton does: on the
    Gluon path (enough slots per expert; not batch-invariant, which the caller checks) with
    experts of these sizes on this device: n13 outputs of the first GEMM (2I gated, I not),
    inter inputs of the down projection."""
    return (
        tokens_from >= min_tokens(num_experts, top_k)
        and gluon_gemm.why_not_grouped_shape(hidden, n13, device) is None
        and gluon_gemm.why_not_grouped_shape(inter, hidden, device) is None
    )


def gluon_grouped_gemm(
    a: Tensor,
    a_scale: Tensor,
    w_fp8: Tensor,
    w_scale: Tensor,
    block_expert: Tensor,
    bias: Tensor | None = None,
    block_m: int = 64,
) -> Tensor:
    """gluon_gemm.grouped_gemm with the grouped config of block_m-row blocks: (R, N) bf16."""
    return gluon_gemm.grouped_gemm(
        a, a_scale, w_fp8, w_scale, block_expert, bias, config=gluon_gemm.config_of_rows(block_m)
    )


# Registered as ops/library.py registers our ops (a schema and a CompositeExplicitAutograd kernel), not
# through torch.library.custom_op, whose per-call Python (its autograd layer, the aliasing check
# of the outputs) sits on the host's critical path of every prefill here.
op(gluon_grouped_gemm)


@fake(gluon_grouped_gemm)
def _(a, a_scale, w_fp8, w_scale, block_expert, bias=None, block_m=64):
    return a.new_empty(a.shape[0], w_fp8.shape[1], dtype=torch.bfloat16)


@triton_op("fp8compile::moe_gluon", mutates_args=())
def moe_gluon(
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
    tokens_from: int = 1,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> Tensor:
    """triton_moe.moe_gluon for T >= tokens_from tokens (min_tokens or more): x (T, H), topk_ids
    and topk_weights (T, k), w13_fp8 (E, 2I, H) with w13_scale (E, 2I/128, H/128), w2_fp8 (E, H, I)
    with w2_scale, biases b13 (E, 2I) and b2 (E, H) in fp8_experts' row order -> (T, H) x.dtype."""
    t, top_k = topk_ids.shape
    num_experts, n13, h = (int(size) for size in w13_fp8.shape)
    least = min_tokens(num_experts, top_k)
    if tokens_from < least:
        raise ValueError(
            f"moe_gluon serves {least} tokens and more for top-{top_k} of {num_experts} experts "
            f"(moe_triton's Gluon path); asked from {tokens_from}"
        )
    if (
        isinstance(t, int) and t < tokens_from
    ):  # traced, T is the dispatch's symbol: its cond branch bounds it
        raise ValueError(f"moe_gluon was built for {tokens_from} tokens and more, got {t}")
    block_m = gluon_gemm.grouped_config(n13, int(w2_fp8.shape[1]))["BLOCK_M"]
    topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.contiguous()  # read as flat slot arrays
    if x.stride(-1) != 1:
        x = x.contiguous()
    s = t * top_k
    device = x.device
    # 1. routing, in three launches over chunks of slots
    capacity = triton_moe.route_capacity(s, num_experts, block_m)
    slots = torch.empty(capacity, dtype=torch.int32, device=device)
    block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    hist, start = triton_moe.route_chunked_scratch(s, num_experts, device)
    kernels = (triton_moe._route_count_kernel, triton_moe._route_scan_kernel, triton_moe._route_place_kernel)
    for kernel, arguments in zip(
        kernels,
        triton_moe.route_chunked_arguments(topk_ids, slots, block_expert, hist, start, num_experts, block_m),
    ):
        launch(kernel, *arguments)
    # 2. the tokens quantized into routed order
    a = torch.empty(capacity, h, dtype=torch.float8_e4m3fn, device=device)
    a_scale = torch.empty(capacity, h // BLOCK, dtype=torch.float32, device=device)
    rows = torch.empty(s, dtype=torch.int32, device=device)
    launch(
        triton_moe._gather_quant_kernel,
        *triton_moe.gather_quant_arguments(x, slots, block_expert, a, a_scale, rows, top_k, block_m, e8m0),
    )
    # 3. gate | up of every routed row
    c1 = torch.ops.fp8compile.gluon_grouped_gemm(a, a_scale, w13_fp8, w13_scale, block_expert, b13, block_m)
    # 4. act(gate, up) (or act(up): non-gated), quantized (QUANT_ROWS rows a program, as quant_act
    # takes at these sizes)
    h_fp8, h_scale = quant_act(*act_operands(c1, activation), e8m0, activation, alpha, limit, QUANT_ROWS)
    # 5. down
    c2 = torch.ops.fp8compile.gluon_grouped_gemm(
        h_fp8, h_scale, w2_fp8, w2_scale, block_expert, None, block_m
    )
    # 6. the top-k sum, each slot's row read through `rows`
    out = torch.empty(t, h, dtype=x.dtype, device=device)
    launch(
        triton_moe._topk_sum_kernel,
        *triton_moe.topk_sum_arguments(c2, topk_ids, topk_weights, num_experts, b2, rows, out),
    )
    return out
