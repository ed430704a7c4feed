"""The tensors inside tensor subclasses, the way AOTAutograd sees them: a tensor-parallel
model's DTensor parameter is its local shard.

Dynamo passes a DTensor parameter (torch.distributed.tensor, parallelize_module) to the backend
as itself; AOTAutograd then flattens every traceable wrapper subclass into its inner values
(`__tensor_flatten__`: a DTensor's `_local_tensor`, and in newer torch its device mesh as an
opaque object), and the ATen graph our passes rewrite has one placeholder per inner value. A
sharded linear is an `mm` on the local shard there, with the collectives DTensor put around it
(a row-sharded linear's all-reduce) as functional collectives. So the FP8 copy of a sharded
weight is made from this rank's shard, in 128x128 blocks of the shard.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def flatten(value: Any, name: str | None) -> Iterator[tuple[Any, str | None, str]]:
    """(inner value, its name, how it lies in value) for each value AOTAutograd makes of value,
    in its order. A subclass with one tensor inside (a DTensor's shard) gives that tensor value's
    name; with several, "name.attr"; the shard's description says which part of the whole it is
    ("" for a plain value)."""
    if not is_traceable_wrapper_subclass(value):
        yield value, name, ""
        return
    attrs, _ = value.__tensor_flatten__()
    tensors = [a for a in attrs if isinstance(getattr(value, a), torch.Tensor)]
    for attr in attrs:
        inner = getattr(value, attr)
        if not isinstance(inner, torch.Tensor):
            yield inner, None, ""
            continue
        inner_name = name if len(tensors) == 1 or name is None else f"{name}.{attr}"
        note = describe(value)
        for leaf, leaf_name, leaf_note in flatten(inner, inner_name):
            yield leaf, leaf_name, leaf_note or note


def describe(value: torch.Tensor) -> str:
    """How this rank's part lies in a DTensor: "Shard(dim=0) over 2 ranks of 256x512"; "" for a
    replicated one (every rank holds all of it) and for anything else."""
    placements = getattr(value, "placements", None)
    mesh = getattr(value, "device_mesh", None)
    if placements is None or mesh is None or all(p.is_replicate() for p in placements):
        return ""
    shape = "x".join(map(str, value.shape))
    ranks = mesh.size()
    return f"{', '.join(map(repr, placements))} over {ranks} rank{'s' if ranks != 1 else ''} of {shape}"


def inner_tensors(value: Any) -> list[torch.Tensor]:
    """The plain tensors that hold value's data: value itself, or those inside its subclass."""
    return [t for t, _, _ in flatten(value, None) if isinstance(t, torch.Tensor)]
