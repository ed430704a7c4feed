"""The qkv fusion: linears that read one x (q, k and v above all) run as one FP8 GEMM over their
weights stacked along N, its output sliced back; biases are stacked with them."""

from pathlib import Path

import pytest
import torch
from torch import nn

import fp8compile
from fp8compile import calc_diff
from tests.conftest import ATTENTION, BF16, golden_text, randn
from tests.models import Attention

LINEAR = torch.ops.fp8compile.qlinear.default


def run(model, x, **options):
    torch._dynamo.reset()
    torch._dynamo.mark_dynamic(x, 1)
    fp8 = fp8compile.backend(**options)
    with torch.no_grad():
        return torch.compile(model, backend=fp8)(x), fp8.report


class GroupedQuery(nn.Module):
    """Grouped-query attention's projections: k and v narrower than q; optional biases (Qwen2)."""

    def __init__(self, bias: bool, kv: int = 128):
        super().__init__()
        self.q_proj = nn.Linear(256, 256, bias=bias)
        self.k_proj = nn.Linear(256, kv, bias=bias)
        self.v_proj = nn.Linear(256, kv, bias=bias)

    def forward(self, x):
        return self.q_proj(x) * 2, self.k_proj(x) + 1, self.v_proj(x)


@pytest.mark.parametrize("bias", [False, True])
def test_q_k_and_v_become_one_gemm_with_the_bits_of_three(bias, captured):
    model, x = GroupedQuery(bias).to(BF16), randn(2, 37, 256)
    merged, report = run(model, x.clone())
    (gemm,) = captured[0].ops(LINEAR)
    assert gemm.args[1].meta["val"].shape[0] == 256 + 128 + 128 and (gemm.args[3] is not None) == bias
    assert {(r.name, r.n, r.detail) for r in report.rewrites} == {
        ("q_proj", 256, "one GEMM with k_proj, v_proj"),
        ("k_proj", 128, "one GEMM with q_proj, v_proj"),
        ("v_proj", 128, "one GEMM with q_proj, k_proj"),
    }
    separate, _ = run(model, x.clone(), fusions=())
    # same activation quantization, same weight blocks (each N whole blocks): the same bits
    assert all(torch.equal(a, b) for a, b in zip(merged, separate))


def test_attention_with_merged_projections_stays_within_its_bound():
    model, x = Attention().to(BF16), randn(2, 19, 256)
    out, report = run(model, x.clone())
    assert report.counts()["linear"] == 4
    with torch.no_grad():
        assert calc_diff(out, model(x)) < ATTENTION


def test_linears_that_stay_bf16_are_left_out_of_the_group():
    model = GroupedQuery(False)
    model.k_proj = nn.Linear(256, 100, bias=False)  # N = 100: not whole 128-row blocks, stays bf16
    _, report = run(model.to(BF16), randn(2, 9, 256))
    assert {r.name: r.detail for r in report.rewrites} == {
        "q_proj": "one GEMM with v_proj",
        "v_proj": "one GEMM with q_proj",
    }
    assert [s.name for s in report.skipped("linear")] == ["k_proj"]


def test_linears_with_and_without_bias_do_not_share_a_gemm(captured):
    model = GroupedQuery(True)
    model.v_proj = nn.Linear(256, 128, bias=False)
    _, report = run(model.to(BF16), randn(2, 9, 256))
    details = {r.name: r.detail for r in report.rewrites}
    assert details == {"q_proj": "one GEMM with k_proj", "k_proj": "one GEMM with q_proj", "v_proj": ""}


def test_without_the_fusion_each_linear_is_its_own_gemm(captured):
    run(GroupedQuery(False).to(BF16), randn(2, 9, 256), fusions=("gate_up", "silu_mul"))
    assert len(captured[0].ops(LINEAR)) == 3


def test_stacked_weights_and_biases_are_made_while_compiling(weight_quantizations, monkeypatch):
    # made at a first call instead, inside a CUDA graph's warm-up run, they would land in its memory pool
    from fp8compile import weights

    calls = weight_quantizations
    real = weights._memoized
    monkeypatch.setattr(
        weights,
        "_memoized",
        lambda sources, tag, make: real(sources, tag, lambda: calls.append(f"made {tag[0]}") or make()),
    )
    compiled = torch.compile(GroupedQuery(True).to(BF16), backend="fp8")
    with torch.no_grad():
        for m in (9, 40):  # the compile and its call, then a call that compiles nothing
            x = randn(2, m, 256)
            torch._dynamo.mark_dynamic(x, 1)
            compiled(x)
    assert calls == ["made linear", (512, 256), "made bias", "compiled"]


GOLDEN = Path(__file__).parent / "golden" / "qkv_projections.diff"


def test_golden_graph_diff_of_biased_q_k_v_projections(pass_diffs):
    """q, k, v with biases over one x, static M: one FP8 linear over the stacked weights and
    biases, sliced back into three. Regenerate with FP8COMPILE_UPDATE_GOLDEN=1 after an intended
    change, and read the diff. Listed right after our passes: Inductor rewrites the graph in place
    afterwards, or not (a hit in its FX graph cache), so the captured module is no golden."""
    with torch.no_grad():
        torch.compile(GroupedQuery(True).to(BF16), backend="fp8", dynamic=False)(randn(2, 9, 256))
    (diff,) = pass_diffs
    assert diff == golden_text(GOLDEN, diff)
