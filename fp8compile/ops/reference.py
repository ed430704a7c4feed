"""Pure-PyTorch definitions of the block-recipe FP8 ops. Every fast kernel is tested against these.

Layouts (M tokens, N output features, K input features, G = K / 128 groups):
  x (M, K) bf16        -> x_fp8 (M, K) e4m3fn, x_scale (M, G) fp32, row-major
  w (N, K) bf16        -> w_fp8 (N, K) e4m3fn, w_scale (ceil(N/128), G) fp32
  out[m, n] = sum_g (x_fp8[m, g] . w_fp8[n, g]) * x_scale[m, g] * w_scale[n // 128, g]
A K of part of a group is zero columns up to whole groups, in the weight (quant_weight_block)
and in the activation (pad_k): a zero column adds nothing to a dot product, and the last group's
scale is that of its real columns (a partial group, as a partial last weight block along N).
"""

from __future__ import annotations

import torch

from ..numerics import BLOCK, FP8_DTYPE, FP8_MAX, ceil_div, scale_from_amax, whole_blocks


def _check_k(k: int) -> None:
    if k % BLOCK:
        raise ValueError(
            f"K={k} is not a multiple of {BLOCK}: the block recipe scales K in groups of {BLOCK}"
        )


def quant_act_block(x: torch.Tensor, e8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-128-group quantization of x (M, K) -> (x_fp8 (M, K), x_scale (M, K/128))."""
    m, k = x.shape
    _check_k(k)
    groups = x.float().reshape(m, k // BLOCK, BLOCK)
    scale = scale_from_amax(groups.abs().amax(dim=-1), e8m0) if m else groups.new_empty(0, k // BLOCK)
    x_fp8 = (groups / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x_fp8.reshape(m, k), scale


def pad_k(x: torch.Tensor, k: int) -> torch.Tensor:
    """x (..., K') with zero columns up to K >= K' (the K of a weight's FP8 copy)."""
    return x if x.shape[-1] == k else torch.nn.functional.pad(x, (0, k - x.shape[-1]))


def quant_weight_block(w: torch.Tensor, e8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128-block quantization of w (N, K) -> (w_fp8 (N, Kp), w_scale (ceil(N/128), Kp/128)),
    Kp = K in whole 128-wide groups.

    N need not be a multiple of 128: the last block row is padded with zeros for its amax. Nor
    need K: the copy has zero columns up to Kp (linear_block pads the activation alike).
    """
    n, k = w.shape
    nb, k = ceil_div(n, BLOCK), whole_blocks(k)
    padded = w.new_zeros(nb * BLOCK, k, dtype=torch.float32)
    padded[:n, : w.shape[1]] = w.float()
    blocks = padded.reshape(nb, BLOCK, k // BLOCK, BLOCK)
    scale = scale_from_amax(blocks.abs().amax(dim=(1, 3)), e8m0)
    w_fp8 = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return w_fp8.reshape(nb * BLOCK, k)[:n].contiguous(), scale


def gemm_block(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """out (M, N) = block-scaled x_fp8 @ w_fp8.T (+ bias), written in out_dtype.

    Each 128-long group dot product is computed in float64, where it is exact: e4m3 products
    are multiples of 2**-18 below 2**18, so a sum of 128 of them needs at most 43 of float64's
    53 bits, whatever the summation order. Groups are then scaled and summed in a fixed order.
    Hence the result is the same for a row whatever M is (batch-invariant by construction) and
    is a higher-precision baseline than any fp32-accumulating kernel.
    """
    m, k = x_fp8.shape
    n = w_fp8.shape[0]
    _check_k(k)
    groups = k // BLOCK
    xq = x_fp8.double().reshape(m, groups, BLOCK)
    wq = w_fp8.double().reshape(n, groups, BLOCK)
    w_scale_rows = w_scale.double().repeat_interleave(BLOCK, dim=0)[:n]  # (N, G)
    x_scale = x_scale.double()
    out = torch.zeros(m, n, dtype=torch.float64, device=x_fp8.device)
    for g in range(groups):
        exact = xq[:, g] @ wq[:, g].T
        out += exact * x_scale[:, g, None] * w_scale_rows[None, :, g]
    if bias is not None:
        out += bias.double()
    return out.to(out_dtype)


def linear_block(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    e8m0: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """FP8 linear on an activation x (..., K): quantize 1x128, block GEMM, (..., N) in out_dtype
    (default x.dtype). x may have fewer columns than w_fp8 (a K of part of a group): zeros fill it."""
    x2 = pad_k(x.reshape(-1, x.shape[-1]), w_fp8.shape[1])
    x_fp8, x_scale = quant_act_block(x2, e8m0)
    out = gemm_block(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype or x.dtype)
    return out.reshape(*x.shape[:-1], w_fp8.shape[0])


# Activations of a gated MLP, act(a, b) with a the gate and b the up projection:
#   silu       silu(a) * b                                          Llama, Qwen, Mistral, ...
#   swigluoai  a' * sigmoid(alpha * a') * (b' + 1), a' = min(a, limit), b' = clamp(b, -limit, limit)
#              GPT-OSS (alpha 1.702, limit 7.0 there)
#   silu_limit silu(a') * b', the same clamps                        DeepSeek-V4 (its swiglu_limit)
GATED_ACTIVATIONS = ("silu", "swigluoai", "silu_limit")
# Activations of a non-gated MLP, act(a) of the up projection alone:
#   relu2      relu(a)^2                                            Nemotron-H's routed experts
UNARY_ACTIVATIONS = ("relu2",)


def unary(a: torch.Tensor, activation: str) -> torch.Tensor:
    """act(a) of a non-gated MLP in fp32."""
    if activation == "relu2":
        return torch.relu(a.float()).square()
    raise ValueError(
        f"activation {activation!r}: valid non-gated activations are {', '.join(UNARY_ACTIVATIONS)}"
    )


def act_operands(h: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The operands of an expert's activation over its first GEMM's output h (rows, N13): the
    gate and up halves (a, b) for a gated activation, (h, None) for a non-gated one (N13 = I)."""
    if activation in UNARY_ACTIVATIONS:
        return h, None
    half = h.shape[-1] // 2
    return h[..., :half], h[..., half:]


def expert_activation(h: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    """act over an expert's first GEMM output h, in fp32: gated over its halves, or non-gated."""
    a, b = act_operands(h, activation)
    return unary(a, activation) if b is None else gated(a, b, activation, alpha, limit)


def gated(
    a: torch.Tensor, b: torch.Tensor, activation: str = "silu", alpha: float = 1.702, limit: float = 7.0
) -> torch.Tensor:
    """act(a, b) in fp32, not rounded to bf16 in between: the fused op's intermediate."""
    a, b = a.float(), b.float()
    if activation == "silu":
        return a * torch.sigmoid(a) * b
    if activation == "swigluoai":
        a, b = a.clamp(max=limit), b.clamp(-limit, limit)
        return a * torch.sigmoid(a * alpha) * (b + 1)
    if activation == "silu_limit":
        a, b = a.clamp(max=limit), b.clamp(-limit, limit)
        return a * torch.sigmoid(a) * b
    raise ValueError(f"activation {activation!r}: valid gated activations are {', '.join(GATED_ACTIVATIONS)}")


def gated_linear_block(
    a: torch.Tensor,
    b: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    e8m0: bool = False,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """Gated-MLP down projection: the FP8 linear of act(a, b) (fp32), written in a.dtype."""
    return linear_block(gated(a, b, activation, alpha, limit), w_fp8, w_scale, bias, e8m0, a.dtype)


def dequant_weight_block(w_fp8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """fp32 weight that w_fp8 and its block scales stand for (for tests and error analysis)."""
    n, _ = w_fp8.shape
    full = w_scale.repeat_interleave(BLOCK, dim=0)[:n].repeat_interleave(BLOCK, dim=1)
    return w_fp8.float() * full


def dequant_act_block(x_fp8: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
    return x_fp8.float() * x_scale.repeat_interleave(BLOCK, dim=1)


def _routed(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, expert
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert(topk_ids[t, j], x[t]) in fp32, written in x.dtype; slots
    routed outside [0, num_experts) (expert-parallel sentinels) contribute nothing."""
    t, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    token = torch.arange(t * k, device=x.device) // k
    out = None
    for e in flat_ids.unique().tolist():
        if not 0 <= e < num_experts:
            continue
        slots = (flat_ids == e).nonzero().squeeze(1)
        y = expert(e, x[token[slots]]) * topk_weights.reshape(-1)[slots, None].float()
        if out is None:
            out = torch.zeros(t * k, y.shape[1], dtype=torch.float32, device=x.device)
        out[slots] = y
    if out is None:
        return x.new_zeros(t, x.shape[1])
    return out.reshape(t, k, -1).sum(dim=1).to(x.dtype)


def moe_block(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_fp8: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_fp8: torch.Tensor,
    w2_scale: torch.Tensor,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    e8m0: bool = False,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Routed experts in FP8: out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]).

    x (T, H); topk_ids, topk_weights (T, k); w13_fp8 (E, 2I, H) gate rows then up rows (or
    (E, I, H), up rows alone, for a non-gated activation), w2_fp8 (E, H, I), scales (E, N/128,
    K/128); biases (E, 2I), (E, H). An expert is down(act(gate(x), up(x))), or down(act(up(x))):
    each GEMM quantizes its input 1x128 per token; gate|up (+ bias) is
    written in x.dtype, as the grouped GEMMs write it and as the bf16 model does, and the
    activation runs in fp32 from there. Every slot is computed on its own, so the result for a
    token never depends on the others (batch-invariant whatever the flag says).
    """

    def expert(e, xs):
        h = linear_block(xs, w13_fp8[e], w13_scale[e], None, e8m0, torch.float32)
        if b13 is not None:
            h = h + b13[e].float()
        h = h.to(x.dtype)
        y = linear_block(
            expert_activation(h, activation, alpha, limit),
            w2_fp8[e],
            w2_scale[e],
            None,
            e8m0,
            torch.float32,
        )
        return y if b2 is None else y + b2[e].float()

    return _routed(x, topk_ids, topk_weights, w13_fp8.shape[0], expert)


def moe_dense(
    x, topk_ids, topk_weights, w13, w2, b13=None, b2=None, activation="silu", alpha=1.702, limit=7.0
):
    """The same routed experts without quantization, in fp32: w13 (E, 2I, H) gate rows then up
    rows (or (E, I, H) for a non-gated activation), w2 (E, H, I). What an MoE block computes; the
    moe pass checks its matches against it."""

    def expert(e, xs):
        h = xs.float() @ w13[e].float().T
        if b13 is not None:
            h = h + b13[e].float()
        y = expert_activation(h, activation, alpha, limit) @ w2[e].float().T
        return y if b2 is None else y + b2[e].float()

    return _routed(x, topk_ids, topk_weights, w13.shape[0], expert)
