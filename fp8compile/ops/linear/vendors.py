"""Linears on the kernel libraries: DeepGEMM, FlashInfer, cuBLAS (torch._scaled_mm).

Each adapter has the contract of the op it serves: linear_* take bf16 x (..., K), w_fp8 (N, K),
w_scale (ceil(N/128), K/128), optional bias (N,) -> bf16 (..., N); gated_linear_* take the
gated MLP's a and b (..., K) in place of x and run on act(a, b), quantized in one pass.
"""

from __future__ import annotations

import torch

from ..quant.triton_quant import TMA_ALIGN, quant_act
from ..vendors import require


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
