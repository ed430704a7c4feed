"""The FP8 ops: their pure-PyTorch definitions, the registered torch.library ops, opcheck."""

import math

import pytest
import torch

from fp8compile import calc_diff
from fp8compile.numerics import AMAX_EPS, FP8_MAX, is_power_of_two, round_scale_e8m0
from fp8compile.ops.linear import reference as linear_reference
from fp8compile.ops.quant import reference as quant_reference
from tests.conftest import op_body_runs, randn

fp8 = torch.ops.fp8compile


@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize("e8m0", [False, True])
def test_activation_quant_scales_each_token_group_of_128(m, e8m0):
    x = randn(m, 384, scale=3.0)
    x_fp8, scale = fp8.quant_act(x, e8m0)
    assert x_fp8.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert x_fp8.shape == (m, 384) and scale.shape == (m, 3)
    amax = x.float().reshape(m, 3, 128).abs().amax(-1)
    if e8m0:
        assert is_power_of_two(scale)
        assert (scale >= amax / FP8_MAX).all() and (scale < 2 * amax / FP8_MAX).all()
    else:
        torch.testing.assert_close(scale, amax / FP8_MAX, rtol=0, atol=0)
        # the largest element of each group lands exactly on the top of the FP8 range
        assert (x_fp8.float().reshape(m, 3, 128).abs().amax(-1) == FP8_MAX).all()
    assert calc_diff(quant_reference.dequant_act_block(x_fp8, scale), x) < 1e-3


def test_an_op_body_is_seen_by_the_run_counter_that_the_cuda_graph_tests_use():
    # tests/test_gpu_compiled.py counts op bodies to show that replays of a CUDA graph run none:
    # that count must see an op's body when one runs, or its check could not fail.
    with op_body_runs() as runs:
        x_fp8, x_scale = fp8.quant_act(randn(2, 128))
        fp8.gemm(x_fp8, x_scale, *quant_reference.quant_weight_block(randn(256, 128)))
    assert [op for op, _ in runs] == ["quant_act", "gemm"], runs


def test_all_zero_group_quantizes_to_zeros_with_a_finite_scale():
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    x[1, 128:] = 1.0
    x_fp8, scale = fp8.quant_act(x)
    assert torch.equal(scale[0], torch.full((2,), AMAX_EPS / FP8_MAX))
    assert (x_fp8[0].float() == 0).all() and torch.isfinite(scale).all()


def test_activation_quant_of_zero_rows():
    x_fp8, scale = fp8.quant_act(torch.empty(0, 256, dtype=torch.bfloat16))
    assert x_fp8.shape == (0, 256) and scale.shape == (0, 2)


