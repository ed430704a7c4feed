"""Giving back the device memory of bf16 weights that no compiled graph reads
(Fp8Config(release_bf16_weights=True)).

The compiled graphs read a rewritten linear's weight only through its FP8 copy, a graph input
of its own (derived.py), so the bf16 parameter, half again as many bytes, sits unused beside it.
Released, a parameter keeps its tensor object, shape, strides, dtype and device (what Dynamo's
guards and the compiled graphs check), and its values move to host memory: its device storage
is resized to zero bytes. Nothing is lost: restore() copies the values back into the same
tensor (the eager model then runs again), and a graph compiled later that reads a released
parameter in bf16 gets it back first (the backend calls resident()).

Until then the eager model cannot run (PyTorch would read freed memory): while any parameter
is released, a module forward pre-hook refuses an eager call of a module that holds one, with
what to do. Eager code includes the prompt step of transformers' generate() with a
CompileConfig, which compiles the decode step only: compile the model's forward itself
(model.forward = torch.compile(model.forward, ...)) to run both through the graphs. A
parameter some compiled graph reads in bf16 (an embedding tied to the lm_head, the routed
experts, whose op looks their FP8 copies up per call) is never released (keep_resident).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import shards

# parameter -> its values in host memory, while released (by identity: tensors compare elementwise)
_RELEASED = WeakIdKeyDictionary()
# parameters a compiled graph reads in bf16: never released
_PINNED = WeakIdKeyDictionary()
_hook = None  # the eager-call check, installed while anything is released


def is_released(t: torch.Tensor) -> bool:
    return t in _RELEASED


def release(params: Iterable[torch.Tensor]) -> int:
    """Move each parameter's values to host memory and free its device storage; returns the
    bytes given back (on a CPU the same mechanism gives nothing back: the values move from one
    host buffer to another). Parameters already released, views of part of a storage (freeing
    it would take other tensors' values too) and storages that cannot be freed (a mapped file)
    are left as they are."""
    freed = 0
    with torch.no_grad():
        for p in params:
            if p in _RELEASED or p in _PINNED or not _owns_storage(p):
                continue
            storage = p.untyped_storage()
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=p.device.type == "cuda")
            host.untyped_storage().copy_(storage)
            _RELEASED[p] = host
            freed += storage.nbytes()
            storage.resize_(0)
    _check_eager_calls(bool(_RELEASED))
    return freed


def resident(params: Iterable[torch.Tensor]) -> int:
    """Give released parameters their device storage and values back; returns the bytes restored."""
    restored = 0
    for p in params:
        host = _RELEASED.pop(p, None)
        if host is None:
            continue
        storage = p.untyped_storage()
        storage.resize_(host.numel())
        storage.copy_(host.untyped_storage())  # storage-level: the tensor's version counter does not move
        restored += host.numel()
    _check_eager_calls(bool(_RELEASED))
    return restored


def keep_resident(params: Iterable[torch.Tensor]) -> None:
    """These parameters are read in bf16 by a compiled graph: back on the device if released,
    and never released from now on."""
    params = list(params)
    resident(params)
    for p in params:
        _PINNED[p] = True


@contextlib.contextmanager
def temporarily_resident(params: Iterable[torch.Tensor]) -> Iterator[None]:
    """The released ones among params on their device for the block (a weight quantized again
    at first use in a reused graph), released again after it."""
    back = [p for p in params if p in _RELEASED]
    resident(back)
    try:
        yield
    finally:
        release(back)


def restore() -> int:
    """Every released parameter back on its device (the eager model runs again); returns the bytes."""
    return resident(list(_RELEASED.keys()))


def _owns_storage(p: torch.Tensor) -> bool:
    """Whether p is the whole of its storage (no other view of it holds values elsewhere in it),
    and that storage can be freed: not a file mapped into memory (safetensors' tensors loaded
    on the CPU by from_pretrained), which holds no device memory and cannot be resized."""
    storage = p.untyped_storage()
    whole = p.storage_offset() == 0 and p.is_contiguous() and storage.nbytes() == p.numel() * p.element_size()
    return whole and storage.resizable()


def _refuse_eager(module: torch.nn.Module, args) -> None:
    if torch.compiler.is_compiling():
        return
    for name, p in module._parameters.items():
        if p is not None and any(t in _RELEASED for t in shards.inner_tensors(p)):  # a DTensor: its shard
            raise RuntimeError(
                f"fp8compile released the bf16 values of this {type(module).__name__}'s {name!r} "
                "(Fp8Config(release_bf16_weights=True)): the compiled graphs read its FP8 copy, "
                "but an eager call cannot run. Run the model through its compiled graphs (with "
                "transformers' generate(), compile model.forward itself: a CompileConfig compiles the "
                "decode step only, the prompt runs eagerly), or call fp8compile.restore_bf16_weights() "
                "first."
            )


def _check_eager_calls(on: bool) -> None:
    global _hook
    if on and _hook is None:
        _hook = torch.nn.modules.module.register_module_forward_pre_hook(_refuse_eager)
    elif not on and _hook is not None:
        _hook.remove()
        _hook = None
