"""The gate_up fusion: gate(x) and up(x) of a gated MLP, two linears over one x, run as one FP8
GEMM over the two weights stacked along N; the silu_mul op reads its two halves."""

import pytest
import torch
from torch import nn

import fp8compile
from fp8compile import calc_diff
from fp8compile import weights
from tests.conftest import BF16, GATED_MLP, randn
from tests.models import FusedGateUpMLP, GatedMLP

LINEAR = torch.ops.fp8compile.qlinear.default
FUSED = torch.ops.fp8compile.gated_qlinear.default


def stacked_rows(qlinear: torch.fx.Node) -> int:
    """N of the FP8 weight a qlinear node reads (a graph input): the rows of every weight stacked in it."""
    return qlinear.args[1].meta["val"].shape[0]


def compile_and_run(model, x, **options):
    torch._dynamo.mark_dynamic(x, 1)
    fp8 = fp8compile.backend(**options)
    with torch.no_grad():
        return torch.compile(model, backend=fp8)(x), fp8.report


def test_gate_and_up_over_one_x_become_one_gemm_and_give_the_same_numbers(captured):
    model, x = GatedMLP().to(BF16), randn(2, 37, 256)
    merged, report = compile_and_run(model, x.clone())
    (g,) = captured
    (gemm,) = g.ops(LINEAR)
    assert stacked_rows(gemm) == 2 * model.gate_proj.out_features and len(g.ops(FUSED)) == 1
    assert {(r.name, r.detail) for r in report.rewrites if r.kind == "linear"} == {
        ("gate_proj", "one GEMM with up_proj"),
        ("up_proj", "one GEMM with gate_proj"),
    }
    # still two linears, as the model has
    assert report.counts() == {"linear": 2, "silu_mul": 1, "moe": 0, "attention": 0, "mqa_logits": 0}
    torch._dynamo.reset()
    separate, _ = compile_and_run(model, x.clone(), fusions=("silu_mul",))
    # Same activation quantization, same weight blocks: the reference kernel gives the same bits.
    assert torch.equal(merged, separate)
    with torch.no_grad():
        assert calc_diff(merged, model(x)) < GATED_MLP


def test_without_the_fusion_gate_and_up_stay_two_gemms(captured):
    compile_and_run(GatedMLP().to(BF16), randn(2, 9, 256), fusions=("silu_mul",))
    gemms = captured[0].ops(LINEAR)
    assert len(gemms) == 2 and all(stacked_rows(n) == 512 for n in gemms)


def test_a_fused_gate_up_linear_is_one_gemm_already_and_is_left_as_it_is(captured):
    _, report = compile_and_run(FusedGateUpMLP("chunk").to(BF16), randn(2, 9, 256))
    (gemm,) = captured[0].ops(LINEAR)
    assert stacked_rows(gemm) == 1024  # the fused gate_up weight, as it is
    assert [r.detail for r in report.rewrites if r.kind == "linear"] == [""]


def gated(bias: bool, down_in: int = 512) -> nn.Module:
    model = nn.Module()
    model.gate, model.up = nn.Linear(256, 512, bias=bias), nn.Linear(256, 512, bias=bias)
    model.down = nn.Linear(down_in, 256, bias=False)
    model.forward = lambda x: model.down(torch.nn.functional.silu(model.gate(x)) * model.up(x))
    return model.to(BF16)


@pytest.mark.parametrize(
    "options, bias, why",
    [
        (dict(skip=["up"]), False, "a linear that stays bf16 would move into FP8"),
        ({}, "gate", "one bias to add, on half of the stacked output"),
    ],
    ids=["up_skipped", "one_bias"],
)
def test_pairs_that_cannot_share_a_gemm_stay_two(options, bias, why, captured):
    model = gated(bias=bool(bias))
    if bias == "gate":
        model.up = nn.Linear(256, 512, bias=False).to(BF16)
    out, report = compile_and_run(model, randn(2, 9, 256), fusions=("gate_up", "silu_mul"), **options)
    assert all(stacked_rows(n) == 512 for n in captured[0].ops(LINEAR)), why
    assert not any(r.detail.startswith("one GEMM") for r in report.rewrites)
    if options:
        assert [s.name for s in report.skipped("linear")] == ["up"]


def test_gate_and_up_with_biases_share_a_gemm_and_their_stacked_biases(captured):
    model, x = gated(bias=True), randn(2, 9, 256)
    merged, report = compile_and_run(model, x.clone())
    (gemm,) = captured[0].ops(LINEAR)
    assert stacked_rows(gemm) == 1024 and gemm.args[3].name.endswith("bias_stacked")
    torch._dynamo.reset()
    separate, _ = compile_and_run(model, x.clone(), fusions=("silu_mul",))
    assert torch.equal(merged, separate)


def test_the_stacked_weight_follows_an_in_place_change_of_either_weight():
    """The FP8 copy of gate|up is keyed by both parameters: changing up alone re-quantizes it."""
    model = GatedMLP().to(BF16)
    compiled = torch.compile(model, backend="fp8")
    x = randn(8, 256)
    with torch.no_grad():
        before = compiled(x)
        model.up_proj.weight.mul_(-2)
        after = compiled(x)
        assert calc_diff(after, model(x)) < GATED_MLP
    assert calc_diff(after, -2 * before) < 1e-2  # up scaled by -2 scales silu(gate) * up by -2


def test_stacking_needs_whole_weight_blocks():
    w, w_up = randn(200, 256), randn(200, 256)
    with pytest.raises(ValueError, match="whole 128-row blocks, weight 0 has N=200"):
        weights.fp8_weight(w, w_next=[w_up])


def test_a_pair_without_an_m_dispatch_is_reported_once_per_linear(monkeypatch, probe_backend):
    from fp8compile.passes import dispatch

    def unbindable(ctx, operands):
        raise dispatch.NoDispatch(
            "dynamic sizes ['u0'] are not graph inputs (data-dependent?), so no torch.cond"
        )

    monkeypatch.setattr(dispatch, "_symbol_operands", unbindable)
    # "probe" has a linear kernel only: the linears need a cond (and cannot get one), the fused
    # down projection has one kernel for every M and needs none
    _, report = compile_and_run(GatedMLP().to(BF16), randn(2, 40, 256), backends=["probe", "reference"])
    assert [(r.kind, r.name) for r in report.rewrites] == [("silu_mul", "down_proj")]
    assert sorted(s.name for s in report.skipped("linear")) == ["gate_proj", "up_proj"]  # once each


def test_the_stacked_weight_is_made_while_compiling_and_the_model_is_untouched(weight_quantizations):
    calls = weight_quantizations
    model = GatedMLP().to(BF16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    compiled = torch.compile(model, backend="fp8")
    with torch.no_grad():
        for m in (5, 40):
            x = randn(2, m, 256)
            torch._dynamo.mark_dynamic(x, 1)
            compiled(x)
    # gate|up stacked (2 x 512 rows) and down, once each, before the graph ran; one graph for both calls
    assert sorted(calls[:2]) == [(256, 512), (1024, 256)] and calls[2:] == ["compiled"]
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
