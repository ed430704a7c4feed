"""Tensor parallelism a compiled graph holds as plain tensors: each rank's shards as ordinary
parameters, the collectives as functional collectives inside the graph.

A model sharded with DTensor (parallelize_module, transformers' tp_plan) hands Dynamo a DTensor
for every sharded parameter: AOTAutograd unwraps each one, and Dynamo guards each one, on every
call, and at batch 1 that host work is the step (BENCHMARKS.md, "Tensor parallel"). Here a
transformers decoder (q/k/v/o attention and a gate/up/down MLP, the Llama, Qwen2 and Mistral
layouts) is sharded Megatron's way into plain tensors: q, k, v, gate and up keep this rank's
rows (its heads, its slice of the intermediate size), o and down this rank's columns, with an
all-reduce of their output (the functional collectives' all_reduce, a forward hook), and the
lm_head this rank's rows of the vocabulary, its logits gathered (all_gather_into_tensor). Dynamo
traces the hooks: the graph holds each collective and its wait, which Inductor launches and
CUDA graphs capture, NCCL included; nothing per parameter is unwrapped or guarded at a call.
The attention reshapes by head_dim with -1 heads, so a layer's own code runs this rank's heads.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .ops.collectives.reference import all_reduce_sum

# the Megatron layout: column-sharded (this rank's output rows) and row-sharded (its input columns)
COLUMNS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWS = ("self_attn.o_proj", "mlp.down_proj")


def shard(model: nn.Module, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Shard a whole transformers decoder in place over `group`'s ranks (the default group if
    None) as plain tensors with functional collectives; the model. A clear error for a layer of
    another layout, or heads that do not split evenly over the ranks."""
    group = group or dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    layers = check(model, world)
    kv_heads = _kv_heads(model.config.get_text_config(decoder=True))
    for layer in layers:
        for name in COLUMNS:
            _keep(layer.get_submodule(name), 0, rank, world)
        for name in ROWS:
            linear = layer.get_submodule(name)
            _keep(linear, 1, rank, world)
            linear.register_forward_hook(_AllReduce(group))
    head = model.get_output_embeddings()
    if isinstance(head, nn.Linear) and head.out_features % world == 0:
        _keep(head, 0, rank, world)
        head.register_forward_hook(_AllGather(group))
    model._local_kv_heads = kv_heads // world
    return model


def all_reduces(model: nn.Module) -> list[tuple[str, int]]:
    """The all-reduces a forward of a model shard() sharded runs: (group name, width) for each
    row-sharded linear, whose output of `width` features is summed over the group's ranks; empty
    for a model not so sharded."""
    return [
        (hook.group_name, module.out_features)
        for module in model.modules()
        for hook in module._forward_hooks.values()
        if isinstance(hook, _AllReduce)
    ]


def check(model: nn.Module, world: int) -> nn.ModuleList:
    """The decoder layers of a model this layout shards over `world` ranks (every layer checked
    before any is sharded); a ValueError saying why not: a config without the heads or the
    intermediate size the layout splits, sizes that do not split evenly, a layer without the
    seven projections, or a model whose own code does not run on the split shapes (_probe)."""
    config = model.config.get_text_config(decoder=True)
    model_name = type(model).__name__
    sizes = ("num_attention_heads", "intermediate_size")
    if missing := [key for key in sizes if getattr(config, key, None) is None]:
        raise ValueError(
            f"{model_name}'s config has no {' or '.join(missing)}: this shards decoders of q/k/v/o "
            "attention heads and a gate/up/down MLP"
        )
    kv_heads = _kv_heads(config)
    if config.num_attention_heads % world or kv_heads % world or config.intermediate_size % world:
        raise ValueError(
            f"{config.num_attention_heads} attention heads, {kv_heads} KV heads and intermediate size "
            f"{config.intermediate_size} do not all split evenly over {world} ranks"
        )
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{model_name} has no model.layers: this shards a transformers decoder")
    for i, layer in enumerate(layers):
        missing = [name for name in COLUMNS + ROWS if not _has(layer, name)]
        if missing:
            raise ValueError(
                f"layer {i} of {model_name} has no {', '.join(missing)}: this shards q/k/v/o "
                "attention with a gate/up/down MLP (MoE layers are not sharded here)"
            )
    if (error := _probe(model, world)) is not None:
        raise ValueError(
            f"{model_name} sharded over {world} ranks does not run: {error}. Its attention or MLP holds "
            "more than the seven projections split by heads and by the intermediate size (a norm "
            "over the whole projection, per-head parameters, heads counted from its config)"
        )
    return layers


