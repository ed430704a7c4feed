"""FP8 copies of model weights, made once per parameter and looked up by the FP8 ops.

The compiled graph takes each weight as the bf16 parameter Dynamo passes in, and the FP8 op
fetches that parameter's FP8 copy here. The pass fills this memo at compile time, so the
normal run never quantizes a weight. Keying by the parameter actually passed at run time
(not by what was seen at compile time) keeps two cases correct that graph constants would
get silently wrong:
  - Dynamo reusing one compiled graph for another module instance of the same class
    (inline_inbuilt_nn_modules; regional compilation of repeated layers does exactly this);
  - a parameter modified in place after compiling (its version counter moves).
Either way the new weight is quantized once, at its first use. The eager module's
parameters are only read.
"""
from __future__ import annotations

import logging
import weakref

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

log = logging.getLogger("fp8compile")

# key -> (weak ref to the weight, its version when quantized, w_fp8 (N, K), w_scale)
_MEMO: dict[tuple, tuple] = {}


def _quantize(w: torch.Tensor, e8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.fp8compile.quant_weight(w, e8m0)


def _version(w: torch.Tensor) -> int | None:
    try:
        return w._version
    except RuntimeError:  # inference tensors carry no version counter
        return None


def _key(w: torch.Tensor, kn: bool, e8m0: bool) -> tuple:
    return (w.device, w.data_ptr(), tuple(w.shape), w.stride(), w.dtype, kn, e8m0)


def fp8_weight(w: torch.Tensor, kn: bool = False, e8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_fp8 (N, K), w_scale (ceil(N/128), K/128)) for a weight stored (N, K), or (K, N) if kn."""
    key = _key(w, kn, e8m0)
    entry = _MEMO.get(key)
    version = _version(w)
    if entry is not None and entry[0]() is not None and entry[1] == version:
        return entry[2], entry[3]
    if entry is not None:
        log.info("fp8compile: quantizing a weight %s at first use (%s)", tuple(w.shape),
                 "modified in place" if entry[0]() is not None else "new weight in a reused graph")
    with unset_fake_temporarily(), torch.no_grad():
        w_nk = w.detach().t() if kn else w.detach()
        w_fp8, w_scale = _quantize(w_nk.contiguous(), e8m0)
    ref = weakref.ref(w, lambda _, key=key: _MEMO.pop(key, None))
    _MEMO[key] = (ref, version, w_fp8, w_scale)
    return w_fp8, w_scale
