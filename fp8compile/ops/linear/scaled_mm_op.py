"""The cuBLAS side of the M dispatch as launches Inductor makes itself: fp8compile::linear_scaled_mm.

Outside CUDA graphs a prefill is host-bound at the widths where FP8 pays: our cuBLAS op costs
the host 94 us per linear at M = 1024 (N = K = 4096; dispatcher, op body, the quantization's
Python launch, then torch._scaled_mm) where bf16's F.linear costs 16 (H100; BENCHMARKS.md,
"2026-11-24 (1022e31)"). Like fp8compile::linear_decode (decode_op.py), this op is a
torch.library.triton_op: traced by AOTAutograd (passes/inline.py), its body becomes the launch
of the quantization kernel (wrap_triton) and an aten._scaled_mm node, which Inductor's
generated code calls directly, with no Python of ours at run time.

The same numbers as the cuBLAS op (linear/vendors.linear_cublas): the same kernel quantizes x (or a
gated MLP's act(x, b)) 1x128 into column-major scales, M padded to a multiple of 4 with
quantized zeros (cuBLAS wants 16-byte aligned scale columns), then cuBLAS's 1x128 / 128x128
block-scaled GEMM. It serves M >= 8 (cuBLAS refuses fewer rows; the dispatch gives it none).
Its definition is the cuBLAS backend's, which tests/test_gpu.py holds to the fp32 product; the
traced op gives that backend's bits (tests/test_gpu_compiled.py, the default-mode cuBLAS side).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import triton_op, wrap_triton

from ...numerics import BLOCK, FP8_DTYPE
from ..quant import triton_quant


@triton_op("fp8compile::linear_scaled_mm", mutates_args=())
def linear_scaled_mm(
    x: Tensor,
    w_fp8: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    e8m0: bool = False,
    b: Tensor | None = None,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> Tensor:
    """bf16 x (M, K), M >= 8, times the block-quantized weight (w_fp8 (N, K) e4m3fn, w_scale
    (ceil(N/128), K/128) fp32) (+ bias) -> bf16 (M, N), through cuBLAS. With b (M, K): the gated
    MLP's down projection, on act(x, b) (reference.gated), never rounded to bf16."""
    m, k = x.shape
    torch._check(k % BLOCK == 0, lambda: f"K={k} is not a multiple of {BLOCK}")
    torch._check(b is None or b.shape == x.shape, lambda: "act(x, b) needs x and b of one shape")
    align = triton_quant.TMA_ALIGN
    m_out = (m + align - 1) // align * align
    x_fp8 = torch.empty(m_out, k, dtype=FP8_DTYPE, device=x.device)
    # (M', K/128) with strides (1, M'), as empty_scales(m_out, ..., "col") makes it but without its
    # [:m] slice: traced, a written slice comes back as a slice_scatter, one more kernel.
    x_scale = torch.empty(k // BLOCK, m_out, dtype=torch.float32, device=x.device).t()
    grid, args, constexprs = triton_quant.quant_act_arguments(
        x, b, x_fp8, x_scale, e8m0, activation, alpha, limit
    )
    wrap_triton(triton_quant._quant_act_kernel)[grid](*args, **constexprs, num_warps=4)
    out = torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=x_scale, scale_b=w_scale.t(), out_dtype=x.dtype)[:m]
    return out if bias is None else out + bias
