"""Adapters for the optional kernel libraries: DeepGEMM, FlashInfer, cuBLAS (torch._scaled_mm).

Nothing here is imported by `import fp8compile`; the registry imports this module when a
vendor backend is asked about, and the libraries themselves are imported on first use.
Each adapter has the contract of the op it serves: linear_* take bf16 x (..., K), w_fp8 (N, K),
w_scale (ceil(N/128), K/128), optional bias (N,) -> bf16 (..., N); gated_linear_* take the
gated MLP's a and b (..., K) in place of x and run on act(a, b), quantized in one pass.
"""

from __future__ import annotations

import functools
import importlib

import torch

from ..numerics import ceil_div
from .reference import act_operands
from .quant.triton_quant import TMA_ALIGN, empty_scales, quant_act

INSTALL = {
    "deep_gemm": "pip install 'fp8compile[deep_gemm]' (sgl-deep-gemm; 0.1.5.post1 loads on torch 2.11)",
    "flashinfer": "pip install 'fp8compile[flashinfer]' (flashinfer-python)",
}


@functools.cache
def import_error(module: str) -> str | None:
    """None if `module` imports, else why not (with what to install)."""
    try:
        importlib.import_module(module)
    except Exception as e:  # ImportError, or a library that fails while loading its kernels
        return f"cannot import {module} ({type(e).__name__}: {str(e)[:200]}); {INSTALL[module]}"
    return None


def require(module: str):
    why = import_error(module)
    if why is not None:
        raise RuntimeError(why)
    return importlib.import_module(module)


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _quantized_activation(x, b, e8m0, layout, rows_multiple=1, act=("silu", 1.702, 7.0)):
    """(x_fp8, x_scale, M) for x (..., K), or for the gated act(x, b) when b is given (act =
    (activation, alpha, limit)); the quantized rows padded with quantized zeros up to a
    multiple of rows_multiple."""
    x2, b2 = _flat(x), None if b is None else _flat(b)
    x_fp8, x_scale = quant_act(
        x2, e8m0, layout, b=b2, activation=act[0], alpha=act[1], limit=act[2], rows_multiple=rows_multiple
    )
    return x_fp8, x_scale, x2.shape[0]


def _finish(out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _deep_gemm(x, b, w_fp8, w_scale, bias, e8m0, act=("silu", 1.702, 7.0)):
    """Triton 1x128 quantization straight into the MN-major TMA-aligned scale layout DeepGEMM
    reads (no transpose kernel), then deep_gemm.fp8_gemm_nt with the fp32 scales as given."""
    deep_gemm = require("deep_gemm")
    x_fp8, x_scale, m = _quantized_activation(x, b, e8m0, "mn_major", act=act)
    out = torch.empty(m, w_fp8.shape[0], dtype=x.dtype, device=x.device)
    if m:
        deep_gemm.fp8_gemm_nt((x_fp8, x_scale), (w_fp8, w_scale), out, disable_ue8m0_cast=True)
    return _finish(out, x, bias)


def _cublas(x, b, w_fp8, w_scale, bias, e8m0, act=("silu", 1.702, 7.0)):
    """cuBLAS block scaling through torch._scaled_mm: scale_a (M, K/128) column-major with
    strides exactly (1, M), scale_b w_scale.t() (K/128, N/128). cuBLAS also needs those scale
    columns 16-byte aligned (M = 31 and 33 fail with CUBLAS_STATUS_NOT_SUPPORTED on an H200,
    16 and 32 run), so M is padded to a multiple of 4 with zero rows. It rejects M < 8
    outright, and gives wrong numbers, with no error, where K/128 is not a multiple of 4 (the
    weight-scale columns are then unaligned); the registry routes neither here."""
    x_fp8, x_scale, m = _quantized_activation(x, b, e8m0, "col", rows_multiple=TMA_ALIGN, act=act)
    out = torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=x_scale, scale_b=w_scale.t(), out_dtype=x.dtype)
    return _finish(out[:m], x, bias)


def prepare_deep_gemm(request) -> None:
    """registry hook, at compile time: DeepGEMM's device runtime, which allocates a tensor when
    the process first calls DeepGEMM, is created now (asking it the SM count creates it). Created
    in a CUDA graph's warm-up run instead, that tensor would stay in the graph's memory pool, live
    but owned by no graph, and Inductor's CUDA graphs refuse every later warm-up."""
    if request.device.type == "cuda":
        with torch.cuda.device(request.device):
            require("deep_gemm").get_num_sms()


