"""The decode kernel as an op Inductor launches itself: fp8compile::linear_decode.

Outside CUDA graphs a decode step is host-bound, and our ops pay a Python kernel (dispatcher,
op body, the kernel's Python entry) around every launch: 80-98 us of host time per linear where
bf16 Inductor pays 24-27 (H100, `bench host --chain 8`; BENCHMARKS.md, "Inductor-launched decode
kernel"). This op is a torch.library.triton_op: when AOTAutograd traces it, its body becomes the
kernel launch itself (wrap_triton), so Inductor's generated wrapper allocates the output and
calls the compiled kernel like one of its own, with no Python of ours at run time (22-39 us).
Its definition is reference.linear_block on the same FP8 weight (tests/test_triton_kernels.py).

The price is that everything the body decides is decided at trace time: the tile height comes
from `max_m` (the top of the M range the caller serves, not M itself, which is symbolic), the
weight must be an FP8 tensor in the graph (not the bf16 parameter plus a lookup), and the
launch is plain (no TMA descriptors, no programmatic dependent launch): the path for default
mode, where CUDA graphs do not hide the host. Called eagerly it runs the same kernel through
Triton's own launch path.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import triton_op, wrap_triton

from ...numerics import AMAX_EPS, BLOCK, FP8_MAX
from . import triton_gemm
from ..quant import triton_quant


@triton_op("fp8compile::linear_decode", mutates_args=())
def linear_decode(
    x: Tensor,
    w_fp8: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    e8m0: bool = False,
    max_m: int = 16,
    b: Tensor | None = None,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> Tensor:
    """bf16 x (M, K), M <= max_m <= 64, times the block-quantized weight (w_fp8 (N, K) e4m3fn,
    w_scale (ceil(N/128), K/128) fp32) (+ bias) -> bf16 (M, N), 1x128 activation quantization
    fused. With b (M, K): the gated MLP's down projection, on act(x, b) (reference.gated).
    Split-K programs meet on the eager path's int32 counters, passed by address
    (triton_gemm.split_k_counters): the op stays functional with no per-call fill."""
    if not 1 <= max_m <= triton_gemm.SMALL_M_MAX:
        raise ValueError(
            f"linear_decode serves 1 <= M <= {triton_gemm.SMALL_M_MAX}, asked for M up to {max_m}"
        )
    m = x.shape[0]
    n, k = (int(size) for size in w_fp8.shape)  # the grid and the split are fixed at trace time
    gated = b is not None
    torch._check(not gated or b.shape == x.shape, lambda: "act(x, b) needs x and b of one shape")
    # The eager decode path's tiles for its largest M (the same cached choice linear_small_m makes).
    block_m, block_n, split, n_tiles = triton_gemm._small_m_tiles(max_m, n, k, gated, x.device, None, None)
    if isinstance(m, int) and m > max_m:  # traced, M is the dispatch's symbol: its cond branch bounds it
        raise ValueError(f"linear_decode was built for M <= {max_m}, got M = {m}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    partial = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    arrivals = triton_gemm.split_k_counters(x.device, n_tiles, split)
    launch = (
        {}
        if x.device.type == "cpu"
        else dict(
            num_warps=triton_gemm.SMALL_M_NUM_WARPS,
            num_stages=triton_gemm.small_m_stages(block_m, block_n, gated, x.device),
        )
    )
    b_ = x if b is None else b
    wrap_triton(triton_gemm._linear_small_m_kernel)[(n_tiles, split)](
        x,
        x,
        b_,
        w_fp8,
        w_fp8,
        w_scale,
        bias if bias is not None else w_scale,
        out,
        partial,
        *arrivals,
        m,
        n,
        k,
        x.stride(0),
        x.stride(1),
        b_.stride(0),
        b_.stride(1),
        w_fp8.stride(0),
        w_scale.stride(0),
        w_scale.stride(1),
        out.stride(0),
        AMAX_EPS,
        FP8_MAX,
        float(alpha),
        float(limit),
        E8M0=e8m0,
        ACT=triton_quant.activation_code(b, activation),
        HAS_BIAS=bias is not None,
        TMA=False,
        ACT_TMA=False,
        PDL=False,
        TRIGGER=False,
        PREFETCH=1,
        SPLIT_K=split,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        GROUP=BLOCK,
        **launch,
    )
    return out
