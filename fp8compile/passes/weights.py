"""Compile-time weight quantization, once per (parameter, layout, recipe), and the guard that
keeps a compiled graph from silently using FP8 weights of a parameter changed since.

The eager module's parameters are only read: quantization makes new tensors.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils.weak import WeakIdKeyDictionary

_CACHE: WeakIdKeyDictionary = WeakIdKeyDictionary()  # param -> {(transposed, e8m0): (version, w_fp8, w_scale)}


def _quantize(w: torch.Tensor, e8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.fp8compile.quant_weight(w, e8m0)


def _version(param: torch.Tensor) -> int | None:
    try:
        return param._version
    except RuntimeError:  # inference tensors carry no version counter
        return None


def quantized_weight(param: torch.nn.Parameter, transposed: bool, e8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_fp8 (N, K), w_scale) for a weight stored as (N, K), or as (K, N) when transposed.

    Cached per parameter: a recompile (new M specialization, a graph break) reuses the same
    FP8 tensors instead of quantizing and storing the weight again.
    """
    entries = _CACHE.setdefault(param, {})
    key = (transposed, e8m0)
    version = _version(param)
    if key in entries and entries[key][0] == version:
        return entries[key][1:]
    with unset_fake_temporarily(), torch.no_grad():
        w = param.detach()
        w = w.t() if transposed else w
        w_fp8, w_scale = _quantize(w.contiguous(), e8m0)
    entries[key] = (version, w_fp8, w_scale)
    return w_fp8, w_scale


class WeightGuard:
    """Raises at call time if a parameter was modified in place after its FP8 copy was made."""

    def __init__(self, params: list[tuple[str, torch.nn.Parameter]]):
        self._checks = [(name, p, _version(p)) for name, p in params if _version(p) is not None]

    def __bool__(self) -> bool:
        return bool(self._checks)

    def __call__(self) -> None:
        for name, param, version in self._checks:
            if param._version != version:
                raise RuntimeError(
                    f"parameter {name} was modified in place after torch.compile(backend='fp8') quantized it; "
                    "the compiled graph holds FP8 copies made at compile time. Recompile after changing "
                    "weights (torch._dynamo.reset(), then torch.compile again)."
                )
