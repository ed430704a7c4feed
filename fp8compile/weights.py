"""FP8 copies of model weights, made once per parameter and looked up by parameter.

A compiled graph takes each weight's FP8 copy as an input, which its wrapper looks up here
from the bf16 parameter Dynamo passes in (derived.py, only when a parameter changed); the
eager ops on bf16 weights (linear, gated_linear, moe) look it up per call. The passes fill
this memo at compile time, so the normal run never quantizes a weight. Keying by the parameter
actually passed at run time (not by what was seen at compile time) keeps two cases correct that
graph constants would get silently wrong:
  - Dynamo reusing one compiled graph for another module instance of the same class
    (inline_inbuilt_nn_modules; regional compilation of repeated layers does exactly this);
  - a parameter modified in place after compiling (its version counter moves).
Either way the new weight is quantized once, at its first use. The eager module's
parameters are only read.

Two kinds of entry: a linear's weight (N, K) (or two, stacked along N: gate and up as one
GEMM), and a routed-experts block's stacked weights (E, N, K), stored in the layout the grouped
kernels read (gate rows first, then up rows). An FP8 checkpoint's experts are FP8 already: the
pass that takes them registers each weight's block scales (register_fp8_experts), and the
lookup answers with the checkpoint's own tensors.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils.weak import WeakIdKeyDictionary

from . import release
from .numerics import BLOCK, FP8_DTYPE, ceil_div, whole_blocks

log = logging.getLogger("fp8compile")

# key -> (weak refs to the source tensors, their versions when converted, the converted tensors);
# _MEMO keys by storage, shape and strides (the same weight under another tensor object hits),
# _BY_ID by the tensor objects' identity (the per-call lookup).
_MEMO: dict[tuple, tuple] = {}
_BY_ID: dict[tuple, tuple] = {}
# The keys of entries made while a compile's passes run (made_during): a list per compile running.
_RECORDING: list[list[tuple]] = []


# Weight elements quantized at once (_quantize, fp8_experts). The quantization works in fp32, with
# about 12 bytes of temporaries an element: all of Llama-3's lm_head (525 M elements) at once
# raised a compile's peak by 4.0 GB (H200, 2026-11-29; BENCHMARKS.md), and all 256 of
# DeepSeek-V3's gate|up experts took 28 GB, which an H100 holding the bf16 block did not have
# (the experts then stayed bf16). A slab of 64 M elements takes about 0.8 GB.
QUANT_CHUNK_ELEMENTS = 1 << 26


def _quantize(w: torch.Tensor, e8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K)'s 128x128-block FP8 copy (ops/quant, quant_weight), QUANT_CHUNK_ELEMENTS at a time
    in whole 128-row blocks: each block is scaled on its own, so the bits are those of the whole."""
    n, k = w.shape
    rows = max(1, QUANT_CHUNK_ELEMENTS // (BLOCK * max(k, 1))) * BLOCK
    if n <= rows:
        return torch.ops.fp8compile.quant_weight(w, e8m0)
    kp = whole_blocks(k)
    w_fp8 = torch.empty(n, kp, dtype=FP8_DTYPE, device=w.device)
    w_scale = torch.empty(ceil_div(n, BLOCK), kp // BLOCK, dtype=torch.float32, device=w.device)
    for row in range(0, n, rows):
        q, scale = torch.ops.fp8compile.quant_weight(w[row : row + rows], e8m0)
        w_fp8[row : row + q.shape[0]] = q
        w_scale[row // BLOCK : row // BLOCK + scale.shape[0]] = scale
    return w_fp8, w_scale


def version(w: torch.Tensor) -> int | None:
    try:
        return w._version
    except RuntimeError:  # inference tensors carry no version counter
        return None


def _key(w: torch.Tensor) -> tuple:
    if release.is_released(w):  # no storage to key by while its values are in host memory (release.py)
        return ("released", id(w))
    return (w.device, w.data_ptr(), tuple(w.shape), w.stride(), w.dtype)


def _memoized(sources: tuple[torch.Tensor, ...], tag: tuple, make: Callable[[], tuple]) -> tuple:
    """make() once per (sources, tag), again only when a source changed in place or is a new tensor."""
    # Every FP8 op call looks its weight up here, outside CUDA graphs on the host's critical
    # path: first by the identity of the tensors passed (a dict hit and a version check).
    fast_key = (tuple(map(id, sources)), tag)
    versions = tuple(version(w) for w in sources)
    hit = _BY_ID.get(fast_key)
    if hit is not None and hit[1] == versions and all(ref() is w for ref, w in zip(hit[0], sources)):
        return hit[2]
    key = (tuple(_key(w) for w in sources), tag)
    entry = _MEMO.get(key)
    alive = entry is not None and all(ref() is not None for ref in entry[0])
    if alive and entry[1] == versions:
        value = entry[2]
    else:
        if entry is not None:
            log.info(
                "fp8compile: converting weights %s at first use (%s)",
                [tuple(w.shape) for w in sources],
                "modified in place" if alive else "new weight in a reused graph",
            )
        with unset_fake_temporarily(), torch.no_grad(), release.temporarily_resident(sources):
            value = make()

        def forget(_, key=key):
            _MEMO.pop(key, None)

        _MEMO[key] = (tuple(weakref.ref(w, forget) for w in sources), versions, value)
        for made in _RECORDING:
            made.append(key)
    _BY_ID[fast_key] = (
        tuple(weakref.ref(w, lambda _, k=fast_key: _BY_ID.pop(k, None)) for w in sources),
        versions,
        value,
    )
    return value


@contextlib.contextmanager
def made_during() -> Iterator[list[tuple]]:
    """The keys of the entries made within the block, in a list filled as they are made."""
    made: list[tuple] = []
    _RECORDING.append(made)
    try:
        yield made
    finally:
        _RECORDING.remove(made)


def forget_made(made: list[tuple]) -> int:
    """Drop the entries of `made` (made_during's keys): the copies made by a run of the passes
    that failed and was taken back (passes/guard.py), which nothing reads, each a weight's size in
    FP8 held as long as the model lives. The run after it makes again what it rewrites. Returns
    the bytes given back."""
    freed = 0
    for key in dict.fromkeys(made):
        entry = _MEMO.pop(key, None)
        if entry is None:
            continue
        for fast_key, hit in list(_BY_ID.items()):
            if hit[2] is entry[2]:
                del _BY_ID[fast_key]
        freed += sum(t.numel() * t.element_size() for t in entry[2] if isinstance(t, torch.Tensor))
    return freed


def forget() -> int:
    """Drop every FP8 copy held here; returns how many entries there were. A graph still compiled
    keeps the copies it was last called with alive (its own inputs) until it goes
    (torch._dynamo.reset()); anything that asks again quantizes again, at its first use."""
    count = len(_MEMO)
    _MEMO.clear()
    _BY_ID.clear()
    return count


def fp8_weight(
    w: torch.Tensor,
    kn: bool = False,
    e8m0: bool = False,
    w_next: Sequence[torch.Tensor] | None = None,
    index: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_fp8 (N, Kp), w_scale (ceil(N/128), Kp/128)) for a weight stored (N, K), or (K, N) if kn;
    Kp = K in whole 128-wide groups (zero columns past K: reference.quant_weight_block).
    With w_next (more weights, same K and layout): all of them stacked along N, w's rows first,
    so linears over one x run as one GEMM (passes/merge.py); every weight but the last must then
    have whole 128-row blocks, so that no weight block spans two of them. With index: the weight
    is w[index] of experts stacked along a first dimension (memoized by w, the tensor the model
    holds, not by a view of it)."""
    sources = (w, *(w_next or ()))

    def make():
        parts = [_selected(p, index).t() if kn else _selected(p, index) for p in sources]
        for i, part in enumerate(parts[:-1]):
            if part.shape[0] % 128:
                raise ValueError(
                    f"stacking weights along N needs whole 128-row blocks, weight {i} has N={part.shape[0]}"
                )
        return _quantize(torch.cat(parts).contiguous() if len(parts) > 1 else parts[0].contiguous(), e8m0)

    return _memoized(sources, ("linear", kn, e8m0, index), make)


def _selected(w: torch.Tensor, index: int | None) -> torch.Tensor:
    return w.detach() if index is None else w.detach()[index]


def fp8_weight_scaled(
    w: torch.Tensor,
    recipe: str,
    kn: bool = False,
    e8m0: bool = False,
    w_next: Sequence[torch.Tensor] | None = None,
    index: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_weight for the scaled recipes (ops/linear/reference_scaled.py): (w_fp8 (N, K), w_scale () for
    "tensor", (N,) for "rowwise"). Stacked weights (w_next) are quantized as one: per row, the
    same as each on its own; per tensor, with the largest of their scales (the merged GEMM has
    one), each value rounded once from bf16."""
    from .ops.linear.reference_scaled import quant_weight_scaled

    sources = (w, *(w_next or ()))

    def make():
        parts = [_selected(p, index).t() if kn else _selected(p, index) for p in sources]
        stacked = torch.cat(parts) if len(parts) > 1 else parts[0]
        return quant_weight_scaled(stacked.contiguous(), recipe, e8m0)

    return _memoized(sources, ("scaled", recipe, kn, e8m0, index), make)


def stacked_bias(bias: torch.Tensor | None, bias_next: Sequence[torch.Tensor] | None) -> torch.Tensor | None:
    """The biases of linears merged into one GEMM (fp8_weight's w_next), concatenated in the same order."""
    if not bias_next:
        return bias
    sources = (bias, *bias_next)
    return _memoized(sources, ("bias",), lambda: torch.cat([b.detach() for b in sources]))


# How a routed-experts block stores its gate and up projections:
#   "concat"      one (E, 2I, K) tensor, gate rows then up rows (transformers' default)
#   "interleave"  one (E, 2I, K) tensor, gate and up rows alternating (GPT-OSS)
#   "separate"    two (E, I, K) tensors (gpt-fast's w1 and w3)
#   "none"        one (E, I, K) tensor, the up projection alone (non-gated experts: act(up(x)))
GATE_UP_LAYOUTS = ("concat", "interleave", "separate", "none")


def _gate_up_rows(w: torch.Tensor, layout: str) -> torch.Tensor:
    """(E, 2I, ...) in "interleave" order -> gate rows then up rows; other layouts unchanged."""
    return torch.cat([w[:, 0::2], w[:, 1::2]], dim=1) if layout == "interleave" else w


def _pad_intermediate(t: torch.Tensor, dim: int, halves: int) -> torch.Tensor:
    """t with each of its `halves` equal parts along dim (gate and up rows, or the whole of I)
    followed by zeros up to whole_blocks. Exact for the experts: a zero row of gate and
    up gives act(0, 0) = 0 in every activation we serve, and a zero column of the down projection
    adds nothing whatever it meets; a weight or activation block that holds the last real rows
    then has the scale of those rows alone, as a partial block of DeepSeek's FP8 checkpoints does."""
    inter = t.shape[dim] // halves
    pad = whole_blocks(inter) - inter
    if pad == 0:
        return t
    parts = t.split(inter, dim)
    shape = list(t.shape)
    shape[dim] = pad
    zeros = t.new_zeros(shape)
    return torch.cat([piece for part in parts for piece in (part, zeros)], dim)


def canonical_experts(
    w: torch.Tensor, kn: bool = False, gate_up: str | None = None, w_up: torch.Tensor | None = None
) -> torch.Tensor:
    """Stacked expert weights (E, N, K), or (E, K, N) if kn, as (E, N, K); for a gate/up
    projection (gate_up one of GATE_UP_LAYOUTS, w_up the up tensor of "separate") gate rows
    then up rows."""
    parts = [p.transpose(1, 2) if kn else p for p in (w, w_up) if p is not None]
    return _gate_up_rows(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0], gate_up)


# an FP8 checkpoint's expert weight (E, N, K) e4m3fn -> its scales (E, N/128, K/128), by identity
_CHECKPOINT_SCALES = WeakIdKeyDictionary()


def register_fp8_experts(w: torch.Tensor, scale: torch.Tensor) -> None:
    """w, an FP8 checkpoint's expert weight in the canonical layout (E, N, K) with whole 128x128
    blocks per expert, is its own FP8 copy; scale, its fp32 block scales, the copy's."""
    if w.dtype != FP8_DTYPE or w.dim() != 3 or any(size % 128 for size in w.shape[1:]):
        raise ValueError(f"an FP8 expert weight of whole 128x128 blocks, not {tuple(w.shape)} {w.dtype}")
    if scale.dtype != torch.float32 or tuple(scale.shape) != (
        w.shape[0],
        w.shape[1] // 128,
        w.shape[2] // 128,
    ):
        raise ValueError(f"fp32 block scales for {tuple(w.shape)}, not {tuple(scale.shape)} {scale.dtype}")
    _CHECKPOINT_SCALES[w] = scale


def fp8_experts(
    w: torch.Tensor,
    kn: bool = False,
    e8m0: bool = False,
    gate_up: str | None = None,
    w_up: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """canonical_experts(...) in FP8: (w_fp8 (E, N, K), w_scale (E, N/128, K/128)), each expert in
    its own 128x128 blocks, so the activation reads gate and up as two contiguous halves. The
    expert intermediate size I is padded to whole blocks with zeros (whole_blocks): the
    rows of each half of a gate/up projection (gate_up given: "none" has one half, up), the
    columns of a down projection (gate_up None: (E, H, I)). H must be a multiple of 128. A
    registered FP8 checkpoint weight is its own copy (register_fp8_experts)."""
    if w.dtype == FP8_DTYPE:
        if w not in _CHECKPOINT_SCALES or kn or w_up is not None or gate_up not in (None, "concat"):
            raise ValueError(f"an FP8 expert weight {tuple(w.shape)} that no pass registered in this layout")
        return w, _CHECKPOINT_SCALES[w]

    def make():
        stacked = canonical_experts(w.detach(), kn, gate_up, None if w_up is None else w_up.detach())
        e, n, k = stacked.shape
        hidden = k if gate_up is not None else n
        if hidden % 128:
            raise ValueError(
                f"expert weights ({e}, {n}, {k}): the hidden size {hidden} must be a multiple of 128 "
                "(128x128 blocks per expert)"
            )
        if gate_up is None:
            stacked = _pad_intermediate(stacked, 2, 1)
        else:
            stacked = _pad_intermediate(stacked, 1, 1 if gate_up == "none" else 2)
        e, n, k = stacked.shape
        # A few experts at a time (QUANT_CHUNK_ELEMENTS); the blocks are per expert, so the result
        # is the same.
        w_fp8 = torch.empty(e, n, k, dtype=FP8_DTYPE, device=stacked.device)
        w_scale = torch.empty(e, n // 128, k // 128, dtype=torch.float32, device=stacked.device)
        step = max(1, QUANT_CHUNK_ELEMENTS // (n * k))
        for i in range(0, e, step):
            part = stacked[i : i + step]
            q, scale = _quantize(part.reshape(-1, k).contiguous(), e8m0)
            w_fp8[i : i + step] = q.view(part.shape)
            w_scale[i : i + step] = scale.view(part.shape[0], n // 128, k // 128)
        return w_fp8, w_scale

    sources = (w,) if w_up is None else (w, w_up)
    return _memoized(sources, ("experts", kn, e8m0, gate_up), make)


def canonical_expert_bias(b: torch.Tensor | None, gate_up: str | None = None) -> torch.Tensor | None:
    """A stacked gate/up expert bias (E, 2I) in canonical_experts' row order (gate then up)."""
    return None if b is None else _gate_up_rows(b, gate_up)


def expert_bias(b: torch.Tensor | None, gate_up: str | None = None) -> torch.Tensor | None:
    """A stacked gate/up expert bias (E, 2I), or (E, I) for "none", in the row order and padding
    fp8_experts gives its weight."""
    halves = 1 if gate_up == "none" else 2
    if b is None or (gate_up != "interleave" and (b.shape[1] // halves) % 128 == 0):
        return b
    return _memoized(
        (b,),
        ("expert_bias", gate_up),
        lambda: _pad_intermediate(_gate_up_rows(b.detach(), gate_up), 1, halves).contiguous(),
    )