def linear_deep_gemm(x, w_fp8, w_scale, bias=None, e8m0=False):
    return _deep_gemm(x, None, w_fp8, w_scale, bias, e8m0)


def gated_linear_deep_gemm(
    a, b, w_fp8, w_scale, bias=None, e8m0=False, activation="silu", alpha=1.702, limit=7.0
):
    return _deep_gemm(a, b, w_fp8, w_scale, bias, e8m0, (activation, alpha, limit))


def linear_cublas(x, w_fp8, w_scale, bias=None, e8m0=False):
    return _cublas(x, None, w_fp8, w_scale, bias, e8m0)


def gated_linear_cublas(
    a, b, w_fp8, w_scale, bias=None, e8m0=False, activation="silu", alpha=1.702, limit=7.0
):
    return _cublas(a, b, w_fp8, w_scale, bias, e8m0, (activation, alpha, limit))


def linear_flashinfer(x, w_fp8, w_scale, bias=None, e8m0=False):
    """FlashInfer's fp8_blockscale_gemm_sm90: takes bf16 x and quantizes it itself (1x128,
    no E8M0), swapAB kernel below M = 32."""
    gemm = require("flashinfer").gemm.fp8_blockscale_gemm_sm90
    x2 = _flat(x).contiguous()
    out = gemm(x2, w_fp8, None, w_scale, out_dtype=x.dtype)
    return _finish(out, x, bias)


def moe_deep_gemm(
    x,
    topk_ids,
    topk_weights,
    w13_fp8,
    w13_scale,
    w2_fp8,
    w2_scale,
    b13=None,
    b2=None,
    e8m0=False,
    activation="silu",
    alpha=1.702,
    limit=7.0,
    batch_invariant=False,
):
    """fp8compile::moe through DeepGEMM's m_grouped_fp8_gemm_nt_contiguous: the quantized tokens
    are gathered into the contiguous layout (each expert's rows padded to DeepGEMM's alignment,
    expert id per row, -1 on padding), both expert GEMMs run grouped, and the Triton top-k sum
    reads each slot's row back (fp32, slot order) with the routing weight and the down bias."""
    from .moe.triton_moe import route, topk_sum

    deep_gemm = require("deep_gemm")
    t, k = topk_ids.shape
    num_experts, n13, _ = w13_fp8.shape
    s = t * k
    if s == 0:
        return x.new_zeros(x.shape)
    align = deep_gemm.get_mk_alignment_for_contiguous_layout()
    slots, block_expert = route(topk_ids, num_experts, align)
    is_slot = slots < s
    row_expert = torch.where(is_slot, block_expert.repeat_interleave(align), -1)
    x_fp8, x_scale = quant_act(x.contiguous(), e8m0, "row")
    token = torch.where(is_slot, slots, 0).long() // k
    a_scale = empty_scales(slots.numel(), x_scale.shape[1], "mn_major", x.device)
    a_scale.copy_(x_scale[token])
    c1 = torch.empty(slots.numel(), n13, dtype=torch.bfloat16, device=x.device)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous(
        (x_fp8[token], a_scale), (w13_fp8, w13_scale), c1, row_expert, disable_ue8m0_cast=True
    )
    if b13 is not None:
        c1 += b13[row_expert.clamp(min=0).long()]
    gate, up = act_operands(c1, activation)
    h_fp8, h_scale = quant_act(gate, e8m0, "mn_major", b=up, activation=activation, alpha=alpha, limit=limit)
    c2 = torch.empty(slots.numel(), w2_fp8.shape[1], dtype=torch.bfloat16, device=x.device)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous(
        (h_fp8, h_scale), (w2_fp8, w2_scale), c2, row_expert, disable_ue8m0_cast=True
    )
    # Row of each slot in the contiguous layout (slots routed nowhere point at row 0 and are skipped).
    row_of_slot = torch.zeros(s + 1, dtype=torch.int32, device=x.device)
    row_of_slot.scatter_(
        0,
        torch.where(is_slot, slots, s).long(),
        torch.arange(slots.numel(), dtype=torch.int32, device=x.device),
    )
    return topk_sum(c2, topk_ids, topk_weights, num_experts, b2, rows=row_of_slot[:s], out_dtype=x.dtype)


