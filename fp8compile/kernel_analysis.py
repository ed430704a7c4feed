"""Inductor's analysis of a user-defined Triton kernel, done once per specialization while our
graphs compile.

For every launch of a user-defined Triton kernel in a graph (ir.UserDefinedTritonKernel, and
the functionalization of triton_kernel_wrapper_mutation), Inductor asks which tensors the kernel
reads and writes: torch._higher_order_ops.triton_kernel_wrap.identify_accessed_tensors (older
torch: identify_mutated_tensors) builds the kernel's TTIR with Triton's front end and walks it.
It does so at every call site, though the answer depends only on the kernel and on what its
generate_ttir makes of the arguments: a symbolic size becomes 2, a fake tensor (or an IR
buffer) an empty tensor of its dtype, a TMA descriptor its block shape, anything else goes in as
it is. Our traced launches (passes/inline.py) put one decode kernel per linear into a graph of
static M: 129 in a 32-layer Llama, where Inductor's lowering took 13.8 s against bf16
Inductor's 3.0 s for the same model (H200, BENCHMARKS.md, 2026-11-26 (18e8dc2)).

memoized() answers a repeated question from a table keyed on exactly those inputs, and asks
Inductor where the key cannot be formed (a real tensor, whose address Triton would specialize
on; an argument that is not hashable). Each answer handed out is a copy, so no caller sees
another's changes.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
from typing import Any

import torch

# The functions of torch._higher_order_ops.triton_kernel_wrap that answer the question, by the
# name each torch version has.
ANALYSES = ("identify_accessed_tensors", "identify_mutated_tensors")
_ANSWERS: dict[tuple, Any] = {}
stats = {"asked": 0, "answered": 0}  # calls of the analysis, and how many the table answered


def argument_key(value: Any) -> tuple | None:
    """What generate_ttir keeps of one kernel argument; None where it keeps more than a key says
    (a real tensor) or the value cannot key a table."""
    import sympy
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, sympy.Expr)):
        return ("symbolic",)
    if isinstance(value, FakeTensor):
        return ("tensor", value.dtype)
    if _is_ir_tensor(value):  # generate_ttir reads its .dtype; an IR node without one is not keyed
        dtype = getattr(value, "dtype", None)
        return None if dtype is None else ("tensor", dtype)
    if isinstance(value, torch.Tensor):
        return None
    try:
        hash(value)
    except TypeError:
        return None
    return ("value", type(value), value)


def _is_ir_tensor(value: Any) -> bool:
    ir = sys.modules.get("torch._inductor.ir")  # imported by any compile that lowers a graph
    return ir is not None and isinstance(value, ir.TensorBox)


def call_key(kernel: Any, kwargs: dict[str, Any], tma_descriptor_metadata: Any) -> tuple | None:
    """The table's key for one question, or None where there is none."""
    args = []
    for name in sorted(kwargs):
        key = argument_key(kwargs[name])
        if key is None:
            return None
        args.append((name, key))
    try:
        hash(kernel)
    except TypeError:
        return None
    return (kernel, tuple(args), repr(sorted((tma_descriptor_metadata or {}).items())), _target())


def _target() -> str:
    """The GPU Triton builds TTIR for (generate_ttir asks the active driver)."""
    try:
        import triton

        return repr(triton.runtime.driver.active.get_current_target())
    except Exception:  # no driver (a CPU machine): the question is asked of no GPU
        return ""


def _memo(analysis):
    @functools.wraps(analysis)
    def answer(kernel, kwargs, tma_descriptor_metadata, *args, **more):
        stats["asked"] += 1
        key = call_key(kernel, kwargs, tma_descriptor_metadata) if not (args or more) else None
        if key is None:
            return analysis(kernel, kwargs, tma_descriptor_metadata, *args, **more)
        if key not in _ANSWERS:
            _ANSWERS[key] = analysis(kernel, kwargs, tma_descriptor_metadata)
        else:
            stats["answered"] += 1
        return copy.deepcopy(_ANSWERS[key])

    answer.__wrapped_analysis__ = analysis
    return answer


@contextlib.contextmanager
def memoized():
    """While our graphs compile: Inductor's kernel analyses answered once per key."""
    try:
        from torch._higher_order_ops import triton_kernel_wrap as wrap
    except ImportError:  # a torch without user-defined Triton kernels in graphs
        yield
        return
    saved = {name: getattr(wrap, name) for name in ANALYSES if hasattr(wrap, name)}
    for name, analysis in saved.items():
        if not hasattr(analysis, "__wrapped_analysis__"):  # a compile inside a compile: wrapped once
            setattr(wrap, name, _memo(analysis))
    try:
        yield
    finally:
        for name, analysis in saved.items():
            setattr(wrap, name, analysis)
