"""The moe pass and fp8compile::moe: routed-experts blocks, written the ways real model code
writes them, become one fused FP8 experts op; router, top-k and shared experts stay outside."""

from pathlib import Path

import pytest
import torch
from torch import nn

import fp8compile
from fp8compile import calc_diff
from fp8compile.ops import activations
from fp8compile.ops.linear import reference as linear_reference
from fp8compile.ops.moe import reference as moe_reference
from fp8compile.ops.quant import reference as quant_reference
from tests.conftest import BF16, ONE_GEMM, golden_text, randn
from tests.models import ClampedBatchedMoE, GptFastMoE, MaskedGroupedMoE

transformers = pytest.importorskip("transformers")
aten = torch.ops.aten
MOE = torch.ops.fp8compile.moe.default
EXPERT_GEMMS = (aten._grouped_mm.default, aten.bmm.default)

# An expert is a gated MLP: block-FP8 gate/up, the activation, block-FP8 down, like
# conftest.GATED_MLP. calc_diff of the blocks below against eager bf16, seeds 0-2: GPT-OSS
# 1.30e-3..1.35e-3, Qwen3-MoE 1.92e-3..2.07e-3, gpt-fast 1.89e-3..2.15e-3, Mixtral (fp32 routing
# weights) 1.92e-3..2.14e-3.
MOE_BLOCK = 3.5 * ONE_GEMM


def qwen3_moe_config(impl: str, **changes):
    """The issue's small Qwen3-MoE: hidden 256, moe_intermediate 256, 8 experts, top-2, 2 layers."""
    options = dict(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=256,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        norm_topk_prob=True,
        max_position_embeddings=256,
    )
    cfg = transformers.Qwen3MoeConfig(**{**options, **changes})
    cfg._experts_implementation = impl
    return cfg


def init_normal(model: nn.Module, std: float = 0.02) -> nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1 or p.numel() > 1:
                p.normal_(0, std)
    return model


def qwen3_moe_block(impl: str, **changes):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    return init_normal(Qwen3MoeSparseMoeBlock(qwen3_moe_config(impl, **changes)).to(BF16))


def gpt_oss_mlp(impl: str, inter: int = 384):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = transformers.GptOssConfig(
        hidden_size=256, intermediate_size=inter, num_local_experts=8, num_experts_per_tok=2
    )
    cfg._experts_implementation = impl
    return init_normal(GptOssMLP(cfg).to(BF16))


def mixtral_block(impl: str):
    """Mixtral's block: its router hands the experts fp32 routing weights (a softmax in fp32)."""
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = transformers.MixtralConfig(
        hidden_size=256, intermediate_size=256, num_local_experts=8, num_experts_per_tok=2
    )
    cfg._experts_implementation = impl
    return init_normal(MixtralSparseMoeBlock(cfg).to(BF16))