def masked_layout(topk_ids: torch.Tensor, num_experts: int, max_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepGEMM's masked layout of a routing: (dest (S,) int64: the row of slot t * k + j in the
    flattened (E * max_m) buffer, expert e's rows from e * max_m on in slot order, and E * max_m,
    one row past them, for a slot of an expert outside [0, E) (another rank's); masked_m (E,)
    int32: the rows of each expert). Plain tensor ops that never read a value back to the host
    (unlike bincount or one_hot on CUDA), so a CUDA graph can hold them."""
    e = topk_ids.reshape(-1).long()
    hits = (e[:, None] == torch.arange(num_experts, device=e.device)[None, :]).int()  # (S, E)
    rank = hits.cumsum(0).gather(1, e.clamp(0, num_experts - 1)[:, None]).squeeze(1) - 1
    routed = (e >= 0) & (e < num_experts)
    dest = torch.where(routed, e * max_m + rank, num_experts * max_m)
    return dest, hits.sum(0).int()


# Tokens up to which the masked layout serves a call: its buffers hold max_m >= T rows per expert
# (the most one expert can get), E * max_m rows in all.
MASKED_MAX_TOKENS = 256
# An expert's block of rows is a multiple of this: with blocks of 4 or 16 rows DeepGEMM's masked
# kernel (sgl-deep-gemm 0.1.5, H100) gave wrong rows (calc_diff 0.06-0.74 against the Triton
# path), with 64, 128 and 256 the same numbers (1.5e-5; BENCHMARKS.md, "MoE layers").
MASKED_BLOCK_ROWS = 64


def moe_deep_gemm_masked(
    x,
    topk_ids,
    topk_weights,
    w13_fp8,
    w13_scale,
    w2_fp8,
    w2_scale,
    b13=None,
    b2=None,
    e8m0=False,
    activation="silu",
    alpha=1.702,
    limit=7.0,
    batch_invariant=False,
):
    """fp8compile::moe through DeepGEMM's fp8_m_grouped_gemm_nt_masked, for decode: each expert
    gets a block of max_m >= T rows (the most a routing can give it) and a count of the valid
    ones, so every shape depends on T alone and no value is read back: a CUDA graph holds the
    call. The quantized tokens are scattered into the blocks, both expert GEMMs run masked, the
    gated activation is quantized over the blocks, and the Triton top-k sum reads each slot's
    row back through dest."""
    from .moe.triton_moe import topk_sum

    deep_gemm = require("deep_gemm")
    t, k = topk_ids.shape
    num_experts, n13, h = w13_fp8.shape
    if t == 0:
        return x.new_zeros(x.shape)
    max_m = ceil_div(t, MASKED_BLOCK_ROWS) * MASKED_BLOCK_ROWS
    rows = num_experts * max_m
    dest, masked_m = masked_layout(topk_ids, num_experts, max_m)
    token = torch.arange(t * k, device=x.device) // k
    x_fp8, x_scale = quant_act(x.contiguous(), e8m0, "row")
    a = torch.empty(rows + 1, h, dtype=x_fp8.dtype, device=x.device)  # + the row of unrouted slots
    a_scale = torch.empty(rows + 1, x_scale.shape[1], dtype=torch.float32, device=x.device)
    a[dest] = x_fp8[token]
    a_scale[dest] = x_scale[token]
    expected_m = max(1, ceil_div(t * k, num_experts))
    c1 = torch.empty(num_experts, max_m, n13, dtype=torch.bfloat16, device=x.device)
    deep_gemm.fp8_m_grouped_gemm_nt_masked(
        (a[:rows].view(num_experts, max_m, h), a_scale[:rows].view(num_experts, max_m, -1)),
        (w13_fp8, w13_scale),
        c1,
        masked_m,
        expected_m,
        disable_ue8m0_cast=True,
    )
    if b13 is not None:
        c1 += b13[:, None, :]
    gate, up = act_operands(c1.view(rows, n13), activation)
    h_fp8, h_scale = quant_act(gate, e8m0, "row", b=up, activation=activation, alpha=alpha, limit=limit)
    c2 = torch.empty(num_experts, max_m, w2_fp8.shape[1], dtype=torch.bfloat16, device=x.device)
    deep_gemm.fp8_m_grouped_gemm_nt_masked(
        (h_fp8.view(num_experts, max_m, -1), h_scale.view(num_experts, max_m, -1)),
        (w2_fp8, w2_scale),
        c2,
        masked_m,
        expected_m,
        disable_ue8m0_cast=True,
    )
    return topk_sum(
        c2.view(rows, -1), topk_ids, topk_weights, num_experts, b2, rows=dest.int(), out_dtype=x.dtype
    )
