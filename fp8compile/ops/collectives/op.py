"""fp8compile::all_reduce (torch.library, ops/library.py), with its fake below it: the sum of x
over a process group's ranks, on symmetric memory's kernels where they serve the call
(symmetric.py), else on the group's own collective (reference.py). The all_reduce pass puts it
where a sharded model's graph held a functional sum all-reduce and its wait."""

from __future__ import annotations

import torch
from torch import Tensor

from ..library import fake, op
from . import reference, symmetric


@op
def all_reduce(x: Tensor, group_name: str) -> Tensor:
    """x summed over the ranks of the group named group_name; a new tensor of x's shape."""
    out = symmetric.all_reduce_sum(x, group_name)
    return out if out is not None else reference.all_reduce_sum(x, group_name).contiguous()


@fake(all_reduce)
def _(x: Tensor, group_name: str) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)