def compile_block(model, x, **options):
    torch._dynamo.mark_dynamic(x, x.dim() - 2)
    fp8 = fp8compile.backend(**options)
    with torch.no_grad():
        out, eager = torch.compile(model, backend=fp8)(x), model(x)
    first = lambda y: y[0] if isinstance(y, tuple) else y  # noqa: E731  GptOssMLP also returns router scores
    return first(out), first(eager), fp8.report


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_qwen3_moe_every_moe_block_is_rewritten_and_logits_stay_within_the_fp8_bound(impl, captured):
    torch.manual_seed(0)
    model = init_normal(transformers.Qwen3MoeForCausalLM(qwen3_moe_config(impl)).to(BF16))
    ids = torch.randint(0, 512, (1, 75))  # 75 tokens: not a multiple of 128
    torch._dynamo.mark_dynamic(ids, 1)
    fp8 = fp8compile.backend()
    with torch.no_grad():
        eager = model(ids).logits
        logits = torch.compile(model, backend=fp8)(ids).logits

    moe = [r for r in fp8.report.rewrites if r.kind == "moe"]
    assert [r.name for r in moe] == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert all(r.detail == "8 experts, top-2, concat, silu" and r.m == "dynamic" for r in moe)
    assert fp8.report.counts()["moe"] == 2
    # The routers stay bf16, and nothing else is left behind.
    assert {(s.kind, s.name) for s in fp8.report.skips} == {
        ("linear", f"model.layers.{i}.mlp.gate") for i in range(2)
    }
    assert all(s.reason.startswith("router of a rewritten MoE block") for s in fp8.report.skips)
    (g,) = captured
    assert sum(g.count(t) for t in EXPERT_GEMMS) == 0  # every expert matmul is gone
    assert len(g.ops(MOE)) == 2  # one op per block (the CPU's one kernel for every token count: no cond)
    # Attention (q/k/v/o) and lm_head are FP8 too. Measured 6.7e-4 on seeds 0-2 under both
    # implementations: with weights N(0, 0.02) the embeddings dominate the residual stream, so
    # lm_head's own GEMM error dominates. The bound is 5e-3.
    assert calc_diff(logits, eager) < 5e-3


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_gpt_oss_experts_interleaved_transposed_with_bias_and_swigluoai_are_rewritten(impl, captured):
    torch.manual_seed(0)
    out, eager, report = compile_block(gpt_oss_mlp(impl), randn(1, 37, 256))
    (r,) = [r for r in report.rewrites if r.kind == "moe"]
    assert (r.name, r.detail, r.n, r.k) == (
        "experts",
        "8 experts, top-2, interleave, bias, swigluoai",
        768,
        256,
    )
    (g,) = captured
    assert sum(g.count(t) for t in EXPERT_GEMMS) == 0
    assert calc_diff(out, eager) < MOE_BLOCK


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_experts_with_fp32_routing_weights_are_rewritten_and_give_the_blocks_dtype(impl, captured):
    """The op takes the routing weights in the router's dtype (fp32 here) and sums in fp32; the
    block's product with them was fp32, so the op's bf16 result is cast to fp32 where that
    product was (the model casts it back to bf16 next: one rounding, as before)."""
    torch.manual_seed(0)
    out, eager, report = compile_block(mixtral_block(impl), randn(1, 37, 256))
    (r,) = [r for r in report.rewrites if r.kind == "moe"]
    assert r.detail == "8 experts, top-2, concat, silu"
    (g,) = captured
    (op,) = g.ops(MOE)
    assert op.args[2].meta["val"].dtype == torch.float32
    assert sum(g.count(t) for t in EXPERT_GEMMS) == 0
    assert out.dtype == eager.dtype == BF16
    assert calc_diff(out, eager) < MOE_BLOCK


@pytest.mark.parametrize(
    "make_model, layout",
    [(GptFastMoE, "separate"), (MaskedGroupedMoE, "concat")],
    ids=["w1[expert_ids] with einsum (gpt-fast)", "grouped_mm with sentinel masks"],
)
def test_plain_pytorch_moe_forms_are_rewritten(make_model, layout, captured):
    torch.manual_seed(0)
    out, eager, report = compile_block(make_model().to(BF16), randn(37, 256))
    (r,) = [r for r in report.rewrites if r.kind == "moe"]
    assert r.detail == f"8 experts, top-2, {layout}, silu"
    (g,) = captured
    assert sum(g.count(t) for t in EXPERT_GEMMS) == 0
    assert calc_diff(out, eager) < MOE_BLOCK


def test_where_no_fp8_kernel_runs_the_experts_they_stay_bf16_unquantized_with_the_reason(monkeypatch):
    """The token-count dispatch is planned before the experts' FP8 copies are made: where it
    finds no kernel (an A100, registry.NoGpuKernel), no copy is made that no kernel would read."""
    from fp8compile.passes import dispatch
    from fp8compile.passes import moe as moe_pass

    real_plan = dispatch.plan

    def plan(ctx, op, *args):
        if op == "moe":
            raise dispatch.NoDispatch("no FP8 kernel runs moe (M in [1, inf]) on this GPU (...): kept bf16")
        return real_plan(ctx, op, *args)

    monkeypatch.setattr(dispatch, "plan", plan)
    quantized = []
    monkeypatch.setattr(moe_pass, "fp8_experts", lambda *a, **k: quantized.append(a[0].shape))
    torch.manual_seed(0)
    out, eager, report = compile_block(GptFastMoE().to(BF16), randn(37, 256))
    (skip,) = report.skipped("moe")
    assert "no FP8 kernel runs moe" in skip.reason and report.counts()["moe"] == 0 and quantized == []
    assert calc_diff(out, eager) < 1e-4  # stays bf16


def test_batched_mm_experts_with_ids_clamped_to_the_expert_range_are_rewritten():
    """transformers 5.17 clamps every routed id to [0, E - 1] before gathering the weights (what
    generate() runs for decode on a GPU): a no-op for ids top-k drew from E experts."""
    torch.manual_seed(0)
    out, eager, report = compile_block(ClampedBatchedMoE().to(BF16), randn(37, 256))
    assert report.counts()["moe"] == 1
    assert calc_diff(out, eager) < MOE_BLOCK


