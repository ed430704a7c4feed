"""fp8compile's collectives (torch.library, ops/library.py), each with its fake below it:

- all_reduce: the sum of x over a process group's ranks: our push kernel on symmetric memory
  (triton_push.py) where it serves the call, else symmetric memory's one-shot and two-shot
  kernels (symmetric.py), else the group's own collective (reference.py); the all_reduce pass
  puts it where a sharded model's graph held a functional sum all-reduce.
- all_reduce_rms_norm: that sum added to the residual stream and normalized, in the push kernel
  where it serves the call, else all_reduce and the same arithmetic (reference.py); the
  all_reduce_norm pass puts it where a graph's all-reduce fed the residual add and an RMSNorm.

Every rank decides alike which kernel serves a call, from what they share (sizes, dtype, the
buffers made, whether a capture is running): the ranks of one program make the same calls.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..library import fake, op
from . import reference, symmetric

# The push kernel holds a row in registers (8 warps: 64 fp32 values a thread for each of the sum
# and the weight at this width), and takes the dtypes an RMSNorm's input comes in.
PUSH_MAX_WIDTH = 16384
PUSH_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PUSH_MAX_WORLD = 8  # triton_push.MAX_WORLD (that module imports Triton)


@op
def all_reduce(x: Tensor, group_name: str) -> Tensor:
    """x summed over the ranks of the group named group_name; a new tensor of x's shape."""
    width = x.shape[-1] if x.dim() else 1
    rows = x.numel() // width if width else 0
    if push_refuses(rows, width, x.dtype, x.device, group_name) is None:
        from . import triton_push  # Triton, imported where a GPU runs the kernel

        push = symmetric.push_buffers(group_name, x.device, x.dtype)
        out = triton_push.all_reduce_sum(
            x.reshape(rows, width).contiguous(), push.views, push.epoch, push.rank
        )
        return out.view(x.shape)
    out = symmetric.all_reduce_sum(x, group_name)
    return out if out is not None else reference.all_reduce_sum(x, group_name).contiguous()


@fake(all_reduce)
def _(x: Tensor, group_name: str) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@op
def all_reduce_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, group_name: str
) -> tuple[Tensor, Tensor]:
    """(weight * rms_norm(s), s) for s = residual + x summed over the group's ranks: transformers'
    residual add and RMSNorm after a row-sharded linear, each rounded as there. x and residual
    of one shape and dtype, weight the last dimension's; two new tensors of residual's shape."""
    h = x.shape[-1]
    rows = x.numel() // h if h else 0
    if (
        residual.shape == x.shape
        and residual.dtype == x.dtype == weight.dtype
        and weight.shape == (h,)
        and push_refuses(rows, h, x.dtype, x.device, group_name) is None
    ):
        from . import triton_push  # Triton, imported where a GPU runs the kernel

        push = symmetric.push_buffers(group_name, x.device, x.dtype)
        normed, summed = triton_push.all_reduce_rms_norm(
            x.reshape(rows, h).contiguous(),
            residual.reshape(rows, h).contiguous(),
            weight.contiguous(),
            eps,
            push.views,
            push.epoch,
            push.rank,
        )
        return normed.view(x.shape), summed.view(x.shape)
    return reference.add_rms_norm(all_reduce(x, group_name), residual, weight, eps)


@fake(all_reduce_rms_norm)
def _(x: Tensor, residual: Tensor, weight: Tensor, eps: float, group_name: str) -> tuple[Tensor, Tensor]:
    out = torch.empty_like(residual, memory_format=torch.contiguous_format)
    return out, torch.empty_like(out)


def push_refuses(
    rows: int, width: int, dtype: torch.dtype, device: torch.device, group_name: str
) -> str | None:
    """None where the push kernel (triton_push.py) serves (rows, width) of dtype on this device
    for the group (its push buffers made now if need be: a collective, as all ranks compile and
    call alike), else why not. Every rank decides alike: from sizes, dtype and the buffers."""
    nbytes = rows * width * dtype.itemsize
    if device.type != "cuda":
        return f"symmetric memory serves CUDA tensors; these are {device.type}"
    if dtype not in PUSH_DTYPES:
        return f"{dtype} (the kernel takes {', '.join(map(str, PUSH_DTYPES))})"
    if width > PUSH_MAX_WIDTH:
        return f"rows of {width}, past the {PUSH_MAX_WIDTH} the kernel holds in registers"
    if rows == 0 or nbytes % symmetric.ALIGN or nbytes > symmetric.BUFFER_BYTES:
        return f"{nbytes} bytes a rank: not a whole number of {symmetric.ALIGN}-byte units in the buffer"
    if rows > (sms := _multiprocessors(device)):
        # a row's program waits for the peers' programs of that row: all must be resident at once
        return (
            f"{rows} rows, more than the GPU's {sms} multiprocessors "
            "(a program a row, each waiting on its peers')"
        )
    push = symmetric.push_buffers(group_name, device, dtype)
    if push is None:
        return "no push buffer for the group here (the all-reduces' path and the log say why)"
    if push.world > PUSH_MAX_WORLD:
        return f"{push.world} ranks; the kernel writes at most {PUSH_MAX_WORLD} buffers"
    if push.world * nbytes > symmetric.ONE_SHOT_READ_BYTES:
        return (
            f"{push.world * nbytes} bytes a rank takes in, past the {symmetric.ONE_SHOT_READ_BYTES} "
            "of a third of its push buffer (symmetric memory's two-shot kernel or NCCL serve it)"
        )
    return None


def _multiprocessors(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count
