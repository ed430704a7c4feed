"""all_reduce pass: a sharded model's functional sum all-reduce and its wait ->
fp8compile::all_reduce, which takes our push kernel at the sizes a decode step moves
(ops/collectives/triton_push.py), symmetric memory's one-shot and two-shot kernels past them, and
the group's own collective (NCCL) past its buffer (ops/collectives/).

The rewrite also makes the op's symmetric buffers for the group and device (on every rank: they
compile the same graph together), before the graph's first call: under reduce-overhead that
call runs inside CUDA-graph trees' memory pool, which must not keep them (ops/collectives/
symmetric.py). Where symmetric memory is not there (CPU tensors, no NVLink peers, an older
torch), the op runs the group's own collective; the report says which, and why.

Only in graphs that run under CUDA graphs (mode="reduce-overhead"), where the kernels' time is
the step's (`bench allreduce`: 6.8 us against NCCL's 11.3 for a batch of one at hidden 4096 on
two H200s): without them every call also pays its host cost, and the op's Python has not been
measured against the NCCL collective's launch there, so those graphs keep theirs.

A model sharded into local shards (fp8compile.tensor_parallel, or any code that calls
torch.distributed's functional collectives) reaches the ATen graph as
    r = _c10d_functional.all_reduce(x, "sum", group)    w = _c10d_functional.wait_tensor(r)
after each row-sharded linear. At a batch of one that is 8 KB a rank at hidden 4096, where NCCL's
ring costs its handshakes, not its bytes. The rewrite keeps the group and the sum; the op decides
per call, every rank alike, which kernel serves it. Other reductions, an all_reduce read by more
than its wait, and the in-place form stay as they are.

So do the all-reduces of a graph whose sizes it fixes past the symmetric buffer (a prefill of 2048
tokens at hidden 4096: 16 MB a rank): NCCL runs them either way, and as written Inductor reduces
them in place (its reinplace pass), where the op, which must return a new tensor, copies its input
first. On 2 x H200 those copies took 0.49 ms of a 26.2 ms TP2 prefill of 2048 tokens
(BENCHMARKS.md, "Tensor parallel at 32 layers: the all-reduce pushed").
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..ops.collectives import op as collectives, symmetric
from .context import PassContext

log = logging.getLogger(__name__)

c10d = torch.ops._c10d_functional


# the report's words for a graph whose all-reduces stay as written
NO_CUDA_GRAPHS = (
    "the functional collectives as written: the graph runs without CUDA graphs, where each call pays "
    "its host cost, and fp8compile's op's has not been measured against NCCL's"
)


def all_reduce_pass(ctx: PassContext) -> None:
    graph, prepared = ctx.gm.graph, set()
    found = [n for n in graph.nodes if n.op == "call_function" and n.target is c10d.all_reduce.default]
    if found and not ctx.cuda_graphs:
        ctx.report.all_reduce_paths[f"graph {ctx.graph_index}"] = NO_CUDA_GRAPHS
        return
    past = set()
    for node in found:
        x, reduce_op, group_name = node.args[:3]
        waits = list(node.users)
        if reduce_op != "sum" or len(waits) != 1 or waits[0].target is not c10d.wait_tensor.default:
            continue
        nbytes = _static_bytes(x.meta["val"])
        if nbytes is not None and nbytes > symmetric.BUFFER_BYTES:
            past.add(nbytes)  # NCCL's either way: as written, Inductor reduces in place, no copy
            continue
        wait = waits[0]
        with graph.inserting_before(node):
            fused: fx.Node = graph.call_function(torch.ops.fp8compile.all_reduce.default, (x, group_name))
        # where it came from, for the graph dumps; not the wait's recorded inputs (eager_input_vals)
        fused.meta.update({k: wait.meta[k] for k in ("stack_trace", "nn_module_stack") if k in wait.meta})
        fused.meta["val"] = ctx.fake(torch.ops.fp8compile.all_reduce.default, x, group_name)
        wait.replace_all_uses_with(fused)
        graph.erase_node(wait)
        graph.erase_node(node)
        device, dtype = x.meta["val"].device, x.meta["val"].dtype
        if (group_name, device) not in prepared:
            prepared.add((group_name, device))
            ctx.report.all_reduce_paths[f"{group_name} on {device}"] = _prepare(group_name, device)
        if (group_name, device, dtype) not in prepared:
            prepared.add((group_name, device, dtype))
            _prepare_push(group_name, device, dtype)
    if past:
        sizes = ", ".join(str(b) for b in sorted(past))
        ctx.report.all_reduce_paths[f"graph {ctx.graph_index}, past the symmetric buffer"] = (
            f"the functional collectives of {sizes} bytes a rank as written: past the "
            f"{symmetric.BUFFER_BYTES}-byte buffer, NCCL runs them either way, and Inductor reduces them "
            "in place where fp8compile's op would copy its input first"
        )


def _static_bytes(val: torch.Tensor) -> int | None:
    """The bytes of a tensor whose sizes the graph fixes; None where any is symbolic."""
    if not all(isinstance(s, int) for s in val.shape):
        return None
    return val.numel() * val.element_size()


def _prepare(group_name: str, device: torch.device) -> str:
    """The symmetric buffer made for the group on this device where it can be; what the op will
    run there, in words."""
    if device.type != "cuda":
        return f"the group's own collective (symmetric memory serves CUDA tensors; these are {device.type})"
    with unset_fake_temporarily():
        reason = symmetric.prepare(group_name, device)
    if reason is not None:
        log.warning("fp8compile: group %s's all-reduces take its own collective: %s", group_name, reason)
        return f"the group's own collective ({reason})"
    return symmetric.path()


def _prepare_push(group_name: str, device: torch.device, dtype: torch.dtype) -> None:
    """The group's push buffers of dtype made on this device where the push kernel takes them
    (a collective, as every rank compiles alike); where they cannot be, the op takes symmetric
    memory's kernels, and the log says why."""
    if device.type == "cuda" and dtype in collectives.PUSH_DTYPES and symmetric.available() is None:
        with unset_fake_temporarily():
            symmetric.push_buffers(group_name, device, dtype)