def test_ids_clamped_below_the_last_expert_keep_the_block_bf16():
    """A clamp that can change an id (here to [0, E - 2]) is routing the op does not do."""
    torch.manual_seed(0)
    out, eager, report = compile_block(ClampedBatchedMoE(clamp_max=6).to(BF16), randn(37, 256))
    (skip,) = report.skipped("moe")
    assert "top-k expert ids" in skip.reason and report.counts()["moe"] == 0
    assert calc_diff(out, eager) < 1e-4  # stays bf16


def test_the_router_stays_bf16_even_where_its_shape_would_fit_fp8():
    out, eager, report = compile_block(GptFastMoE(experts=128).to(BF16), randn(37, 256))  # router N = 128
    assert report.counts() == {"linear": 0, "silu_mul": 0, "moe": 1, "attention": 0, "mqa_logits": 0}
    (skip,) = report.skipped("linear")
    assert skip.name == "gate" and "router of a rewritten MoE block" in skip.reason


def test_eager_experts_loop_is_reported_as_not_one_graph():
    out, eager, report = compile_block(qwen3_moe_block("eager"), randn(1, 5, 256))
    (skip,) = report.skipped("moe")
    assert "Python loop over the experts" in skip.reason and "'grouped_mm'" in skip.reason
    assert report.counts()["moe"] == 0
    assert calc_diff(out, eager) < 1e-4  # stays bf16


@pytest.mark.parametrize(
    "block, layout, n13",
    [
        ("qwen3_moe", "concat, silu", 512),
        ("gpt_oss", "interleave, bias, swigluoai", 512),
        ("nemotron_h", "none, relu2", 256),
    ],
)
def test_experts_with_an_intermediate_size_of_part_of_a_block_are_rewritten_padded_to_whole_blocks(
    block, layout, n13, captured
):
    """transformers' NemotronHConfig has experts of I = 7688 (60 blocks and 8 rows): FP8 copies pad I
    with zeros to whole 128-wide blocks (each half of a gate/up projection, the columns of the down
    projection), which changes no number, so every kernel serves them."""
    torch.manual_seed(0)
    make = {
        "qwen3_moe": lambda: qwen3_moe_block("grouped_mm", moe_intermediate_size=192),
        "gpt_oss": lambda: gpt_oss_mlp("grouped_mm", inter=192),
        "nemotron_h": lambda: nemotron_h_moe("grouped_mm", inter=192),
    }[block]
    out, eager, report = compile_block(make(), randn(1, 37, 256))
    (r,) = [r for r in report.rewrites if r.kind == "moe"]
    assert r.detail == f"8 experts, top-2, {layout}, intermediate 192 padded to 256" and (r.n, r.k) == (
        n13,
        256,
    )
    (g,) = captured
    assert sum(g.count(t) for t in EXPERT_GEMMS) == 0
    assert calc_diff(out, eager) < MOE_BLOCK


def test_experts_with_a_hidden_size_not_a_multiple_of_128_stay_bf16_with_the_reason():
    out, eager, report = compile_block(qwen3_moe_block("grouped_mm", hidden_size=320), randn(1, 9, 320))
    (skip,) = report.skipped("moe")
    assert skip.name == "experts" and "hidden size 320 is not a multiple of 128" in skip.reason
    assert report.counts()["moe"] == 0


def test_fp32_experts_stay_fp32_with_the_reason():
    model = GptFastMoE()
    x = torch.randn(9, 256)
    out, eager, report = compile_block(model, x)
    (skip,) = report.skipped("moe")
    assert skip.reason.startswith("dtype float32: experts are rewritten in bfloat16 or float16 models")
    assert torch.allclose(out, eager, atol=1e-5)


class ReluSquaredExperts(nn.Module):
    """Non-gated experts (Nemotron-H style): down(relu(up(x))^2) over gathered weights."""

    def __init__(self, dim=256, inter=256, experts=8, top_k=2):
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.up = nn.Parameter(torch.randn(experts, inter, dim) * 0.02)
        self.down = nn.Parameter(torch.randn(experts, dim, inter) * 0.02)
        self.top_k = top_k

    def forward(self, x):
        weights, ids = torch.topk(self.router(x).softmax(-1), self.top_k, dim=-1)
        flat = ids.reshape(-1)
        xs = x.repeat_interleave(self.top_k, dim=0)
        h = torch.relu(torch.bmm(self.up[flat], xs.unsqueeze(-1)).squeeze(-1)) ** 2
        y = torch.bmm(self.down[flat], h.unsqueeze(-1)).squeeze(-1)
        return (y * weights.reshape(-1, 1)).view(x.shape[0], self.top_k, -1).sum(1)


