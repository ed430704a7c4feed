"""Giving back the device memory of bf16 weights that no compiled graph reads
(Fp8Config(release_bf16_weights=True)).

The compiled graphs read a rewritten linear's weight only through its FP8 copy, a graph input
of its own (derived.py), so the bf16 parameter, half again as many bytes, sits unused beside it.
Released, a parameter keeps its tensor object, shape, strides, dtype and device (what Dynamo's
guards and the compiled graphs check), and its values move to host memory: its device storage
is resized to zero bytes. Nothing is lost: restore() copies the values back into the same
tensor (the eager model then runs again), and a graph compiled later that reads a released
parameter in bf16 gets it back first (the backend calls resident()). The passes release each
weight as soon as its FP8 copy is made (passes/context.py), so compiling a model whose bf16
weights and FP8 copies do not fit on the device together needs room for one copy at a time;
what the compiled graph still reads in bf16 comes back before it runs, and a compile that
fails gives every weight back.

Eager code still runs, with the model's own numbers: while any parameter is released, a module
forward pre-hook lends an eager call of a module that holds one its values, copied in from host
memory before the module's forward and freed again after it (a forward hook that runs even
when the forward raises). Each such call pays a host-to-device copy of the bytes it lends, and
holds them on the device only while it runs, one module at a time; a warning says so once.
Eager code includes the prompt step of transformers' generate() with a CompileConfig, which
compiles the decode step only: on an FP8 checkpoint whose bf16 lm_head is released, that is the
lm_head's bytes once a prompt; on a bf16 model, every linear's. Compile the model's forward
itself (model.forward = torch.compile(model.forward, ...)) to run both through the graphs, with
no copy. A parameter some compiled graph reads in bf16 (an embedding tied to the lm_head, the
routed experts, whose op looks their FP8 copies up per call) is never released (keep_resident),
nor is one that two modules hold (shared): a tied embedding may run outside every such graph.
Another backend's graphs read the bf16 parameters themselves, and nothing of fp8compile runs
in them: compile the model with another backend only after restore().
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterable, Iterator

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import shards

log = logging.getLogger(__name__)

# parameter -> its values in host memory, while released (by identity: tensors compare elementwise)
_RELEASED = WeakIdKeyDictionary()
# parameters a compiled graph reads in bf16: never released
_PINNED = WeakIdKeyDictionary()
# module -> the released parameters its eager calls running now were lent, a list a call
_LENT = WeakIdKeyDictionary()
_hooks: tuple = ()  # the eager-call hooks (lend, give back), installed while anything is released
_warned = False


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
        _copy_in(p, host)
        restored += host.numel()
    _check_eager_calls(bool(_RELEASED))
    return restored


def _copy_in(p: torch.Tensor, host: torch.Tensor) -> None:
    """p's device storage back at its size, with its values from host."""
    storage = p.untyped_storage()
    storage.resize_(host.numel())
    storage.copy_(host.untyped_storage())  # storage-level: the tensor's version counter does not move


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


def shared(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Those of params that more than one dict holds: a parameter two modules register (an lm_head
    tied to the embedding), which the module that is not the rewritten linear reads in bf16,
    maybe outside every graph fp8compile compiles (JetMoE's embedding runs where Dynamo falls
    back to eager). One scan of the objects the garbage collector tracks: 50-85 ms on the CPU with
    a small JetMoE loaded, before and after its compile, when only its tied lm_head came out
    shared (2026-11-29, ca2730b's tree);
    what else holds a parameter in a dict makes it shared too, which only keeps it resident."""
    params = list(params)
    referrers = gc.get_referrers(*params)  # before the dict below, which holds them all too
    by_id = {id(p): p for p in params}
    holders: dict[int, int] = {}
    for referrer in referrers:
        if isinstance(referrer, dict):
            for value in referrer.values():
                if id(value) in by_id:
                    holders[id(value)] = holders.get(id(value), 0) + 1
    return [by_id[i] for i, n in holders.items() if n > 1]


def _owns_storage(p: torch.Tensor) -> bool:
    """Whether p is the whole of its storage (no other view of it holds values elsewhere in it),
    and that storage can be freed: not a file mapped into memory (safetensors' tensors loaded
    on the CPU by from_pretrained), which holds no device memory and cannot be resized."""
    storage = p.untyped_storage()
    whole = p.storage_offset() == 0 and p.is_contiguous() and storage.nbytes() == p.numel() * p.element_size()
    return whole and storage.resizable()


def _lend(module: torch.nn.Module, args) -> None:
    """Before an eager call of `module`: its released parameters get their values back on the
    device for the call (the host copy stays; _give_back frees the device's again)."""
    if torch.compiler.is_compiling():
        return
    lent = [
        t
        for p in module._parameters.values()
        if p is not None
        for t in shards.inner_tensors(p)  # a DTensor: its shard
        if t in _RELEASED and t.untyped_storage().nbytes() == 0  # not lent already (a nested call)
    ]
    _LENT.setdefault(module, []).append(lent)
    if not lent:
        return
    global _warned
    if not _warned:
        _warned = True
        log.warning(
            "fp8compile: an eager call of %s, whose bf16 weights were released "
            "(Fp8Config(release_bf16_weights=True)), copies them in from host memory for the call "
            "and frees them after, at every such call. With transformers' generate() and a "
            "CompileConfig the prompt runs eagerly: compile model.forward itself to run it through "
            "the graphs, with no copy.",
            type(module).__name__,
        )
    for t in lent:
        _copy_in(t, _RELEASED[t])


def _give_back(module: torch.nn.Module, args, output) -> None:
    """After an eager call of `module` (returned or raised): what _lend lent it leaves the device."""
    if torch.compiler.is_compiling():
        return
    calls = _LENT.get(module)
    if not calls:
        return
    for t in calls.pop():
        if t in _RELEASED:  # not made resident meanwhile
            t.untyped_storage().resize_(0)


def _check_eager_calls(on: bool) -> None:
    global _hooks
    if on and not _hooks:
        _hooks = (
            torch.nn.modules.module.register_module_forward_pre_hook(_lend),
            torch.nn.modules.module.register_module_forward_hook(_give_back, always_call=True),
        )
    elif not on and _hooks:
        for hook in _hooks:
            hook.remove()
        _hooks = ()