@pytest.mark.parametrize("n", [128, 200, 384])
def test_weight_quant_uses_128x128_blocks_and_pads_a_partial_last_block(n):
    w = randn(n, 256, scale=0.02)
    w_fp8, scale = fp8.quant_weight(w)
    assert w_fp8.shape == (n, 256) and scale.shape == ((n + 127) // 128, 2)
    for i in range(scale.shape[0]):
        for j in range(2):
            block = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float()
            assert scale[i, j] == block.abs().amax() / FP8_MAX
    assert calc_diff(quant_reference.dequant_weight_block(w_fp8, scale), w) < 1e-3


def test_e8m0_rounding_is_exact_and_upward():
    s = torch.tensor([0.25, 0.26, 1.0, 1.5, 3.0e-5, 448.0 / 1024])
    assert torch.equal(round_scale_e8m0(s), torch.tensor([0.25, 0.5, 1.0, 2.0, 2.0**-15, 0.5]))


def test_gemm_is_the_block_scaled_product_of_the_dequantized_operands():
    x_fp8, x_scale = fp8.quant_act(randn(9, 256))
    w_fp8, w_scale = fp8.quant_weight(randn(384, 256, scale=0.02))
    bias = randn(384)
    out = fp8.gemm(x_fp8, x_scale, w_fp8, w_scale, bias)
    expected = (
        quant_reference.dequant_act_block(x_fp8, x_scale).double()
        @ quant_reference.dequant_weight_block(w_fp8, w_scale).double().T
        + bias.double()
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected.to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("m, n, k", [(1, 128, 128), (7, 256, 384), (33, 384, 256)])
def test_linear_matches_the_fp32_product_of_unquantized_inputs(m, n, k):
    # One block-FP8 GEMM on unit-normal data lands at calc_diff ~7e-4 against fp32 (DeepGEMM's
    # measurement, ../shared/design.md); 1e-3 leaves room for sampling noise at small sizes only.
    x, w = randn(m, k), randn(n, k, scale=0.02)
    assert calc_diff(fp8.linear(x, w), x.float() @ w.float().T) < 1e-3


def test_linear_with_a_k_by_n_weight_is_the_same_linear():
    x, w = randn(9, 256), randn(384, 256)
    w_kn = w.t().contiguous()
    assert torch.equal(fp8.linear(x, w_kn, w_kn=True), fp8.linear(x, w))


def test_linear_rows_do_not_depend_on_the_batch():
    x, w = randn(300, 256), randn(256, 256, scale=0.02)
    full = fp8.linear(x, w)
    for i in (0, 17, 299):
        assert torch.equal(full[i], fp8.linear(x[i : i + 1], w)[0])


def test_linear_accepts_3d_activations():
    x, w = randn(2, 5, 256), randn(128, 256)
    out = fp8.linear(x, w)
    assert out.shape == (2, 5, 128)
    assert torch.equal(out.reshape(10, 128), fp8.linear(x.reshape(10, 256), w))


def test_linear_quantizes_each_weight_once_and_again_only_after_it_changes(monkeypatch):
    from fp8compile import weights

    calls = []
    real = weights._quantize
    monkeypatch.setattr(weights, "_quantize", lambda w, e8m0: calls.append(1) or real(w, e8m0))
    x, w = randn(4, 256), torch.nn.Parameter(randn(128, 256), requires_grad=False)
    first = fp8.linear(x, w)
    fp8.linear(x, w)
    assert len(calls) == 1
    with torch.no_grad():
        w.mul_(-1)  # in place: the version counter moves, the FP8 copy is made again
    assert torch.equal(fp8.linear(x, w), -first) and len(calls) == 2


def test_mismatched_k_is_a_clear_error():
    with pytest.raises(RuntimeError, match="x has K=384 but the weight has K=256"):
        with torch._subclasses.FakeTensorMode():
            fp8.linear(torch.empty(4, 384, dtype=torch.bfloat16), torch.empty(128, 256, dtype=torch.bfloat16))


def test_k_not_multiple_of_128_is_a_clear_error():
    with pytest.raises(ValueError, match="K=200 is not a multiple of 128"):
        fp8.quant_act(randn(2, 200))


def test_a_weight_with_a_k_of_part_of_a_group_gets_zero_columns_up_to_whole_groups():
    """The FP8 copy of a (N, 200) weight is (N, 256): its last group is the 72 real columns,
    scaled by their own amax, then zeros; a linear on it pads its activation alike."""
    w = randn(256, 200, scale=0.05)
    w_fp8, w_scale = fp8.quant_weight(w)
    assert w_fp8.shape == (256, 256) and w_scale.shape == (2, 2)
    assert not w_fp8[:, 200:].float().any()
    amax = w[:128, 128:].float().abs().amax()
    assert torch.equal(w_scale[0, 1], amax / FP8_MAX)
    x = randn(5, 200)
    out = fp8.linear(x, w)  # the bf16-weight op pads x to the copy's K
    assert torch.equal(
        out, linear_reference.linear_block(torch.nn.functional.pad(x, (0, 56)), w_fp8, w_scale)
    )
    assert calc_diff(out, x @ w.t()) < 1e-3


def test_calc_diff_is_zero_for_equal_and_two_for_opposite_tensors():
    x = torch.randn(100)
    assert calc_diff(x, x) == 0.0
    assert calc_diff(x, -x) == pytest.approx(2.0)
    assert 0 < calc_diff(x, 2 * x) < 1  # unlike cosine similarity, sees a scale error
    assert calc_diff(torch.zeros(3), torch.zeros(3)) == 0.0
    assert math.isnan(calc_diff(x, torch.full_like(x, float("nan"))))
    with pytest.raises(ValueError, match="equal shapes"):
        calc_diff(x, x[:3])


def _op_samples():
    x = randn(5, 256)
    w_fp8, w_scale = fp8.quant_weight(randn(256, 256, scale=0.02))
    x_fp8, x_scale = fp8.quant_act(x)
    bias = randn(256)
    return [
        (fp8.quant_act.default, (x, False)),
        (fp8.quant_act.default, (x, True)),
        (fp8.quant_weight.default, (randn(200, 256), False)),
        (fp8.gemm.default, (x_fp8, x_scale, w_fp8, w_scale, None)),
        (fp8.gemm.default, (x_fp8, x_scale, w_fp8, w_scale, bias)),
        (fp8.linear.default, (x, randn(256, 256), bias, False)),
        (fp8.linear.default, (randn(2, 3, 256), randn(256, 384), None, True, "reference", True)),
        (
            fp8.linear.default,
            (x, randn(256, 256), None, False, "reference", False, [randn(128, 256)]),
        ),  # w_next
        # q, k, v with biases, the last weight's N not a whole block
        (
            fp8.linear.default,
            (
                x,
                randn(256, 256),
                randn(256),
                False,
                "reference",
                False,
                [randn(128, 256), randn(100, 256)],
                [randn(128), randn(100)],
            ),
        ),
    ]


@pytest.mark.parametrize("i", range(9))
def test_opcheck(i):
    op, args = _op_samples()[i]
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in args):
        # SchemaCheckMode compares inputs with allclose, which has no CPU float8 kernel;
        # test_ops_do_not_mutate_their_inputs checks the same property bitwise instead.
        utils = utils[1:]
    torch.library.opcheck(op, args, test_utils=utils)


@pytest.mark.parametrize("i", range(9))
def test_ops_do_not_mutate_their_inputs(i):
    op, args = _op_samples()[i]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    before = [t.view(torch.uint8).clone() for t in tensors]
    outputs = op(*args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    for t, b in zip(tensors, before):
        assert torch.equal(t.view(torch.uint8), b)
        assert all(o.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for o in outputs)
