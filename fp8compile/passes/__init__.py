"""FX passes over the ATen inference graph. Each pass matches, checks and rewrites in place,
recording every rewrite and every candidate it leaves in bf16 on the context's report."""

from __future__ import annotations

from .all_reduce import all_reduce_pass
from .all_reduce_norm import all_reduce_norm_pass
from .checkpoint_experts import checkpoint_experts_pass
from .checkpoint_linear import checkpoint_linear_pass
from .checkpoint_merge import checkpoint_merge_pass
from .checkpoint_rowwise import checkpoint_rowwise_pass
from .context import GraphInputs, PassContext
from .gate_up import gate_up_pass
from .gqa_attention import gqa_attention_pass
from .guard import Fault, run_guarded
from .linear import linear_pass
from .moe import moe_pass
from .moe_dense import moe_dense_pass
from .mqa_logits import mqa_logits_pass
from .qkv import qkv_pass
from .silu_mul import silu_mul_pass


def moe_passes(ctx: PassContext) -> None:
    """The "moe" fusion: routed experts (moe.py), then dense ones (Llama 4's, moe_dense.py)."""
    moe_pass(ctx)
    moe_dense_pass(ctx)


# Order matters: a fusion claims its down projection before linear_pass sees it as a plain linear.
# Each fusion runs when its name is in Fp8Config.fusions; the FP8 checkpoint's passes (its
# experts under the moe fusion's name, its linears merged where they read one x under the
# gate_up and qkv fusions' names, then the rest) and linear_pass always run, last.
FUSION_PASSES = {
    "gqa_attention": gqa_attention_pass,
    "mqa_logits": mqa_logits_pass,
    "moe": moe_passes,
    "gate_up": gate_up_pass,
    "qkv": qkv_pass,
    "silu_mul": silu_mul_pass,
    "all_reduce": all_reduce_pass,
    "all_reduce_norm": all_reduce_norm_pass,  # on all_reduce's op
}
CHECKPOINT_PASSES = (
    ("checkpoint_experts", checkpoint_experts_pass),
    ("checkpoint_merge", checkpoint_merge_pass),
    ("checkpoint_linear", checkpoint_linear_pass),
    ("checkpoint_rowwise", checkpoint_rowwise_pass),
)
PASSES = (*FUSION_PASSES.values(), *(p for _, p in CHECKPOINT_PASSES), linear_pass)


def run_passes(ctx: PassContext) -> list[Fault]:
    """The fusions the config asks for, then linear_pass, each site's error contained
    (guard.py); returns the errors, each already on the report."""
    chosen = [(name, fusion) for name, fusion in FUSION_PASSES.items() if name in ctx.config.fusions]
    faults = run_guarded(ctx, [*chosen, *CHECKPOINT_PASSES, ("linear", linear_pass)])
    ctx.gm.graph.eliminate_dead_code()
    ctx.drop_unused_derived_inputs()
    ctx.gm.graph.lint()
    ctx.gm.recompile()
    return faults


__all__ = ["GraphInputs", "PassContext", "run_passes", "PASSES"]