def nemotron_h_moe(impl: str, inter: int = 256):
    """Nemotron-H's MoE block: non-gated experts down(relu(up(x))^2), a sigmoid router with a
    score-correction bias (fp32), and a shared expert."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

    cfg = transformers.NemotronHConfig(
        hidden_size=256,
        moe_intermediate_size=inter,
        moe_shared_expert_intermediate_size=256,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
    )
    cfg._experts_implementation = impl
    return init_normal(NemotronHMoE(cfg).to(BF16))


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_nemotron_h_non_gated_relu_squared_experts_are_rewritten(impl, captured):
    torch.manual_seed(0)
    out, eager, report = compile_block(nemotron_h_moe(impl), randn(1, 37, 256))
    (r,) = [r for r in report.rewrites if r.kind == "moe"]
    # the up projection alone: N = I (256), not 2I
    assert (r.name, r.detail, r.n, r.k) == ("experts", "8 experts, top-2, none, relu2", 256, 256)
    (g,) = captured
    assert sum(g.count(t) for t in EXPERT_GEMMS) == 0
    # The router stays bf16... here fp32: it casts its weight, and says so.
    (skip,) = report.skipped("linear")
    assert skip.name == "gate" and skip.reason.startswith("dtype float32: its weight cast to float32")
    assert calc_diff(out, eager) < MOE_BLOCK


def test_plain_pytorch_relu_squared_experts_are_rewritten():
    out, eager, report = compile_block(ReluSquaredExperts().to(BF16), randn(9, 256))
    (r,) = [r for r in report.rewrites if r.kind == "moe"]
    assert r.detail == "8 experts, top-2, none, relu2"
    assert calc_diff(out, eager) < MOE_BLOCK


class GeluExperts(ReluSquaredExperts):
    """Non-gated experts with an activation the op has no kernel for: down(gelu(up(x)))."""

    def forward(self, x):
        weights, ids = torch.topk(self.router(x).softmax(-1), self.top_k, dim=-1)
        flat = ids.reshape(-1)
        xs = x.repeat_interleave(self.top_k, dim=0)
        h = torch.nn.functional.gelu(torch.bmm(self.up[flat], xs.unsqueeze(-1)).squeeze(-1))
        y = torch.bmm(self.down[flat], h.unsqueeze(-1)).squeeze(-1)
        return (y * weights.reshape(-1, 1)).view(x.shape[0], self.top_k, -1).sum(1)


def test_non_gated_experts_with_another_activation_stay_bf16_naming_it():
    out, eager, report = compile_block(GeluExperts().to(BF16), randn(9, 256))
    (skip,) = report.skipped("moe")
    assert "non-gated experts with the activation" in skip.reason and "relu2" in skip.reason, skip.reason
    assert "gelu" in skip.reason or "erf" in skip.reason, skip.reason
    assert torch.allclose(out, eager, atol=1e-2)


GOLDEN_DENSE = Path(__file__).parent / "golden" / "llama4_dense_experts.diff"


def test_golden_graph_diff_of_llama4_dense_experts_over_their_top_k_slots(pass_diffs):
    """Top-2 dense experts on 5 tokens: the repeat, the scaling and both bmm's leave; a top-k of
    the scores the model multiplied makes 10 rows x * s, routed top-1 with weight 1, through
    fp8compile::moe, and each token's two rows are summed. Regenerate with
    FP8COMPILE_UPDATE_GOLDEN=1 after an intended change, and read the diff."""
    model, x = Llama4Experts(top_k=2).to(BF16), randn(5, 256)
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend=fp8compile.backend(fusions=("moe",)), dynamic=False)(x)
        assert calc_diff(out, model(x)) < MOE_BLOCK
    (diff,) = pass_diffs
    assert diff == golden_text(GOLDEN_DENSE, diff)


class DenseMixture(nn.Module):
    """Every token through every expert (bmm over whole (E, K, N) weights), each expert's input
    scaled by its sigmoid score: no top-k, so every expert counts."""

    def __init__(self, dim=256, inter=256, experts=4):
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.gate_up_proj = nn.Parameter(torch.randn(experts, dim, 2 * inter) * 0.02)
        self.down_proj = nn.Parameter(torch.randn(experts, inter, dim) * 0.02)

    def scores(self, x):
        return torch.sigmoid(self.router(x))  # (T, E)

    def forward(self, x):
        scores = self.scores(x)
        routed = x.repeat(scores.shape[1], 1) * scores.t().reshape(-1, 1)
        gate, up = torch.bmm(routed.view(scores.shape[1], -1, x.shape[-1]), self.gate_up_proj).chunk(2, -1)
        out = torch.bmm(up * torch.nn.functional.silu(gate), self.down_proj)
        return out.sum(0)


class Llama4Experts(DenseMixture):
    """Llama 4's Llama4TextMoe: the router's top-k logits scattered into -inf and through a
    sigmoid (0 off the top-k) scale the tokens, repeated once per expert, of dense experts."""

    def __init__(self, top_k=1, **sizes):
        super().__init__(**sizes)
        self.top_k = top_k

    def scores(self, x):
        logits = self.router(x)
        values, ids = torch.topk(logits, self.top_k, dim=1)
        return torch.sigmoid(torch.full_like(logits, float("-inf")).scatter_(1, ids, values).float()).to(
            x.dtype
        )


@pytest.mark.parametrize("top_k", [1, 2])
def test_llama4_dense_experts_run_as_the_routed_op_over_each_tokens_top_k_slots(top_k):
    out, eager, report = compile_block(Llama4Experts(top_k).to(BF16), randn(9, 256))
    (r,) = [r for r in report.rewrites if r.kind == "moe"]
    assert r.name == "(top level)" and r.m == "dynamic"
    assert (
        r.detail
        == f"4 experts, top-{top_k}, concat, silu, dense (router-scaled inputs: a top-1 row per slot)"
    )
    assert calc_diff(out, eager) < MOE_BLOCK


class ThresholdScoredExperts(Llama4Experts):
    """Dense experts whose scores come through the router's top-k but are not zero off it: each
    expert's sigmoid score is shifted by the k-th largest logit, so every expert still counts."""

    def scores(self, x):
        logits = self.router(x)
        values, _ = torch.topk(logits, self.top_k, dim=1)
        return torch.sigmoid(logits - values[:, -1:])


