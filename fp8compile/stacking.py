"""Weights stacked along N in one storage that each of them views: an FP8 checkpoint's q|k|v or
gate|up as one GEMM's weight, with no second copy.

A bf16 model's merged linears read a stacked FP8 copy that the weight memo makes (weights.py):
the bf16 weights stay beside it, and the copy is the price of FP8. An FP8 checkpoint's weights
are the FP8 weights: a stacked copy beside them would put q|k|v and gate|up, most of a layer's
bytes, in memory twice. So the stack is made once, and then each weight's parameter is pointed
at its rows of the stack (`param.data = stack[rows]`): the values, shapes, dtypes and devices
the model sees do not change, its eager forward reads the same numbers, and the weights' own
storage is freed. Found again later (another graph of the same model), the stack is the
storage the weights already share: no copy. transformers saves such views as separate tensors
(save_pretrained clones disjoint views of one storage).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily


def spanning(weights: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The (N1 + ... + Nk, K) tensor over the storage the weights share, where they are its
    consecutive row ranges in this order (each contiguous); else None."""
    first = weights[0]
    storage = first.untyped_storage()
    offset = first.storage_offset()
    k = first.shape[1]
    for w in weights:
        if (
            w.dim() != 2
            or w.shape[1] != k
            or not w.is_contiguous()
            or w.dtype != first.dtype
            or w.untyped_storage().data_ptr() != storage.data_ptr()
            or w.storage_offset() != offset
        ):
            return None
        offset += w.numel()
    rows = sum(w.shape[0] for w in weights)
    whole = torch.empty(0, dtype=first.dtype, device=first.device)
    return whole.set_(storage, first.storage_offset(), (rows, k), (k, 1))


def stack_in_place(*weights: torch.Tensor) -> tuple[torch.Tensor]:
    """(the weights stacked along N,): the storage they share already (spanning), or a new
    stack that each weight, a parameter, is then pointed at (its own storage freed)."""
    with unset_fake_temporarily(), torch.no_grad():  # made while compiling, then per changed call
        found = spanning(weights)
        if found is not None:
            return (found,)
        stack = torch.cat([w.detach() for w in weights])
        row = 0
        for w in weights:
            w.data = stack[row : row + w.shape[0]]
            row += w.shape[0]
        return (stack,)
