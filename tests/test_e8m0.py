"""e8m0=True: every scale the compiled model uses is an exact power of two."""

import pytest
import torch

import fp8compile
from fp8compile import calc_diff
from fp8compile.numerics import is_power_of_two
from fp8compile.ops.quant import reference as quant_reference
from tests.conftest import BF16, GATED_MLP, randn
from tests.models import GatedMLP


@pytest.fixture
def weight_scales(monkeypatch):
    from fp8compile import weights

    scales = []
    real = weights._quantize

    def recording(w, e8m0):
        w_fp8, scale = real(w, e8m0)
        scales.append(scale)
        return w_fp8, scale

    monkeypatch.setattr(weights, "_quantize", recording)
    return scales


@pytest.fixture
def activation_scales(monkeypatch):
    scales = []
    real = quant_reference.quant_act_block

    def recording(x, e8m0=False):
        x_fp8, scale = real(x, e8m0)
        scales.append(scale)
        return x_fp8, scale

    monkeypatch.setattr(quant_reference, "quant_act_block", recording)
    return scales


def test_e8m0_weight_and_activation_scales_are_powers_of_two(activation_scales, weight_scales):
    model = GatedMLP().to(BF16)
    x = randn(37, 256, scale=5.0)
    with torch.no_grad():
        out = torch.compile(model, backend=fp8compile.backend(e8m0=True))(x)
        eager = model(x)
    assert len(weight_scales) == 2 and all(is_power_of_two(s) for s in weight_scales)  # gate|up stacked, down
    assert len(activation_scales) == 2 and all(is_power_of_two(s) for s in activation_scales)
    assert calc_diff(out, eager) < GATED_MLP


def test_without_e8m0_scales_are_not_rounded(activation_scales):
    with torch.no_grad():
        torch.compile(torch.nn.Linear(256, 256).to(BF16), backend="fp8")(randn(16, 256))
    assert not is_power_of_two(activation_scales[0])


@pytest.mark.parametrize("m", [1, 33])
def test_e8m0_linear_is_within_one_fp8_gemm_of_eager(m):
    # Rounding a scale up to a power of two costs at most one bit of range and no mantissa for
    # normal values: measured calc_diff stays ~7e-4 like the unrounded recipe.
    model = torch.nn.Linear(512, 256).to(BF16)
    x = randn(m, 512)
    with torch.no_grad():
        out = torch.compile(model, backend=fp8compile.backend(e8m0=True))(x)
        assert calc_diff(out, model(x)) < 1e-3