@pytest.mark.parametrize("block", [DenseMixture, ThresholdScoredExperts])
def test_dense_experts_not_in_llama4s_form_become_one_fp8_linear_per_expert(block):
    out, eager, report = compile_block(block(experts=4).to(BF16), randn(9, 256))
    assert report.counts()["moe"] == 0 and not report.skipped("moe")
    names = sorted(r.name for r in report.rewrites if r.kind == "linear")
    assert names == sorted(f"{p}[{e}]" for p in ("gate_up_proj", "down_proj") for e in range(4))
    assert calc_diff(out, eager) < MOE_BLOCK


@pytest.mark.parametrize(
    "block, reason",
    [
        (DenseMixture, "top-k (experts per token) is not found"),
        (ThresholdScoredExperts, "not zero off its top-1"),
    ],
)
def test_dense_experts_past_the_split_limit_stay_bf16_with_the_reason(block, reason):
    from fp8compile.passes import moe_dense

    experts = moe_dense.SPLIT_EXPERTS + 1
    out, eager, report = compile_block(block(experts=experts).to(BF16), randn(9, 256))
    (skip,) = report.skipped("moe")
    assert skip.name == "(top level)" and reason in skip.reason, skip.reason
    assert report.counts()["moe"] == report.counts()["linear"] == 0
    assert calc_diff(out, eager) < 1e-4  # stays bf16


class StackedSharedExperts(nn.Module):
    """Shared experts stacked in parameters (Inkling's): every token through each one's gate,
    up and down, (E, N, K) weights read transposed by bmm, each expert's product scaled by its
    own gamma, the experts' outputs summed in fp32."""

    def __init__(self, dim=256, inter=256, experts=2):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.randn(experts, inter, dim) * 0.02)
        self.up_proj = nn.Parameter(torch.randn(experts, inter, dim) * 0.02)
        self.down_proj = nn.Parameter(torch.randn(experts, dim, inter) * 0.02)
        self.gammas = nn.Linear(dim, experts, bias=False)

    def forward(self, x):
        h = x.reshape(1, -1, x.shape[-1]).expand(self.gate_proj.shape[0], -1, -1)
        gammas = torch.sigmoid(self.gammas(x)).reshape(-1, self.gate_proj.shape[0], 1).transpose(0, 1)
        gate = torch.bmm(h, self.gate_proj.transpose(1, 2))
        up = torch.bmm(h, self.up_proj.transpose(1, 2))
        down = torch.bmm(torch.nn.functional.silu(gate) * up * gammas, self.down_proj.transpose(1, 2))
        return down.float().sum(0).to(x.dtype)


