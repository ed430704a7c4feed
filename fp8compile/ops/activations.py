"""The MLP activations FP8 ops fuse, in fp32 and in pure PyTorch: gated (act(gate, up)) and
non-gated (act(up)), with the names the ops and kernels take."""

from __future__ import annotations

import torch


# Activations of a gated MLP, act(a, b) with a the gate and b the up projection:
#   silu       silu(a) * b                                          Llama, Qwen, Mistral, ...
#   swigluoai  a' * sigmoid(alpha * a') * (b' + 1), a' = min(a, limit), b' = clamp(b, -limit, limit)
#              GPT-OSS (alpha 1.702, limit 7.0 there)
#   silu_limit silu(a') * b', the same clamps                        DeepSeek-V4 (its swiglu_limit)
#   gelu_tanh  gelu(a, approximate="tanh") * b                      Gemma, Gemma-2, Gemma-3
GATED_ACTIVATIONS = ("silu", "swigluoai", "silu_limit", "gelu_tanh")
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
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(a, approximate="tanh") * b
    raise ValueError(f"activation {activation!r}: valid gated activations are {', '.join(GATED_ACTIVATIONS)}")
