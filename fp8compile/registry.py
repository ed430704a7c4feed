"""Which kernel runs each FP8 op: one registry, per op, device, M range and shape.

Every backend says, for a request, either that it can serve it or why not; the registry
walks the preference order (Fp8Config.backends, or DEFAULT_ORDER) and takes the first that
can. Vendor libraries are imported here only, lazily, when a backend is asked about.
"""
from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

import torch

OPS = ("linear", "gemm", "quant_act")


@dataclasses.dataclass(frozen=True)
class Request:
    """One op call site: what a kernel must handle. m_max None = unbounded."""

    op: str
    device: torch.device
    n: int
    k: int
    m_min: int = 1
    m_max: int | None = None
    batch_invariant: bool = False
    e8m0: bool = False

    @property
    def m_range(self) -> str:
        hi = "inf" if self.m_max is None else str(self.m_max)
        return f"M in [{self.m_min}, {hi}]"


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    # op name -> its kernel, or "module:function" naming it (imported on first use).
    ops: dict[str, str | Callable]
    # request -> None if this backend can serve it, else the reason it cannot.
    why_not: Callable[[Request], str | None]

    def implementation(self, op: str) -> Callable:
        kernel = self.ops[op]
        if callable(kernel):
            return kernel
        module, _, fn = kernel.partition(":")
        return getattr(importlib.import_module(module, __package__), fn)


def _reference_why_not(request: Request) -> str | None:
    return None  # pure PyTorch: any device, any M, any shape the recipe allows


_BACKENDS: dict[str, Backend] = {
    "reference": Backend(
        name="reference",
        ops={
            "linear": ".ops.reference:linear_block",
            "gemm": ".ops.reference:gemm_block",
            "quant_act": ".ops.reference:quant_act_block",
        },
        why_not=_reference_why_not,
    ),
}


def register(backend: Backend, *, first: bool = False) -> None:
    """Add a backend (replacing one of the same name); `first` puts it at the front of the
    default order, else it goes just before "reference", which always stays last."""
    global DEFAULT_ORDER
    _BACKENDS[backend.name] = backend
    order = [n for n in DEFAULT_ORDER if n != backend.name]
    order.insert(0 if first else len(order) - 1, backend.name)
    DEFAULT_ORDER = tuple(order)


def names() -> tuple[str, ...]:
    return tuple(_BACKENDS)


# Preference order when Fp8Config.backends is None. Faster backends go in front of
# "reference" as the kernels land, in the order the benchmarks rank them.
DEFAULT_ORDER = ("reference",)


@dataclasses.dataclass(frozen=True)
class Choice:
    backend: str
    rejected: tuple[tuple[str, str], ...]  # (backend, why not), in preference order

    def explain(self) -> str:
        lines = [f"{name}: {why}" for name, why in self.rejected]
        return "; ".join(lines)


def why_not(backend: str, request: Request) -> str | None:
    if backend not in _BACKENDS:
        return f"unknown backend (valid: {', '.join(names())})"
    b = _BACKENDS[backend]
    if request.op not in b.ops:
        return f"no {request.op} kernel"
    return b.why_not(request)


def choose(request: Request, order: tuple[str, ...] | None = None) -> Choice:
    """First backend in `order` that serves `request`; RuntimeError naming every reason if none."""
    order = DEFAULT_ORDER if order is None else order
    rejected = []
    for name in order:
        reason = why_not(name, request)
        if reason is None:
            return Choice(name, tuple(rejected))
        rejected.append((name, reason))
    detail = "; ".join(f"{n}: {r}" for n, r in rejected)
    raise RuntimeError(
        f"no backend in {list(order)} can run {request.op} (N={request.n}, K={request.k}, "
        f"{request.m_range}) on {request.device}: {detail}"
    )


def implementation(op: str, backend: str) -> Callable:
    if backend not in _BACKENDS or op not in _BACKENDS[backend].ops:
        raise RuntimeError(f"backend {backend!r} has no {op!r} kernel (backends: {', '.join(names())})")
    return _BACKENDS[backend].implementation(op)