def test_shared_experts_stacked_in_parameters_become_one_fp8_linear_per_expert():
    out, eager, report = compile_block(StackedSharedExperts().to(BF16), randn(9, 256))
    names = sorted(r.name for r in report.rewrites if r.kind == "linear")
    assert names == sorted(f"{p}[{e}]" for p in ("gate_proj", "up_proj", "down_proj") for e in range(2))
    assert not report.skipped("moe")
    assert calc_diff(out, eager) < MOE_BLOCK


def test_expert_weights_are_quantized_once_at_compile_time_and_the_model_is_untouched(weight_quantizations):
    calls = weight_quantizations
    model = qwen3_moe_block("grouped_mm")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fp8 = fp8compile.backend()
    compiled = torch.compile(model, backend=fp8)
    with torch.no_grad():
        for m in (5, 40, 3):
            x = randn(1, m, 256)
            torch._dynamo.mark_dynamic(x, 1)
            compiled(x)
    # gate_up (8 x 512 rows) and down (8 x 256 rows), once each, while the graph is compiled;
    # one graph serves all three calls.
    assert sorted(calls[:2]) == [(8 * 256, 256), (8 * 512, 256)] and calls[2:] == ["compiled"]
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


# ---------------------------------------------------------------------------------------------
# The op on its own: routing edge cases against the definition.


def random_experts(num_experts=4, inter=256, hidden=256, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.05).to(BF16)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) * 0.05).to(BF16)
    b13 = (torch.randn(num_experts, 2 * inter, generator=g) * 0.1).to(BF16) if bias else None
    b2 = (torch.randn(num_experts, hidden, generator=g) * 0.1).to(BF16) if bias else None
    return w13, w2, b13, b2


