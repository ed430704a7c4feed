"""The sum of a tensor over a process group's ranks by the group's own collective (NCCL on GPUs,
gloo on the CPU), as a functional collective: what a sharded model's graph held before the
all_reduce pass, the reference of the symmetric-memory kernels, and their fallback wherever they
do not serve a call."""

from __future__ import annotations

import torch
from torch import Tensor


def all_reduce_sum(x: Tensor, group_name: str) -> Tensor:
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.all_reduce(x, "sum", group_name))


def add_rms_norm(reduced: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(weight * rms_norm(s), s) for s = residual + reduced, as transformers' decoder layer and
    RMSNorm (Llama's) compute them: the sum rounded to the dtype, normalized in fp32, rounded,
    then scaled by the weight. The reference of all_reduce_rms_norm's kernel after its sum."""
    summed = residual + reduced
    h = summed.float()
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(summed.dtype)
    return weight * normed, summed
