"""Launch a @triton.jit kernel with less host work than `kernel[grid](...)`.

Outside a CUDA graph every FP8 op pays its kernel launch on the host, and a decode step is
host-bound (BENCHMARKS.md, "Whole models"). `kernel[grid](*args)` binds and specializes every
argument, hashes the result and looks the compiled kernel up on every call. Here the compiled
kernel is kept per call signature, keyed by what Triton specializes on (each tensor's dtype and
16-byte alignment; each int's == 1, % 16 and 64-bit range; each TMA descriptor's block, dtype,
shape and strides; the constexprs and launch options), and relaunched through the compiled
kernel's own launcher (which still calls Triton's launch hooks, so profilers see every launch).
The first call of a signature, and an argument of another kind, take Triton's own path; so does
every call after a relaunch the installed Triton refuses (its launcher taking other arguments).
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("fp8compile")


def _arg_key(a):
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, bool) or a is None:
        return a
    if isinstance(a, int):
        return a == 1, a % 16 == 0, not -2**31 <= a < 2**31
    if isinstance(a, float):
        return float
    block = getattr(a, "block_shape", None)  # a host TMA descriptor
    if block is not None:
        return tuple(block), a.base.dtype, a.base.data_ptr() % 16 == 0, tuple(a.shape), tuple(a.strides)
    raise TypeError(type(a))


class Launcher:
    """launcher(grid, args, constexprs, **options) == kernel[grid](*args, **constexprs, **options),
    where args are the kernel's leading, non-constexpr parameters in order."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled: dict[tuple, object] = {}
        self.relaunch = True  # False once the installed Triton refused a direct relaunch

    def __call__(self, grid: tuple, args: tuple, constexprs: dict, **options):
        try:
            key = (tuple(map(_arg_key, args)), tuple(constexprs.items()), tuple(options.items()))
        except TypeError:
            self.kernel[grid](*args, **constexprs, **options)
            return
        hit = self.compiled.get(key) if self.relaunch else None
        if hit is None:
            compiled = self.kernel[grid](*args, **constexprs, **options)
            if compiled is not None and hasattr(compiled, "run"):  # None under the CPU interpreter
                # Triton's launcher takes every parameter in signature order, constexprs included.
                tail = tuple(constexprs[name] for name in self.kernel.arg_names[len(args):])
                self.compiled[key] = (compiled, tail)
            return
        compiled, tail = hit
        try:
            compiled[(*grid, 1, 1)[:3]](*args, *tail)
        except (TypeError, ValueError, SystemError) as refused:  # before anything launched: the arguments do not parse
            log.warning("fp8compile: Triton refused a direct relaunch of %s (%s); using its own launch path",
                        getattr(self.kernel, "__name__", self.kernel), refused)
            self.relaunch = False
            self.kernel[grid](*args, **constexprs, **options)
