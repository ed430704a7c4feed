"""The sum all-reduce on PyTorch's symmetric memory (torch.distributed._symmetric_memory): each
rank's input copied into a buffer every rank of the group can read, then one kernel per rank.

At a decode step's sizes (8 KB a rank for a batch of one at hidden 4096) NCCL's ring is latency:
several steps of handshakes between the GPUs for a few kilobytes. Symmetric memory's one-shot
kernel has every rank read every peer's buffer over NVLink and add them, one barrier before and
one after: one kernel, world x bytes read a rank. Past a size, its two-shot kernel (a reduce-
scatter, then an all-gather, over the same buffer) reads less; past the buffer, NCCL.
ONE_SHOT_READ_BYTES and BUFFER_BYTES come from `bench allreduce` (BENCHMARKS.md, "Tensor parallel:
the lm_head back in the graph, and the all-reduce on symmetric memory"; 2 x H200 over NVLink,
each in a CUDA graph): at 2 ranks the one-shot kernel took
6.8 us for 8 KB (NCCL 11.3) and stayed ahead of the two-shot one up to 1 MiB a rank (14.8 us
against 16.1; NCCL 18.7), behind it at 2 MiB (21.5 against 19.0); the two-shot kernel took
27.4 us for 4 MiB (NCCL 37.6). The multicast (multimem) kernels are not used: they need NVLink
multicast, which hosts turn off (the GPU kit's does).

One buffer per (group, device), kept while the group lives (a captured graph holds its address),
made by prepare() while the all_reduce pass compiles the graph, or else at the first call
outside any CUDA-graph capture. Not at the first call of a graph under reduce-overhead: Inductor's
CUDA-graph trees run that call with the device's allocations routed to their own pool, and they
refuse a graph that leaves tensors of its own in that pool (2 x H200, torch 2.11: "Detected 2
tensor(s) in the cudagraph pool not tracked as outputs"). Its rendezvous is a collective: every
rank of a group compiles and calls in the same order, as the ranks of one program do. A call the
kernels do not serve (another dtype, an unaligned size, a CPU tensor, no symmetric memory)
returns None, and the caller takes the group's own collective; every rank decides alike from
what they share (sizes, dtype, whether the buffer exists, whether a capture is running).
A group destroyed and made again takes the same name ("0" for the default group): the buffers
are keyed by name, but each remembers the group object it was made for, and a group of the
same name that is another object gets a buffer (and a world size) of its own.

Beside it, made and kept alike: a push buffer per (group, device, dtype) for our push kernel
(triton_push.py: the all-reduce, alone or with the residual add and RMSNorm after it), where each
rank writes its row into every peer's buffer. It holds a sentinel wherever no value waits to be
read, so it is filled, and the fill waited for, before its rendezvous lets any peer write into it.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

log = logging.getLogger(__name__)

# The one-shot kernel while what each rank reads (world x bytes) stays within this; two-shot above.
ONE_SHOT_READ_BYTES = 2 * 2**20
BUFFER_BYTES = 4 * 2**20
# PyTorch's kernels dispatch on these; their vector loads need 16-byte multiples.
DTYPES = (torch.bfloat16, torch.float32)
ALIGN = 16

# The push kernel's buffers (triton_push.py), one a dtype: three thirds, each as large as what the
# one-shot kernel reads.
THIRDS = 3
PUSH_BYTES = THIRDS * ONE_SHOT_READ_BYTES
# Where no call has pushed, a push buffer holds -0.0: by the dtype's width, its bits.
SENTINEL_BITS = {16: -(2**15), 32: -(2**31)}
_INT_OF_WIDTH = {16: torch.int16, 32: torch.int32}

# (group name, device index, kind) -> (the group it was made for, the buffer or why it could not be
# made); kind None: the buffer of PyTorch's kernels; a dtype: a push buffer of that dtype
_buffers: dict[tuple[str, int, torch.dtype | None], tuple[weakref.ref, Tensor | str]] = {}
# a push buffer's every rank, by the buffer's address
_push: dict[int, PushBuffers] = {}


@dataclass
class PushBuffers:
    """A group's push buffers of one dtype (triton_push.py): every rank's, in rank order, as a
    flat tensor of the dtype this device can write; this rank's epoch (an int32 pair on this
    device: calls made, programs of the call done); this rank; the world."""

    views: tuple[Tensor, ...]
    epoch: Tensor
    rank: int
    world: int


def sentinel_fill(buffer: Tensor) -> Tensor:
    """buffer filled with the sentinel of its dtype (-0.0's bits), in place."""
    bits = buffer.element_size() * 8
    return buffer.view(_INT_OF_WIDTH[bits]).fill_(SENTINEL_BITS[bits]).view(buffer.dtype)


def available() -> str | None:
    """None where this torch has symmetric memory's all-reduce kernels, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401

        torch.ops.symm_mem.one_shot_all_reduce_out  # noqa: B018
        torch.ops.symm_mem.two_shot_all_reduce_out  # noqa: B018
    except (ImportError, AttributeError, RuntimeError) as error:
        return f"this torch has no symmetric-memory all-reduce ({type(error).__name__}: {error})"
    return None


def serves(x: Tensor) -> str | None:
    """None where the symmetric kernels can take x (on its own, before any buffer), else why not."""
    nbytes = x.numel() * x.element_size()
    if x.device.type != "cuda":
        return f"a {x.device.type} tensor"
    if x.dtype not in DTYPES:
        return f"{x.dtype} (the kernels take {', '.join(map(str, DTYPES))})"
    if nbytes % ALIGN or nbytes == 0:
        return f"{nbytes} bytes, not a multiple of {ALIGN}"
    if nbytes > BUFFER_BYTES:
        return f"{nbytes} bytes, past the {BUFFER_BYTES}-byte buffer"
    return available()


def all_reduce_sum(x: Tensor, group_name: str, kernel: str | None = None) -> Tensor | None:
    """The sum of x over the group's ranks on the one-shot (up to ONE_SHOT_READ_BYTES read a
    rank) or two-shot kernel (or the one `kernel` names: "one_shot", "two_shot"), a new tensor;
    None where they do not serve this call."""
    if serves(x) is not None:
        return None
    buffer = _buffer(group_name, x.device)
    if buffer is None:
        return None
    flat = x.contiguous().view(-1)
    staged = buffer.view(x.dtype)[: flat.numel()]
    out = torch.empty_like(flat)
    if kernel is None:
        read = _world(group_name) * flat.numel() * flat.element_size()
        kernel = "one_shot" if read <= ONE_SHOT_READ_BYTES else "two_shot"
    if kernel == "one_shot":
        copy_out = getattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out", None)
        if copy_out is not None:  # the copy into the buffer inside the kernel
            copy_out(staged, flat, "sum", group_name, out)
        else:
            staged.copy_(flat)
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", group_name, out)
    else:
        staged.copy_(flat)
        torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", group_name, out)
    return out.view(x.shape)


def prepare(group_name: str, device: torch.device) -> str | None:
    """Make the group's buffer on this device now (a collective over the group's ranks); None
    once it exists, else why there is none (its calls then take the group's own collective)."""
    if (reason := available()) is not None:
        return reason
    if _buffer(group_name, device) is None:
        found = _found(group_name, _index(device))
        return (
            f"no symmetric memory: {found}" if isinstance(found, str) else "asked during a CUDA-graph capture"
        )
    return None


def _group(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def _world(group_name: str) -> int:
    return _group(group_name).size()


def _index(device: torch.device) -> int:
    # ops/launch.device_index's, spelled out: importing ops/launch imports Triton, and this
    # module is imported with fp8compile (tests/test_backend.py keeps that import free of it)
    return device.index if device.index is not None else torch.cuda.current_device()


def _found(group_name: str, index: int, kind: torch.dtype | None = None) -> Tensor | str | None:
    """The group's buffer of that kind on device `index`, or why there is none; None where
    nothing was tried for the group of that name that lives now (a buffer of a destroyed group
    is dropped)."""
    key = (group_name, index, kind)
    entry = _buffers.get(key)
    if entry is None:
        return None
    made_for, found = entry
    try:
        live = _group(group_name)
    except RuntimeError:  # no group of that name now
        live = None
    if live is None or made_for() is not live:
        del _buffers[key]  # the name's group was destroyed, or made again: its peers are others
        return None
    return found


def _buffer(group_name: str, device: torch.device, kind: torch.dtype | None = None) -> Tensor | None:
    index = _index(device)
    found = _found(group_name, index, kind)
    if isinstance(found, Tensor):
        return found
    if found is not None or torch.cuda.is_current_stream_capturing():
        return None  # it could not be made; or a capture is running, where nothing may be allocated
    try:
        found = _make(group_name, index) if kind is None else _make_push(group_name, index, kind)
    except Exception as error:  # noqa: BLE001 - any failure leaves the group's own collective
        found = f"{type(error).__name__}: {error}"
        log.warning(
            "fp8compile: no symmetric memory for group %s (%s); its all-reduces take its own collective",
            group_name,
            found,
        )
    _buffers[(group_name, index, kind)] = (weakref.ref(_group(group_name)), found)
    return found if isinstance(found, Tensor) else None


def _make(group_name: str, index: int) -> Tensor:
    """A BUFFER_BYTES buffer on device `index` that the group's ranks can all read (a collective)."""
    from torch.distributed import _symmetric_memory as symm_mem

    if _needs_enable():
        symm_mem.enable_symm_mem_for_group(group_name)
    device = torch.device("cuda", index)
    buffer = symm_mem.empty(BUFFER_BYTES, dtype=torch.uint8, device=device)
    symm_mem.rendezvous(buffer, group_name)
    return buffer


def _make_push(group_name: str, index: int, dtype: torch.dtype) -> Tensor:
    """A PUSH_BYTES buffer of dtype on device `index` that every rank of the group can write,
    holding the sentinel everywhere before any peer can push into it (a collective)."""
    from torch.distributed import _symmetric_memory as symm_mem

    if dtype.itemsize * 8 not in SENTINEL_BITS:
        raise ValueError(f"no sentinel for {dtype}")
    if _needs_enable():
        symm_mem.enable_symm_mem_for_group(group_name)
    device = torch.device("cuda", index)
    numel = PUSH_BYTES // dtype.itemsize
    buffer = sentinel_fill(symm_mem.empty(numel, dtype=dtype, device=device))
    # filled on the device before this rank meets the others: a peer may push once they have met
    torch.cuda.synchronize(device)
    handle = symm_mem.rendezvous(buffer, group_name)
    views = tuple(handle.get_buffer(r, (numel,), dtype) for r in range(handle.world_size))
    epoch = torch.zeros(2, dtype=torch.int32, device=device)
    _push[buffer.data_ptr()] = PushBuffers(views, epoch, handle.rank, handle.world_size)
    return buffer


def push_buffers(group_name: str, device: torch.device, dtype: torch.dtype) -> PushBuffers | None:
    """The group's push buffers of dtype, made now if need be (a collective: every rank asks
    alike); None where there are none (the reason is logged)."""
    buffer = _buffer(group_name, device, dtype) if device.type == "cuda" else None
    return None if buffer is None else _push.get(buffer.data_ptr())


def path() -> str:
    """What the op runs where symmetric memory serves, in words (the report's)."""
    return (
        f"fp8compile's push kernel up to {ONE_SHOT_READ_BYTES // 2**20} MiB taken in a rank (world x "
        "bytes) and a row a multiprocessor, else symmetric memory's one-shot kernel up to "
        f"{ONE_SHOT_READ_BYTES // 2**20} MiB read a rank, its two-shot kernel up to the "
        f"{BUFFER_BYTES // 2**20} MiB buffer, NCCL above"
    )


def state(group_name: str, device_index: int) -> str:
    """What this process's calls on the group take: the symmetric buffer, or why not."""
    found = _found(group_name, device_index)
    if found is None:
        return "no call yet"
    if isinstance(found, str):
        return f"the group's own collective (no symmetric memory: {found})"
    return f"symmetric memory, a {found.numel() // 2**20} MiB buffer"


def _needs_enable() -> bool:
    """Whether this torch wants enable_symm_mem_for_group before a rendezvous (before 2.9;
    deprecated and a no-op since)."""
    version = tuple(int(p) for p in torch.__version__.split(".")[:2] if p.isdigit())
    return version < (2, 9)
