"""`python -m fp8compile demo`: compile a small Llama-shaped transformers model with the fp8
backend on the best available device, print the report and the accuracy against eager bf16."""

from __future__ import annotations

import time

import torch

from . import Fp8Backend, calc_diff


class GatedMLP(torch.nn.Module):
    """Llama / gpt-fast feed-forward: down(silu(gate(x)) * up(x)), bias-free."""

    def __init__(self, hidden: int = 256, intermediate: int = 512):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = torch.nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def small_llama(
    vocab: int = 32000, hidden: int = 256, intermediate: int = 512, layers: int = 2, seed: int = 0
):
    """transformers LlamaForCausalLM with random weights (HF init: N(0, 0.02)), bf16, eval mode."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        raise SystemExit("the demo builds a transformers Llama: pip install 'transformers>=5'") from e
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=4096,
    )
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def main(device: str | None = None, batch: int = 2, seq: int = 24, **options) -> int:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = small_llama().to(device)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
    fp8 = Fp8Backend(**options)
    compiled = torch.compile(model, backend=fp8)
    with torch.no_grad():
        reference = model(ids).logits
        start = time.perf_counter()
        logits = compiled(ids).logits
        compile_s = time.perf_counter() - start
    print(
        f"device: {device}  model: LlamaForCausalLM hidden=256 intermediate=512 layers=2 vocab=32000  "
        f"input: {batch}x{seq}"
    )
    print(fp8.report)
    print(f"\nfirst call (compile + run): {compile_s:.1f} s")
    print(
        f"logits calc_diff vs eager bf16: {calc_diff(logits, reference):.2e}  "
        "(one block-FP8 GEMM on random data is ~7e-4; errors add up along the model's serial GEMMs)"
    )
    return 0
