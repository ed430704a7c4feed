"""`bench model --tp N`: the whole-model bench on N ranks of one host, the model sharded before
each variant compiles it: into plain local shards with functional collectives
(fp8compile/tensor_parallel.py, `--tp-shards local`, the default), or with PyTorch's DTensor
tensor parallelism (parallelize_module, `--tp-shards dtensor`).

Every rank builds the same random model, shards it Megatron's way (q, k, v, gate, up
column-sharded; o and down row-sharded, an all-reduce after each; lm_head column-sharded with
its logits gathered), and runs the same variants in the same order; collectives keep the ranks
in step, and rank 0 prints and writes. NCCL on GPUs (rank r on cuda:r), gloo on the CPU (the
plumbing test). Decode runs through the user's own compile of model.forward with a static cache
made here with this rank's KV heads (the *_own variants): the cache generate() makes for a
CompileConfig holds every head. Every variant compiles with dynamic=False: under automatic
dynamic shapes, Dynamo fails on a sharded model's lm_head after the prefill's logits_to_keep
slice (torch 2.13: "unhashable type: non-nested SymInt" in DTensor's sharding propagation), bf16
Inductor as much as fp8; a graph per shape is what decode needs anyway (one per batch size).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from .. import tensor_parallel
from .variants import VARIANTS

# Under --tp these variants decode through a cache made with this rank's KV heads, in both modes:
# for DTensor shards, generate()'s own cache through a CompileConfig held every head (local shards
# fill transformers 5.24's lazily sized StaticCache, tests/test_tensor_parallel.py; the GPU kit's
# 5.17 is not checked). The *_lean ones, LeanDecoder's loop (local shards only), make theirs ahead.
TP_VARIANTS = ("bf16", *(name for name in VARIANTS if name.endswith(("_own", "_lean"))))


def shard(model, world: int, device: torch.device, shards: str = "local") -> None:
    """Shard a transformers decoder (Llama, Qwen2, Mistral layouts) over `world` ranks in place,
    as plain local shards with functional collectives (shards "local") or as DTensors
    ("dtensor"); a clear error for a model whose layers are not q/k/v/o attention and a
    gate/up/down MLP."""
    if shards == "local":
        local_shard(model)
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    try:
        layers = tensor_parallel.check(model, world)
    except ValueError as error:
        raise SystemExit(f"--tp {world}: {error}") from None
    plan = {"lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(len(layers)):  # tensor_parallel's layout, as DTensors
        plan.update({f"model.layers.{i}.{name}": ColwiseParallel() for name in tensor_parallel.COLUMNS})
        plan.update({f"model.layers.{i}.{name}": RowwiseParallel() for name in tensor_parallel.ROWS})
    parallelize_module(model, init_device_mesh(device.type, (world,)), plan)


def local_shard(model) -> None:
    """tensor_parallel.shard over the default group, its refusal a clear exit."""
    try:
        tensor_parallel.shard(model)
    except ValueError as error:
        raise SystemExit(f"--tp {world()}: {error}") from None


def sharded_kv_heads(model) -> int | None:
    """This rank's KV heads where shard() sharded the model (into local shards, or DTensors: its
    k_proj weight is one); None for a whole model."""
    if tensor_parallel.local_kv_heads(model) is not None:
        return tensor_parallel.local_kv_heads(model)
    layers = getattr(getattr(model, "model", None), "layers", None)
    k_proj = getattr(getattr(layers[0], "self_attn", None), "k_proj", None) if layers else None
    weight = getattr(k_proj, "weight", None)
    if not hasattr(weight, "to_local"):
        return None
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return weight.to_local().shape[0] // head_dim


def world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main() -> bool:
    """Rank 0, or the only process: the one that prints and writes."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def spawn(
    bench, world_size: int, out_dir: Path, device: str | None, result: str = "bench_model.json", **kwargs
) -> list[dict]:
    """bench(out_dir, device=this rank's, tp=world_size, **kwargs) on world_size processes of one
    host (bench: model.bench_model, allreduce.bench_allreduce); rank 0's rows, from what it wrote
    to out_dir / result."""
    import torch.multiprocessing as mp

    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and torch.cuda.device_count() < world_size:
        raise SystemExit(f"--tp {world_size}: this host has {torch.cuda.device_count()} GPU(s)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(bench, world_size, port, kind, out_dir, kwargs), nprocs=world_size)
    import json

    return json.loads((out_dir / result).read_text())


def _rank(rank: int, bench, world_size: int, port: int, kind: str, out_dir: Path, kwargs: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if kind == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if kind == "cuda" else "gloo", rank=rank, world_size=world_size)
    try:
        bench(out_dir, device=f"cuda:{rank}" if kind == "cuda" else "cpu", tp=world_size, **kwargs)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    if kind == "cuda":
        # Every row is written and every rank is here. On two H100s (torch 2.11) a rank whose CUDA
        # graphs held NCCL calls did not come back from tearing NCCL and the process down, and
        # mp.spawn waited on it for good: the process ends here, without that teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    dist.destroy_process_group()
