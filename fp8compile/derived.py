"""Graph inputs computed per call from the model's tensors: the FP8 copies of its weights.

The passes rewrite a linear into an op on the weight's FP8 copy, which the graph takes as an
input of its own, appended after the inputs Dynamo passes. Per call, the compiled graph's
wrapper computes those inputs from the tensors Dynamo passed (the bf16 parameters), through
the weight memo (weights.py): no quantization after the first, and still right where Dynamo
reuses the graph for another module's parameters or a parameter changed in place. While the
parameters passed are the same tensors at the same versions as the call before (every call of
a model, in practice), the wrapper reuses that call's inputs after one identity and version
check per parameter, which is all it adds to the host's time per call. The check is a few C
loops (operator.itemgetter, map): the identity by id() (a source that dies drops the last
call's inputs through its weak reference's callback, so a live source's id is its own), the
version counters read once each. After a model's step, with the host's caches cold, reading
each parameter is most of the wrapper's time: for 32 layers of Llama's linears (225
parameters, fp8compile.demo.small_llama, a one-token call; the time from the wrapper's entry to
the graph's call, over 100 calls after 3) it took 113-125 us checked in Python, 74-88 us so (a
2-core CPU machine, 2026-11-29, two runs each).

The appended inputs are static for Inductor's CUDA graphs (static_input_idxs), like the
parameters: replayed graphs read them where they are, never copied in. Inputs the graph no
longer reads after the passes (the bf16 weights of rewritten linears) are not passed on at all:
no per-call check of them in the compiled code, and their memory can be given back (release.py).
"""

from __future__ import annotations

import dataclasses
import operator
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .weights import version


@dataclasses.dataclass(frozen=True)
class DerivedInput:
    """make(*[inputs[i] for i in sources]) -> the tensors of one or more appended graph inputs.
    memo: make looks its values up in the weight memo (weights.py: the FP8 copies of weights),
    which reads the sources' values once, at compile time, and brings a released source back
    while it quantizes again; a source read by nothing else may then leave the device
    (release.py). Any other make (stacked scales or biases, fp32 copies of scales) reads its
    sources' values at the first call and after they change: they stay."""

    sources: tuple[int, ...]
    make: Callable[..., tuple[torch.Tensor, ...]]
    memo: bool = False


class CallWithDerivedInputs:
    """A compiled graph (boxed calling convention: one list of inputs) that takes the inputs the
    caller passes at positions `keep` (the ones it reads), then `derived`, computed here from
    the inputs passed."""

    _boxed_call = True

    def __init__(self, compiled: Callable, derived: list[DerivedInput], keep: list[int] | None = None):
        self.compiled = compiled
        self.derived = derived
        self.keep = keep  # None: all of them
        self._sources = sorted({i for d in derived for i in d.sources})
        self._pick_sources = _picker(self._sources)
        self._pick_kept = None if keep is None else _picker(keep)
        # the last call's sources: weak references (whose callbacks forget the rest), ids,
        # versions; and the values derived from them
        self._last: tuple[list[weakref.ref], list[int], list[int | None], list[torch.Tensor]] | None = None

    def __call__(self, args: list[Any]) -> Any:
        values: list[torch.Tensor] = []
        if self.derived:
            sources = self._pick_sources(args)
            ids = list(map(id, sources))
            versions = _versions(sources)
            last = self._last
            if last is not None and last[1] == ids and last[2] == versions:
                values = last[3]
            else:
                values = [v for d in self.derived for v in d.make(*[args[i] for i in d.sources])]
                refs = [weakref.ref(t, self._forget) for t in sources]
                self._last = (refs, ids, versions, values)
        full = list(args) if self._pick_kept is None else self._pick_kept(args)
        args.clear()  # the boxed convention: the callee owns the inputs from here
        full.extend(values)
        return self.compiled(full)

    def _forget(self, _ref) -> None:
        # A parameter of the last call is gone: so are the reason to keep its FP8 copies alive,
        # and the promise that no other tensor has its id.
        self._last = None

    def __getattr__(self, name: str) -> Any:  # what Inductor and AOTAutograd read off a compiled graph
        return getattr(self.__dict__["compiled"], name)


def _picker(indices: list[int]) -> Callable[[list[Any]], list[Any]]:
    """args -> [args[i] for i in indices], in C (operator.itemgetter gives one item, not a
    tuple, for a single index)."""
    if not indices:
        return lambda args: []
    if len(indices) == 1:
        (index,) = indices
        return lambda args: [args[index]]
    get = operator.itemgetter(*indices)
    return lambda args: list(get(args))


_VERSION = operator.attrgetter("_version")


def _versions(tensors: list[torch.Tensor]) -> list[int | None]:
    try:
        return list(map(_VERSION, tensors))
    except RuntimeError:  # an inference tensor carries no version counter
        return [version(t) for t in tensors]