def slot_by_slot(x, ids, topk_weights, w13, w2, b13=None, b2=None, **act):
    """The FP8 definition computed one (token, slot) at a time with linear_reference.linear_block."""
    w13_fp8, s13 = quant_reference.quant_weight_block(w13.reshape(-1, w13.shape[-1]))
    w2_fp8, s2 = quant_reference.quant_weight_block(w2.reshape(-1, w2.shape[-1]))
    n13, n2 = w13.shape[1], w2.shape[1]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < w13.shape[0]:
                continue
            rows13, rows2 = slice(e * n13, (e + 1) * n13), slice(e * n2, (e + 1) * n2)
            h = linear_reference.linear_block(
                x[t : t + 1],
                w13_fp8[rows13],
                s13[e * n13 // 128 : (e + 1) * n13 // 128],
                None,
                out_dtype=torch.float32,
            )
            if b13 is not None:
                h = h + b13[e].float()
            act_args = {"activation": "silu", "alpha": 1.702, "limit": 7.0, **act}
            y = linear_reference.linear_block(
                activations.expert_activation(h.to(x.dtype), **act_args),
                w2_fp8[rows2],
                s2[e * n2 // 128 : (e + 1) * n2 // 128],
                None,
                out_dtype=torch.float32,
            )
            if b2 is not None:
                y = y + b2[e].float()
            out[t] += y[0] * topk_weights[t, j].float()
    return out.to(x.dtype)


ROUTES = {
    "an expert gets no tokens": lambda t: torch.tensor([[0, 2], [2, 0], [0, 1]] * t)[:t],
    "all tokens to one expert": lambda t: torch.full((t, 2), 3),
    "one token": lambda t: torch.tensor([[1, 3]]),
    "an id outside [0, E) adds nothing": lambda t: torch.tensor([[0, 4], [-1, 2], [3, 1]] * t)[:t],
}


@pytest.mark.parametrize("route", ROUTES, ids=list(ROUTES))
@pytest.mark.parametrize("tokens", [1, 5])
def test_moe_op_matches_the_slot_by_slot_definition_on_routing_edge_cases(route, tokens):
    ids = ROUTES[route](tokens)
    tokens = ids.shape[0]
    x = randn(tokens, 256)
    topk_weights = torch.rand(tokens, 2).to(BF16)
    w13, w2, _, _ = random_experts()
    out = torch.ops.fp8compile.moe(x, ids, topk_weights, w13, w2)
    assert torch.equal(out, slot_by_slot(x, ids, topk_weights, w13, w2))


def test_moe_op_with_biases_and_swigluoai_matches_the_definition():
    ids, x, tw = torch.tensor([[0, 3], [3, 3], [1, 2]]), randn(3, 256), torch.rand(3, 2).to(BF16)
    w13, w2, b13, b2 = random_experts(bias=True)
    act = {"activation": "swigluoai", "alpha": 1.702, "limit": 7.0}
    out = torch.ops.fp8compile.moe(x, ids, tw, w13, w2, None, b13, b2, **act)
    assert torch.equal(out, slot_by_slot(x, ids, tw, w13, w2, b13, b2, **act))


@pytest.mark.parametrize("bias", [False, True])
def test_moe_op_with_non_gated_relu2_experts_matches_the_definition(bias):
    """gate_up="none": w13 is the up projection alone (E, I, H), an expert down(relu(up(x))^2)."""
    ids, x, tw = torch.tensor([[0, 3], [3, 3], [1, 2]]), randn(3, 256), torch.rand(3, 2).to(BF16)
    w13, w2, b13, b2 = random_experts(bias=bias)
    up, b_up = w13[:, :256].contiguous(), None if b13 is None else b13[:, :256].contiguous()
    act = {"gate_up": "none", "activation": "relu2"}
    out = torch.ops.fp8compile.moe(x, ids, tw, up, w2, None, b_up, b2, **act)
    assert torch.equal(out, slot_by_slot(x, ids, tw, up, w2, b_up, b2, activation="relu2"))
    torch.library.opcheck(torch.ops.fp8compile.moe.default, (x, ids, tw, up, w2, None, b_up, b2), act)


def _zero_padded(t: torch.Tensor | None, dim: int, halves: int, to: int = 256) -> torch.Tensor | None:
    """t with each of its halves along dim followed by zeros up to `to`, written out by hand."""
    if t is None:
        return None
    parts = t.split(t.shape[dim] // halves, dim)
    return torch.cat(
        [
            torch.cat([p, p.new_zeros(*p.shape[:dim], to - p.shape[dim], *p.shape[dim + 1 :])], dim)
            for p in parts
        ],
        dim,
    )


@pytest.mark.parametrize("layout", ["concat", "none"])
@pytest.mark.parametrize("bias", [False, True])
def test_moe_op_on_an_intermediate_size_of_part_of_a_block_is_the_op_on_the_zero_padded_experts(layout, bias):
    """I = 192: the op gives the bits of the same experts padded with zeros to I = 256 by hand, and
    of the definition slot by slot on those; within the FP8 bound of the unquantized block."""
    ids, x, tw = torch.tensor([[0, 3], [3, 3], [1, 2]]), randn(3, 256), torch.rand(3, 2).to(BF16)
    w13, w2, b13, b2 = random_experts(inter=192, bias=bias)
    act, halves = {}, 2
    if layout == "none":
        w13, b13 = w13[:, :192].contiguous(), None if b13 is None else b13[:, :192].contiguous()
        act, halves = {"gate_up": "none", "activation": "relu2"}, 1
    out = torch.ops.fp8compile.moe(x, ids, tw, w13, w2, None, b13, b2, **act)
    padded = (_zero_padded(w13, 1, halves), _zero_padded(w2, 2, 1), _zero_padded(b13, 1, halves))
    assert torch.equal(
        out, torch.ops.fp8compile.moe(x, ids, tw, padded[0], padded[1], None, padded[2], b2, **act)
    )
    definition = slot_by_slot(
        x, ids, tw, padded[0], padded[1], padded[2], b2, activation=act.get("activation", "silu")
    )
    assert torch.equal(out, definition)
    unquantized = moe_reference.moe_dense(
        x, ids, tw, w13, w2, b13, b2, activation=act.get("activation", "silu")
    )
    assert calc_diff(out, unquantized) < MOE_BLOCK


def test_fp8_expert_copies_hold_the_last_rows_of_each_half_in_a_partial_block():
    """The padded rows are zeros and add nothing to the last block's amax: the rows of each half
    are quantized as a weight of 192 rows on its own is (a partial last block)."""
    from fp8compile import weights

    w13 = randn(2, 384, 256)  # gate (192 rows) then up (192 rows)
    w_fp8, w_scale = weights.fp8_experts(w13, gate_up="concat")
    assert w_fp8.shape == (2, 512, 256) and w_scale.shape == (2, 4, 2)
    for e in range(2):
        for half, rows in ((0, slice(0, 192)), (1, slice(256, 448))):
            q, scale = quant_reference.quant_weight_block(w13[e, half * 192 : (half + 1) * 192])
            assert torch.equal(w_fp8[e, rows].view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(w_scale[e, 2 * half : 2 * half + 2], scale)
        assert not w_fp8[e, 192:256].float().any() and not w_fp8[e, 448:].float().any()


def test_moe_op_refuses_an_activation_that_does_not_fit_the_layout():
    ids, x, tw = torch.tensor([[0, 3]]), randn(1, 256), torch.rand(1, 2).to(BF16)
    w13, w2, _, _ = random_experts()
    with pytest.raises(RuntimeError, match="valid non-gated activations"):
        torch.ops.fp8compile.moe(x, ids, tw, w13[:, :256], w2, gate_up="none")  # silu needs a gate
    with pytest.raises(RuntimeError, match="valid gated activations"):
        torch.ops.fp8compile.moe(x, ids, tw, w13, w2, activation="relu2")  # relu2 has no gate


def test_moe_op_reads_interleaved_separate_and_transposed_weight_layouts_alike():
    ids, x, tw = torch.tensor([[0, 3], [2, 1]]), randn(2, 256), torch.rand(2, 2).to(BF16)
    w13, w2, _, _ = random_experts()
    expected = torch.ops.fp8compile.moe(x, ids, tw, w13, w2)
    gate, up = w13[:, :256], w13[:, 256:]
    interleaved = torch.stack([gate, up], dim=2).reshape(w13.shape)
    assert torch.equal(torch.ops.fp8compile.moe(x, ids, tw, interleaved, w2, gate_up="interleave"), expected)
    assert torch.equal(
        torch.ops.fp8compile.moe(x, ids, tw, gate.contiguous(), w2, up.contiguous(), gate_up="separate"),
        expected,
    )
    assert torch.equal(
        torch.ops.fp8compile.moe(
            x, ids, tw, w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous(), w_kn=True
        ),
        expected,
    )


def test_moe_op_is_within_two_gemms_of_fp8_error_of_the_unquantized_block():
    ids, x, tw = torch.randint(0, 4, (64, 2)), randn(64, 256), torch.rand(64, 2).to(BF16)
    w13, w2, _, _ = random_experts()
    out = torch.ops.fp8compile.moe(x, ids, tw, w13, w2)
    assert calc_diff(out, moe_reference.moe_dense(x, ids, tw, w13, w2)) < MOE_BLOCK


def test_moe_op_passes_opcheck():
    ids, x, tw = torch.tensor([[0, 3], [2, 1], [1, 1]]), randn(3, 256), torch.rand(3, 2).to(BF16)
    w13, w2, b13, b2 = random_experts(bias=True)
    torch.library.opcheck(torch.ops.fp8compile.moe.default, (x, ids, tw, w13, w2, None, b13, b2))


def test_moe_op_rejects_mismatched_shapes_with_a_clear_error():
    w13, w2, _, _ = random_experts()
    with pytest.raises(RuntimeError, match=r"topk_ids and topk_weights \(T, k\)"):
        torch.ops.fp8compile.moe(
            randn(3, 256), torch.zeros(2, 2, dtype=torch.long), torch.rand(2, 2), w13, w2, backend="reference"
        )


def test_fusions_option_without_moe_leaves_the_experts_bf16():
    out, eager, report = compile_block(qwen3_moe_block("grouped_mm"), randn(1, 9, 256), fusions=["silu_mul"])
    assert report.counts()["moe"] == 0 and report.skipped("moe") == []
    assert calc_diff(out, eager) < 1e-4


def test_expert_weights_quantized_a_few_experts_at_a_time_are_those_of_all_at_once(monkeypatch):
    """fp8_experts bounds the fp32 working copy of its quantization (DeepSeek-V3's 256 experts at
    once took 28 GB more than an H100 beside the bf16 block had): each expert's 128x128 blocks
    are its own, so chunks of experts, an uneven last one included, give the same bits."""
    from fp8compile import weights

    w = randn(5, 256, 384)
    whole_fp8, whole_scale = quant_reference.quant_weight_block(w.reshape(5 * 256, 384))
    monkeypatch.setattr(weights, "QUANT_CHUNK_ELEMENTS", 2 * 256 * 384)  # 2, 2, then 1 expert
    quantized, quantize = [], weights._quantize
    monkeypatch.setattr(
        weights, "_quantize", lambda x, e8m0: quantized.append(x.shape[0]) or quantize(x, e8m0)
    )
    w_fp8, w_scale = weights.fp8_experts(w)
    assert quantized == [512, 512, 256]
    assert w_fp8.shape == (5, 256, 384) and w_scale.shape == (5, 2, 3)
    assert torch.equal(w_fp8.view(torch.uint8).reshape(5 * 256, 384), whole_fp8.view(torch.uint8))
    assert torch.equal(w_scale.reshape(10, 3), whole_scale)
