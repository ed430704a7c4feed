"""calc_diff of a gated MLP compiled with backend="fp8" against the eager bf16 module, fused
(every fusion) and unfused (fusions=()), at the Llama-3-8B shape with HF-style N(0, 0.02)
weights and unit-normal tokens. Runs on the CPU (reference ops) or a GPU:
python scripts/mlp_accuracy.py [--hidden 4096] [--inter 14336] [--tokens 64] [--device cpu]
"""
import argparse

import torch

import fp8compile
from fp8compile import calc_diff
from fp8compile.demo import GatedMLP


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--inter", type=int, default=14336)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = GatedMLP(args.hidden, args.inter)
    for p in model.parameters():
        torch.nn.init.normal_(p, 0, 0.02)
    model = model.to(args.device, torch.bfloat16)
    for name, options in (("fused", {}), ("unfused", dict(fusions=()))):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=fp8compile.backend(**options))
        with torch.no_grad():
            for seed in (100, 101, 102):
                torch.manual_seed(seed)
                x = torch.randn(args.tokens, args.hidden, device=args.device, dtype=torch.bfloat16)
                print(f"{name:8s} seed {seed}: calc_diff {calc_diff(compiled(x), model(x)):.4e}", flush=True)


if __name__ == "__main__":
    main()