def _probe(model: nn.Module, world: int) -> str | None:
    """Why the model's own forward fails on rank 0's shapes of this layout, or None: the model
    made again from its config on the meta device (no memory, no data), run on four tokens whole
    and then with its projections cut as shard() cuts them. None too where the meta model cannot
    be made or its whole forward fails there (data-dependent code): the probe says nothing then.
    Of transformers 5.24's causal LMs that pass the checks before it, OLMo-2 and -3 (q and k
    normalized over the whole projection), BitNet (norms inside attention and MLP), StableLM and
    Mllama (heads counted from the config), DiffLlama, Doge and Granite-SWA ran whole and failed
    sharded, here as on two ranks; 26 others ran sharded within bf16 rounding of the whole
    model (2026-11-29, 098ac8f, two gloo ranks on the CPU)."""
    ids = torch.zeros(1, 4, dtype=torch.long, device="meta")
    try:
        with torch.device("meta"):
            meta = type(model)(model.config)
        with torch.no_grad():
            meta(input_ids=ids)
    except Exception:  # noqa: BLE001 - the probe cannot tell: it says nothing
        return None
    for layer in meta.model.layers:
        for name in COLUMNS:
            _keep(layer.get_submodule(name), 0, 0, world)
        for name in ROWS:
            _keep(layer.get_submodule(name), 1, 0, world)
    try:
        with torch.no_grad():
            meta(input_ids=ids)
    except Exception as error:  # noqa: BLE001 - any failure of the model's code on these shapes
        return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return None


def _kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def local_kv_heads(model: nn.Module) -> int | None:
    """This rank's KV heads where shard() sharded the model, else None."""
    return getattr(model, "_local_kv_heads", None)


def _has(layer: nn.Module, name: str) -> bool:
    try:
        return isinstance(layer.get_submodule(name), nn.Linear)
    except AttributeError:
        return False


def _keep(linear: nn.Linear, dim: int, rank: int, world: int) -> None:
    """Keep this rank's part of the weight along dim (0: output rows, 1: input columns); a
    row-sharded bias is added once, on rank 0, before the all-reduce sums the ranks."""
    weight = linear.weight.detach().chunk(world, dim)[rank].clone()
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if dim == 0:
        linear.out_features = weight.shape[0]
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias.detach().chunk(world)[rank].clone(), requires_grad=False)
    else:
        linear.in_features = weight.shape[1]
        if linear.bias is not None and rank != 0:
            linear.bias = nn.Parameter(torch.zeros_like(linear.bias), requires_grad=False)


# The hooks call the functional collectives' ops themselves, each with its wait, not
# torch.distributed._functional_collectives' Python wrappers: on the GPU kit (torch 2.11,
# transformers 5.17) Dynamo left the lm_head's all_gather_tensor, and the lm_head with it, out of
# the compiled graph, run eagerly at every step (2 x H200, a 2026-11-28 profile: 33 eager
# lm_head calls in 33 steps); the ops are traced alike by every Dynamo.
_c10d = torch.ops._c10d_functional


class _AllReduce:
    """A forward hook: the output summed over the group's ranks (a row-sharded linear's partials)."""

    def __init__(self, group):
        self.group_name = group.group_name

    def __call__(self, module, args, output):
        return all_reduce_sum(output, self.group_name)


class _AllGather:
    """A forward hook: the ranks' outputs side by side along the last dimension (a
    column-sharded lm_head's logits)."""

    def __init__(self, group):
        self.group_name, self.world = group.group_name, dist.get_world_size(group)

    def __call__(self, module, args, output):
        gathered = _c10d.all_gather_into_tensor(output.contiguous(), self.world, self.group_name)
        stacked = _c10d.wait_tensor(gathered)  # the ranks' outputs one after another along dim 0
        return torch.cat(stacked.chunk(self.world), dim=-1)  # rank r's rows -> its columns
