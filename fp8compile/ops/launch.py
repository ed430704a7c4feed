"""Launch a @triton.jit kernel with less host work than `kernel[grid](...)`.

Outside a CUDA graph every FP8 op pays its kernel launch on the host, and a decode step is
host-bound (BENCHMARKS.md, "Whole models"). `kernel[grid](*args)` binds and specializes every
argument, hashes the result and looks the compiled kernel up on every call. Here the compiled
kernel is kept per call signature, keyed by what Triton specializes on (each tensor's dtype and
16-byte alignment; each int's == 1, % 16 and 64-bit range; each TMA descriptor's block, dtype,
shape and strides; the constexprs and launch options), and relaunched through the compiled
kernel's C launcher directly while no launch hook is set, else through its runner, which builds
the launch metadata and calls the hooks (so profilers still see every launch).
The first call of a signature, and an argument of another kind, take Triton's own path; so does
every call after a relaunch the installed Triton refuses (its launcher taking other arguments).
"""

from __future__ import annotations

import functools
import logging

import torch

try:
    from triton import knobs as _knobs
except ImportError:  # no Triton, or one without knobs: every launch takes Triton's own path
    _knobs = None

try:
    from triton.runtime import _allocation as _triton_allocation
except ImportError:  # no Triton, or one without runtime allocations: no kernel of ours asks for one
    _triton_allocation = None

log = logging.getLogger("fp8compile")
# The current device and its current stream's handle, one C call each.
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda index: torch.cuda.current_stream(index).cuda_stream
)
# Signatures a Launcher keeps (a TMA descriptor's key holds its shape, so a GEMM over varying M
# adds one per M); past this many it forgets them all and relearns from Triton's own path.
MAX_SIGNATURES = 1024


def device_index(device: torch.device) -> int:
    """The CUDA device's index; the current device's for a bare "cuda"."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def capability(device_index: int) -> tuple[int, int]:
    """The GPU's compute capability, asked of the driver once (what a kernel's why_not checks
    on every call)."""
    return torch.cuda.get_device_capability(device_index)


@functools.cache
def num_sms(device_index: int) -> int:
    """The GPU's streaming multiprocessors: what persistent and split-K grids are sized by."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def shared_memory(device_index: int) -> int:
    """The most shared memory one block of a kernel may ask for, in bytes (opted in): 227 KiB on
    an H100 or H200, 163 KiB on an A100, 99 KiB on Ada."""
    return torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for a launch (what a kernel that builds its TMA descriptors on the device
    writes them into), from torch's caching allocator: ordered on the current stream, and from
    the graph's pool while a CUDA graph is captured. Its blocks are 512-byte aligned, more than
    Triton asks (128)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_scratch_allocator() -> None:
    """Give Triton an allocator for launch scratch where none is set (Triton's default refuses
    every allocation); one the user or another library set is left in place. Triton keeps it in
    a context variable, which a new thread starts without: callers ask before each launch (a
    lookup, no allocation)."""
    if _triton_allocation is None:
        return
    current = _triton_allocation._allocator.get()
    if isinstance(current, _triton_allocation.NullAllocator):
        _triton_allocation._allocator.set(_scratch)


def _arg_key(a):
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, bool) or a is None:
        return a
    if isinstance(a, int):
        return a == 1, a % 16 == 0, not -(2**31) <= a < 2**31
    if isinstance(a, float):
        return float
    block = getattr(a, "block_shape", None)  # a host TMA descriptor
    if block is not None:
        return tuple(block), a.base.dtype, a.base.data_ptr() % 16 == 0, tuple(a.shape), tuple(a.strides)
    raise TypeError(type(a))


def _signature(args: tuple) -> tuple:
    """What Triton specializes a call on, per argument (_arg_key), with plain tensors and ints,
    nearly every argument of a decode launch, inline: this runs on every launch."""
    key = []
    for a in args:
        kind = type(a)
        if kind is torch.Tensor:
            key.append((a.dtype, not a.data_ptr() & 15))
        elif kind is int:
            key.append((a == 1, not a & 15, not -(2**31) <= a < 2**31))
        else:
            key.append(_arg_key(a))
    return tuple(key)


def _no_hooks() -> bool:
    """Whether Triton has no launch hooks set (a profiler such as proton sets them): then a
    launch needs no launch metadata and no hook calls. Triton 3.6 and newer hold the hooks as
    HookChain objects that are never None, only empty."""
    if _knobs is None:
        return False
    hooks = (_knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook)
    return all(hook is None or (hasattr(hook, "calls") and not hook.calls) for hook in hooks)


class Launcher:
    """launcher(grid, args, constexprs, **options) == kernel[grid](*args, **constexprs, **options),
    where args are the kernel's leading, non-constexpr parameters in order."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled: dict[tuple, tuple] = {}
        self.relaunch = True  # False once the installed Triton refused a direct relaunch

    def __call__(self, grid: tuple, args: tuple, constexprs: dict, **options):
        self.launch(grid, args, constexprs, options, (tuple(constexprs.items()), tuple(options.items())))

    def launch(self, grid: tuple, args: tuple, constexprs: dict, options: dict, static_key) -> None:
        """The call, with static_key standing for constexprs and options in the signature key: any
        hashable that is equal only where they are equal. A caller that relaunches with the same
        ones passes an object it keeps (compared by identity, no hashing of their values per
        call: gluon_gemm's three layouts cost about 20 us of it a call)."""
        try:
            key = (_signature(args), static_key)
        except TypeError:
            self.kernel[grid](*args, **constexprs, **options)
            return
        hit = self.compiled.get(key) if self.relaunch else None
        if hit is None:
            compiled = self.kernel[grid](*args, **constexprs, **options)
            if compiled is not None and hasattr(compiled, "run"):  # None under the CPU interpreter
                # Triton's launcher takes every parameter in signature order, constexprs included.
                tail = tuple(constexprs[name] for name in self.kernel.arg_names[len(args) :])
                if len(self.compiled) >= MAX_SIGNATURES:  # shapes that vary call to call: start over
                    self.compiled.clear()
                self.compiled[key] = (compiled, tail)
            return
        compiled, tail = hit
        grid = (*grid, 1, 1)
        try:
            if _no_hooks():
                # What the compiled kernel's runner does, without building launch metadata for hooks
                # that are not there: the current stream (asked of torch's C API, as Inductor's
                # launchers do), then Triton's C launcher.
                stream = _current_stream(_current_device())
                compiled.run(
                    grid[0],
                    grid[1],
                    grid[2],
                    stream,
                    compiled.function,
                    compiled.packed_metadata,
                    None,
                    None,
                    None,
                    *args,
                    *tail,
                )
            else:
                compiled[grid[:3]](*args, *tail)
        except (TypeError, ValueError, SystemError, AttributeError) as refused:  # before anything launched
            log.warning(
                "fp8compile: Triton refused a direct relaunch of %s (%s); using its own launch path",
                getattr(self.kernel, "__name__", self.kernel),
                refused,
            )
            self.relaunch = False
            self.kernel[grid[:3]](*args, **constexprs, **options)
