"""Probe (issue 20): moe_triton on the GPU for silu and silu_limit at 1, 5, 40 tokens: repeatable,
equal to its staged composition, and how far from the exact definition (reference.moe_block)."""

import torch

import tests.test_moe_kernels as T
from fp8compile import calc_diff
from fp8compile.ops import triton_moe, reference

for tokens in (1, 5, 40):
    outs = {}
    for act in ("silu", "silu_limit"):
        torch.manual_seed(0)
        args = T.moe_inputs(tokens)
        runs = [triton_moe.moe_triton(*args, False, activation=act) for _ in range(3)]
        ref = reference.moe_block(*[a.cpu() if a is not None else None for a in args], False, activation=act)
        outs[act] = runs[0]
        print(
            tokens,
            act,
            "repeat-equal",
            all(torch.equal(runs[0], r) for r in runs[1:]),
            "vs ref",
            [f"{calc_diff(r.cpu(), ref):.3e}" for r in runs],
            "vs staged",
            f"{calc_diff(runs[0], T.staged_reference(*args, act)):.3e}",
            flush=True,
        )
    print(tokens, "silu == silu_limit", torch.equal(outs["silu"], outs["silu_limit"]))
