"""The models `bench model` builds: transformers configs at real widths (layer counts of the
released models, cut with --layers), random N(0, 0.02) weights, bf16, made on the device."""

from __future__ import annotations

import torch


# name -> (transformers model class, config class, config fields). Real widths; layer counts of
# the released models (cut with --layers).
MODELS = {
    "llama-3-8b": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            num_hidden_layers=32,
            rope_theta=500000.0,
            max_position_embeddings=8192,
        ),
    ),
    # too large for one GPU in bf16 (141 GB): `bench model --tp` builds each rank's shard alone
    "llama-3-70b": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            hidden_size=8192,
            intermediate_size=28672,
            num_attention_heads=64,
            num_key_value_heads=8,
            vocab_size=128256,
            num_hidden_layers=80,
            rope_theta=500000.0,
            max_position_embeddings=8192,
        ),
    ),
    "qwen2.5-7b": (
        "Qwen2ForCausalLM",
        "Qwen2Config",
        dict(
            hidden_size=3584,
            intermediate_size=18944,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
            num_hidden_layers=28,
            rope_theta=1000000.0,
            max_position_embeddings=32768,
        ),
    ),
    "qwen3-30b-a3b": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            vocab_size=151936,
            num_hidden_layers=48,
            max_position_embeddings=32768,
        ),
    ),
    # Families whose attention or layout differs (issue: every model a user brings). Released
    # layer counts; --layers cuts them (Mixtral-8x7B's 32 layers are 94 GB in bf16: cut to fit).
    "mistral-7b-v0.1": (  # every layer a 4096-token sliding window
        "MistralForCausalLM",
        "MistralConfig",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32000,
            num_hidden_layers=32,
            sliding_window=4096,
            rope_theta=10000.0,
            max_position_embeddings=32768,
        ),
    ),
    "gemma-2-9b": (  # sliding and global layers alternating, logit softcapping, gelu-tanh MLP
        "Gemma2ForCausalLM",
        "Gemma2Config",
        dict(
            hidden_size=3584,
            intermediate_size=14336,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            vocab_size=256000,
            num_hidden_layers=42,
            sliding_window=4096,
            query_pre_attn_scalar=256,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            max_position_embeddings=8192,
        ),
    ),
    "gemma-3-12b": (  # five 1024-token sliding layers to one global, q/k norms
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        dict(
            hidden_size=3840,
            intermediate_size=15360,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            vocab_size=262208,
            num_hidden_layers=48,
            sliding_window=1024,
            query_pre_attn_scalar=256,
            max_position_embeddings=131072,
        ),
    ),
    "phi-3-medium": (  # fused qkv_proj and gate_up_proj weights
        "Phi3ForCausalLM",
        "Phi3Config",
        dict(
            hidden_size=5120,
            intermediate_size=17920,
            num_attention_heads=40,
            num_key_value_heads=10,
            vocab_size=32064,
            num_hidden_layers=40,
            max_position_embeddings=4096,
        ),
    ),
    "mixtral-8x7b": (  # 8 experts, top-2, fp32 routing weights
        "MixtralForCausalLM",
        "MixtralConfig",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_local_experts=8,
            num_experts_per_tok=2,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32000,
            num_hidden_layers=32,
            rope_theta=1000000.0,
            max_position_embeddings=32768,
        ),
    ),
    "qwen3-8b": (  # dense Qwen3: q/k norms
        "Qwen3ForCausalLM",
        "Qwen3Config",
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            num_hidden_layers=36,
            rope_theta=1000000.0,
            max_position_embeddings=40960,
        ),
    ),
    # the CPU plumbing tests' models
    "tiny-mixtral": (
        "MixtralForCausalLM",
        "MixtralConfig",
        dict(
            hidden_size=256,
            intermediate_size=256,
            num_local_experts=4,
            num_experts_per_tok=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1024,
            num_hidden_layers=2,
            max_position_embeddings=512,
        ),
    ),
    "tiny-llama": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            hidden_size=256,
            intermediate_size=512,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1024,
            num_hidden_layers=2,
            max_position_embeddings=512,
        ),
    ),
}


def build(name: str, layers: int | None, device: str, dtype: torch.dtype = torch.bfloat16, shard=None):
    """The model `name` with random weights, in `dtype` (bf16 by default), in eval mode, made on
    `device`. With shard (a function that shards a model in place: tensor_parallel.shard), the
    model is made on the meta device and sharded there, and only this rank's shards are then
    made on `device`, with transformers' own initialization (the rotary tables included), so
    that a model too large for one GPU never has to fit on one."""
    import transformers

    model_cls, config_cls, fields = MODELS[name]
    config = getattr(transformers, config_cls)(
        **{**fields, **({"num_hidden_layers": layers} if layers else {})}
    )
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta" if shard else device):
            model = getattr(transformers, model_cls)(config)
    finally:
        torch.set_default_dtype(default)
    if shard:
        shard(model)
        model.to_empty(device=device)
        torch.manual_seed(0)  # the same draws on every rank: its replicated weights agree
        with torch.no_grad():
            model.apply(model._init_weights)
    model = model.to(dtype).eval()
    model.generation_config.eos_token_id = None  # random weights: generate every step asked for
    model.generation_config.pad_token_id = 0
    return model
