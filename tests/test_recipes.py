"""The rowwise and tensor recipes (W8A8 beside "block"): their numerics (reference_scaled), the
op and its kernels, the linear pass under recipe=, static activation scales from calibrate(),
and what stays bf16 in them and why."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import fp8compile
from fp8compile.numerics import FP8_MAX, calc_diff, is_power_of_two
from fp8compile.ops.linear import reference_scaled as rs
from fp8compile.ops.activations import GATED_ACTIVATIONS, gated
from fp8compile.ops.linear.scaled_cublas import linear_scaled_cublas
from tests.conftest import BF16, DEVICE, GATED_MLP, ONE_GEMM, RANGES, CountingBackend, gpu, randn
from tests.models import Attention, GatedMLP
from tests.test_triton_kernels import assert_bf16_close, to_bf16_as_the_device_does

SCALED = torch.ops.fp8compile.qlinear_scaled.default
GATED_SCALED = torch.ops.fp8compile.gated_qlinear_scaled.default
BLOCK_LINEAR = torch.ops.fp8compile.qlinear.default
BLOCK_GATED = torch.ops.fp8compile.gated_qlinear.default
RECIPES = ("rowwise", "tensor")


def exact_rows(m: int, k: int, spread: int = 4) -> torch.Tensor:
    """bf16 rows whose per-token quantization rounds nothing: FP8 values times a power of two per
    row, one element of each row at +-448 times it (so its scale is that power of two). Triton's
    CPU interpreter converts float -> e4m3 wrongly where rounding carries into 128."""
    values = torch.randn(m, k).to(torch.float8_e4m3fn).float()
    values[:, 0] = 448.0 * torch.sign(torch.randn(m))
    exponent = torch.randint(-spread, spread, (m, 1)).float()
    return (values * torch.exp2(exponent)).to(BF16)


# --- numerics -------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
def test_weights_get_one_scale_per_output_channel_or_one_in_all(recipe):
    w = randn(384, 272, scale=0.02)
    w[5] *= 40  # an outlier channel
    w_fp8, scale = rs.quant_weight_scaled(w, recipe)
    assert w_fp8.dtype == torch.float8_e4m3fn and w_fp8.shape == w.shape
    assert scale.shape == ((384,) if recipe == "rowwise" else ())
    rows = w.float().abs().amax(dim=1)
    expected = rows / FP8_MAX if recipe == "rowwise" else rows.max() / FP8_MAX
    torch.testing.assert_close(scale, expected)
    # Each row's largest value lands on 448 exactly where the row owns its scale.
    if recipe == "rowwise":
        assert (w_fp8.float().abs().amax(dim=1) == FP8_MAX).all()
    err = (rs.dequant_weight_scaled(w_fp8, scale) - w.float()).abs()
    assert (err <= rows[:, None] / 16 if recipe == "rowwise" else err <= rows.max() / 16).all()


@pytest.mark.parametrize("recipe", RECIPES)
def test_one_scaled_gemm_is_within_one_fp8_gemms_error_of_the_fp32_product(recipe):
    # Measured 6.97e-4..7.06e-4 (rowwise) and 6.97e-4..7.05e-4 (tensor) over seeds 0-4 at
    # 64 x 4096 x 4096: the same e4m3 rounding as the block recipe's one GEMM (ONE_GEMM).
    x, w = randn(64, 1024), randn(512, 1024, scale=0.02)
    w_fp8, w_scale = rs.quant_weight_scaled(w, recipe)
    out = rs.linear_scaled(x, w_fp8, w_scale, recipe=recipe)
    assert out.dtype == BF16 and out.shape == (64, 512)
    assert calc_diff(out.float(), x.float() @ w.float().T) < ONE_GEMM


def test_rowwise_scales_each_token_alone_so_a_loud_token_costs_the_others_nothing():
    # e4m3's exponent range absorbs a 1000x louder token (measured: tensor 6.5e-4 on the others);
    # at 1e5 x the others fall into subnormals: 8.5e-2 per tensor, 6.7e-4 per token.
    x, w = randn(8, 512), randn(256, 512, scale=0.02)
    x[0] *= 1e5
    exact = x.float() @ w.float().T
    errs = {}
    for recipe in RECIPES:
        w_fp8, w_scale = rs.quant_weight_scaled(w, recipe)
        out = rs.linear_scaled(x, w_fp8, w_scale, recipe=recipe).float()
        errs[recipe] = calc_diff(out[1:], exact[1:])
    assert errs["rowwise"] < ONE_GEMM and errs["tensor"] > 50 * ONE_GEMM


def test_a_static_scale_saturates_what_lies_past_it_and_amax_ub_caps_a_dynamic_one():
    x = torch.tensor([[1.0, -2.0, 8.0, 0.5]], dtype=BF16)
    static = torch.tensor(2.0 / FP8_MAX)  # calibrated for |x| <= 2
    x_fp8, scale = rs.quant_act_scaled(x, "tensor", static_scale=static)
    assert scale == static
    assert x_fp8.float().tolist() == [[224.0, -448.0, 448.0, 112.0]]  # 8.0 saturates at 448
    capped, cap_scale = rs.quant_act_scaled(x, "rowwise", amax_ub=4.0)
    torch.testing.assert_close(cap_scale, torch.tensor([4.0 / FP8_MAX]))
    assert capped.float()[0, 2] == FP8_MAX


@pytest.mark.parametrize("recipe", RECIPES)
def test_e8m0_makes_every_scale_of_both_recipes_a_power_of_two(recipe):
    w_fp8, w_scale = rs.quant_weight_scaled(randn(256, 256, scale=0.02), recipe, e8m0=True)
    _, x_scale = rs.quant_act_scaled(randn(5, 256), recipe, e8m0=True)
    assert is_power_of_two(w_scale) and is_power_of_two(x_scale)


def test_fused_shards_are_requantized_to_their_largest_scale_and_one_rounding_from_bf16_does_better():
    # A fused qkv whose shards arrive quantized per tensor with their own scales: k's weights are
    # 8x q's. vLLM's requantize_with_max_scale puts both under k's scale.
    torch.manual_seed(0)
    q, k = randn(256, 256, scale=0.02), randn(128, 256, scale=0.16)
    shards = [rs.quant_weight_scaled(w, "tensor") for w in (q, k)]
    per_shard = torch.cat([rs.dequant_weight_scaled(*s) for s in shards])  # what the unfused model uses
    fused, scale = rs.requantize_with_max_scale(shards)
    assert fused.shape == (384, 256) and scale == shards[1][1]
    requantized = rs.dequant_weight_scaled(fused, scale)
    exact = torch.cat([q, k]).float()
    # Measured over seeds 0-4: the requantized weight moves calc_diff 3.9e-6..1.6e-5 from the
    # per-shard one; q, rounded a second time (and partly into e4m3's subnormals, 3 binades
    # lower), ends 1.35-2.82x as far from its bf16 values; k, whose scale it keeps, not at all.
    shift = calc_diff(requantized, per_shard)
    assert 1e-6 < shift < 5e-5
    q_err = calc_diff(requantized[:256], q.float()) / calc_diff(per_shard[:256], q.float())
    assert q_err > 1.2 and torch.equal(requantized[256:], per_shard[256:])
    # From bf16 the merge quantizes the stacked weight once with the same (largest) scale: one
    # rounding, no worse than requantizing the rounded shards.
    w_fp8, w_scale = fp8compile.weights.fp8_weight_scaled(q, "tensor", w_next=[k])
    assert w_scale == scale
    assert calc_diff(rs.dequant_weight_scaled(w_fp8, w_scale), exact) <= calc_diff(requantized, exact)


def test_e4m3fnuz_conversion_keeps_every_dequantized_value():
    w_fp8, scale = rs.quant_weight_scaled(randn(128, 256, scale=0.02), "rowwise")
    w_fp8.view(torch.int8)[0, :4] = -128  # e4m3fn's negative zero, NaN in e4m3fnuz
    fnuz, fnuz_scale = rs.e4m3fn_to_e4m3fnuz(w_fp8, scale)
    assert fnuz.dtype == torch.float8_e4m3fnuz
    torch.testing.assert_close(fnuz_scale, scale * 2)
    assert torch.equal(rs.dequant_weight_scaled(fnuz, fnuz_scale), rs.dequant_weight_scaled(w_fp8, scale))
    assert not fnuz.float().isnan().any()


# --- the op and its kernels -------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("static", [False, True])
def test_qlinear_scaled_passes_opcheck(recipe, static):
    x, w = randn(5, 256), randn(384, 256, scale=0.02)
    w_fp8, w_scale = rs.quant_weight_scaled(w, recipe)
    x_scale = torch.tensor(4.0 / FP8_MAX) if static else None
    args = (x, w_fp8, w_scale, randn(384), x_scale, recipe)
    # SchemaCheckMode compares inputs with allclose, which has no CPU float8 kernel: the
    # inputs' bytes are compared here instead.
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    before = [a.reshape(-1).view(torch.uint8).clone() for a in args if isinstance(a, torch.Tensor)]
    torch.library.opcheck(torch.ops.fp8compile.qlinear_scaled, args, test_utils=utils)
    torch.ops.fp8compile.qlinear_scaled(*args)
    after = [a.reshape(-1).view(torch.uint8) for a in args if isinstance(a, torch.Tensor)]
    assert all(torch.equal(b, a) for b, a in zip(before, after))


def test_qlinear_scaled_refuses_a_scale_of_the_other_recipe():
    w_fp8, w_scale = rs.quant_weight_scaled(randn(384, 256, scale=0.02), "tensor")
    with pytest.raises(RuntimeError, match=r"does not match recipe 'rowwise' for N=384"):
        torch.ops.fp8compile.qlinear_scaled(randn(2, 256), w_fp8, w_scale, recipe="rowwise")


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("static", [False, True])
def test_the_cublas_kernel_gives_the_references_numbers(recipe, static):
    # torch._scaled_mm runs on the CPU too (rowwise scales from torch 2.13 on): same quantization,
    # an fp32 product.
    x, w, bias = (
        randn(7, 272, device=DEVICE),
        randn(96, 272, scale=0.02, device=DEVICE),
        randn(96, device=DEVICE),
    )
    w_fp8, w_scale = rs.quant_weight_scaled(w, recipe)
    x_scale = torch.tensor(3.0 / FP8_MAX, device=DEVICE) if static else None
    ref = rs.linear_scaled(x, w_fp8, w_scale, bias, recipe, x_scale)
    out = linear_scaled_cublas(x, w_fp8, w_scale, bias, recipe, x_scale)
    assert calc_diff(out.float(), ref.float()) < 1e-5


def test_static_scales_leave_no_amax_reduction_in_the_traced_cublas_side():
    """What Inductor compiles in default mode (passes/inline.py traces this function)."""
    w_fp8, w_scale = rs.quant_weight_scaled(randn(96, 256, scale=0.02), "rowwise")

    def reductions(x_scale):
        # fake tensors: traced, not run (torch 2.11's CPU _scaled_mm has no rowwise scales)
        trace = make_fx(
            lambda x, w, ws, s: linear_scaled_cublas(x, w, ws, None, "rowwise", s), tracing_mode="fake"
        )
        gm = trace(randn(4, 256), w_fp8, w_scale, x_scale)
        return [n.target for n in gm.graph.nodes if "amax" in str(n.target) or "max" in str(n.target)]

    assert reductions(None) == [torch.ops.aten.amax.default]
    assert reductions(torch.tensor(0.01)) == []


@pytest.mark.parametrize("fast_accum", [False, True])
def test_fast_accum_is_the_traced_cublas_sides_scaled_mm_mode(fast_accum):
    """What Inductor compiles in default mode: torch._scaled_mm with use_fast_accum as asked, and
    on the CPU, whose _scaled_mm sums in fp32 either way, the reference's numbers."""
    w_fp8, w_scale = rs.quant_weight_scaled(randn(96, 256, scale=0.02), "rowwise")
    x = randn(8, 256)

    def cublas(x, w, ws):
        return linear_scaled_cublas(x, w, ws, None, "rowwise", None, 0.0, False, fast_accum)

    gm = make_fx(cublas, tracing_mode="fake")(x, w_fp8, w_scale)
    (mm,) = [n for n in gm.graph.nodes if n.target == torch.ops.aten._scaled_mm.default]
    bound = mm.normalized_arguments(gm, normalize_to_only_use_kwargs=True).kwargs
    assert bound.get("use_fast_accum", False) is fast_accum
    ref = rs.linear_scaled(x, w_fp8, w_scale, None, "rowwise")
    assert calc_diff(cublas(x, w_fp8, w_scale).float(), ref.float()) < 1e-5


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("m", [1, 3, 20])
def test_the_triton_decode_kernel_matches_the_reference(recipe, m):
    # K = 272: not a multiple of the kernel's 128-wide steps; N = 80: a partial tile (64 rows under
    # the interpreter, 128 on a GPU); split-K 2 under the interpreter (triton_gemm.small_m_split).
    # Exact inputs: see exact_rows. On the CPU Triton's interpreter, on a GPU the kernel.
    pytest.importorskip("triton")
    from fp8compile.ops.linear.triton_scaled import linear_scaled_small_m

    x, w, bias = (
        exact_rows(m, 272).to(DEVICE),
        randn(80, 272, scale=0.02, device=DEVICE),
        randn(80, device=DEVICE),
    )
    w_fp8, w_scale = rs.quant_weight_scaled(w, recipe)
    for b in (None, bias):
        out = linear_scaled_small_m(x, w_fp8, w_scale, b, recipe)
        assert_kernel_close(out, device_reference(x, w_fp8, w_scale, b, recipe))


def test_the_triton_decode_kernel_takes_static_scales_caps_and_strided_rows():
    pytest.importorskip("triton")
    from fp8compile.ops.linear.triton_scaled import linear_scaled_decode, linear_scaled_small_m

    both = exact_rows(6, 512).to(DEVICE)
    x = both[:, :256]  # row stride 512: one half of a merged output
    w_fp8, w_scale = rs.quant_weight_scaled(randn(64, 256, scale=0.02, device=DEVICE), "rowwise")
    static = torch.tensor(2.0**6, device=DEVICE)  # a power of two above every row's amax / 448: exact
    for kwargs in (dict(x_scale=static), dict(amax_ub=float(2**5 * 448)), dict(e8m0=True)):
        out = linear_scaled_small_m(x, w_fp8, w_scale, recipe="rowwise", **kwargs)
        assert_kernel_close(out, device_reference(x, w_fp8, w_scale, None, "rowwise", **kwargs))
        traced_op = linear_scaled_decode(x, w_fp8, w_scale, recipe="rowwise", max_m=16, **kwargs)
        assert torch.equal(traced_op, out)


# The decode kernel keeps all of K in the tensor cores' FP8 accumulator (one scale spans K, so
# there is no per-128 promotion to fp32 as in the block kernel): on an H100 it lands at calc_diff
# 1.0e-6..4.1e-6 from the exact sum on exact inputs (test_the_triton_decode_kernel_matches_the_
# reference), above assert_bf16_close's 1e-6, 170x below one FP8 GEMM's quantization error.
SCALED_KERNEL_BOUND = 1e-5


def assert_kernel_close(out, ref):
    if DEVICE == "cpu":  # the interpreter sums in fp32
        assert_bf16_close(out, ref)
    else:
        assert out.dtype == ref.dtype and out.shape == ref.shape
        assert calc_diff(out, ref) < SCALED_KERNEL_BOUND


def device_reference(x, w_fp8, w_scale, bias, recipe, x_scale=None, amax_ub=0.0, e8m0=False):
    """The reference in fp64, rounded to bf16 as the kernel's store rounds on this device."""
    x_fp8, sx = rs.quant_act_scaled(x, recipe, e8m0, x_scale, amax_ub)
    return to_bf16_as_the_device_does(rs.gemm_scaled(x_fp8, sx, w_fp8, w_scale, bias, torch.float64))


# --- the gated down projection -------------------------------------------------------------------


def test_the_fused_down_projection_quantizes_the_fp32_product_no_worse_than_the_bf16_one():
    # Measured over seeds 0-2 at 64 x 2048 -> 512 against the fp64 product of act(a, b) and the
    # bf16 weight: fused 6.83e-4..7.06e-4, the plain linear on the bf16 product 6.84e-4..7.07e-4
    # (both one FP8 GEMM's error; the bf16 rounding of the product adds a little).
    torch.manual_seed(0)
    a, b, w = randn(64, 2048, scale=2.0), randn(64, 2048), randn(512, 2048, scale=0.02)
    h = gated(a, b)
    exact = h.double() @ w.double().T
    for recipe in RECIPES:
        w_fp8, w_scale = rs.quant_weight_scaled(w, recipe)
        fused = rs.gated_linear_scaled(a, b, w_fp8, w_scale, recipe=recipe)
        unfused = rs.linear_scaled(h.to(BF16), w_fp8, w_scale, recipe=recipe)
        assert fused.dtype == BF16 and fused.shape == (64, 512)
        assert calc_diff(fused.double(), exact) <= calc_diff(unfused.double(), exact) < ONE_GEMM


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("static", [False, True])
def test_gated_qlinear_scaled_passes_opcheck(recipe, static):
    a, b, w = randn(5, 256), randn(5, 256), randn(384, 256, scale=0.02)
    w_fp8, w_scale = rs.quant_weight_scaled(w, recipe)
    x_scale = torch.tensor(4.0 / FP8_MAX) if static else None
    args = (a, b, w_fp8, w_scale, randn(384), x_scale, recipe)
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.fp8compile.gated_qlinear_scaled, args, test_utils=utils)
    out = torch.ops.fp8compile.gated_qlinear_scaled(*args, activation="swigluoai")
    ref = rs.gated_linear_scaled(*args[:5], recipe=recipe, x_scale=x_scale, activation="swigluoai")
    assert torch.equal(out, ref)
    with pytest.raises(RuntimeError, match="act\\(a, b\\) needs equal shapes"):
        torch.ops.fp8compile.gated_qlinear_scaled(a, b[:, :128], w_fp8, w_scale, recipe=recipe)


def exact_products(m: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) whose act(a, b) = silu(32) * b = 32 * b (sigmoid(32) is 1.0 in fp32) is exact_rows:
    its per-token quantization rounds nothing (Triton's interpreter converts to e4m3 wrongly
    where rounding carries)."""
    return torch.full((m, k), 32.0, dtype=BF16), exact_rows(m, k) / 32


def dequantized(x_fp8, scale):
    return x_fp8.float() * (scale.reshape(-1, 1) if scale.dim() else scale)


@pytest.mark.parametrize("one_pass", [True, False])
@pytest.mark.parametrize("activation", GATED_ACTIVATIONS)
def test_the_gated_quantization_kernel_equals_quantizing_the_fp32_product(one_pass, activation, monkeypatch):
    """triton_quant_rows's kernel: each token's scale from its amax (capped, E8M0) or one given
    scale, in one pass over a register-held row or two over chunks; interleaved gate/up halves
    read in place. Against the same kernel on the fp32 product (the device's float -> e4m3 on
    both sides, the interpreter's included) and the reference's scales."""
    pytest.importorskip("triton")
    from fp8compile.ops.quant import triton_quant_rows

    if not one_pass:  # 128-wide steps over K = 272: a partial last chunk
        monkeypatch.setattr(triton_quant_rows, "ONE_PASS_MAX", 128)
        monkeypatch.setattr(triton_quant_rows, "CHUNK", 128)
    gate_up = randn(5, 544, scale=4.0, device=DEVICE)  # the clamps at +-7 engage
    a, b = gate_up[:, ::2], gate_up[:, 1::2]
    h = gated(a, b, activation)
    static = torch.tensor(0.05, device=DEVICE)  # |h| past 448 * 0.05 saturates
    for given, amax_ub, e8m0 in (
        (None, 0.0, False),
        (None, 6.0, False),
        (None, 0.0, True),
        (static, 0.0, False),
    ):
        q, scale = triton_quant_rows.quant_rows(a, b, given, amax_ub, e8m0, activation, 1.702, 7.0)
        plain = triton_quant_rows.quant_rows(h, None, given, amax_ub, e8m0, activation, 1.702, 7.0)
        _, ref_scale = rs.quant_act_scaled(h, "rowwise", e8m0, given, amax_ub)
        torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
        assert calc_diff(dequantized(q, scale), dequantized(*plain)) < 1e-6


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("static", [False, True])
def test_the_gated_cublas_kernel_gives_the_references_numbers(recipe, static):
    # Our quantization of act(a, b), then torch._scaled_mm (which runs on the CPU too from torch
    # 2.13 on: an fp32 product). The tensor recipe's dynamic scale is a reduction before the launch.
    pytest.importorskip("triton")
    from fp8compile.ops.linear.scaled_gated_mm import gated_linear_scaled_cublas

    a, b = (t.to(DEVICE) for t in exact_products(7, 272))
    w, bias = randn(96, 272, scale=0.02, device=DEVICE), randn(96, device=DEVICE)
    w_fp8, w_scale = rs.quant_weight_scaled(w, recipe)
    x_scale = torch.tensor(2.0**4, device=DEVICE) if static else None  # a power of two: rounds nothing
    ref = rs.gated_linear_scaled(a, b, w_fp8, w_scale, bias, recipe, x_scale)
    out = gated_linear_scaled_cublas(a, b, w_fp8, w_scale, bias, recipe, x_scale)
    assert calc_diff(out.float(), ref.float()) < 1e-5
    three_d = gated_linear_scaled_cublas(a[None], b[None], w_fp8, w_scale, bias, recipe, x_scale)
    assert torch.equal(three_d[0], out)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("m", [1, 20])
@pytest.mark.parametrize("quantize_first", [True, False])
def test_the_triton_decode_kernel_serves_the_gated_product_quantized_first_or_as_it_loads_it(
    recipe, m, quantize_first, monkeypatch
):
    # quantize_first (the default): act(a, b) quantized by the per-token kernel, then the GEMM on
    # FP8 x; else each GEMM program computes act as it loads its tiles.
    pytest.importorskip("triton")
    from fp8compile.ops.linear import triton_scaled
    from fp8compile.ops.linear.triton_scaled import (
        gated_linear_scaled_small_m,
        linear_scaled_decode,
        linear_scaled_small_m,
    )

    monkeypatch.setattr(triton_scaled, "QUANTIZE_GATED_FIRST", quantize_first)
    a, b = (t.to(DEVICE) for t in exact_products(m, 272))
    w_fp8, w_scale = rs.quant_weight_scaled(randn(80, 272, scale=0.02, device=DEVICE), recipe)
    out = gated_linear_scaled_small_m(a, b, w_fp8, w_scale, recipe=recipe)
    assert_kernel_close(out, device_reference(gated(a, b), w_fp8, w_scale, None, recipe))
    traced_op = linear_scaled_decode(a, w_fp8, w_scale, recipe=recipe, max_m=16 if m <= 16 else 64, b=b)
    assert_kernel_close(traced_op, device_reference(gated(a, b), w_fp8, w_scale, None, recipe))
    # A clamped activation over interleaved halves: the same kernel on the fp32 product, to bf16.
    gate_up = randn(m, 544, scale=4.0, device=DEVICE)
    a, b = gate_up[:, ::2], gate_up[:, 1::2]
    fused = gated_linear_scaled_small_m(a, b, w_fp8, w_scale, recipe=recipe, activation="swigluoai")
    plain = linear_scaled_small_m(gated(a, b, "swigluoai"), w_fp8, w_scale, recipe=recipe)  # fp32 out
    assert_kernel_close(fused, to_bf16_as_the_device_does(plain.double()))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("static", [False, True])
def test_the_triton_large_m_kernel_gives_the_references_numbers_plain_and_gated(recipe, static):
    # M = 37 and N = 80: partial tiles; K = 272: a partial last K step (32-wide steps under the
    # interpreter, 128 on a GPU). Against the reference GEMM on the kernel's own quantization
    # (triton_quant_rows, held to the reference above): the interpreter's float -> e4m3 is not
    # torch's where rounding carries, and a static scale rounds.
    pytest.importorskip("triton")
    from fp8compile.ops.quant.triton_quant_rows import quantize
    from fp8compile.ops.linear.triton_scaled_gemm import gated_linear_scaled_large_m, linear_scaled_large_m

    x, a, b = (
        randn(37, 272, device=DEVICE),
        randn(37, 272, scale=2.0, device=DEVICE),
        randn(37, 272, device=DEVICE),
    )
    w_fp8, w_scale = rs.quant_weight_scaled(randn(80, 272, scale=0.02, device=DEVICE), recipe)
    bias = randn(80, device=DEVICE)
    x_scale = torch.tensor(3.0 / FP8_MAX, device=DEVICE) if static else None

    def reference(x, b=None):
        q, sx = quantize(x, b, recipe, x_scale, 0.0, False)
        return to_bf16_as_the_device_does(rs.gemm_scaled(q, sx, w_fp8, w_scale, bias, torch.float64))

    assert_kernel_close(linear_scaled_large_m(x, w_fp8, w_scale, bias, recipe, x_scale), reference(x))
    gated_out = gated_linear_scaled_large_m(a[None], b[None], w_fp8, w_scale, bias, recipe, x_scale)
    assert gated_out.shape == (1, 37, 80)
    assert_kernel_close(gated_out[0], reference(a, b))


def test_the_triton_large_m_kernel_gives_a_row_the_same_bits_in_every_batch():
    """What batch_invariant=True relies on in the rowwise recipe: per-token scales, one program per
    row in the quantization, one tiling and one K order in the GEMM whatever M is."""
    pytest.importorskip("triton")
    from fp8compile.ops.linear.triton_scaled_gemm import gated_linear_scaled_large_m, linear_scaled_large_m

    w_fp8, w_scale = rs.quant_weight_scaled(randn(80, 256, scale=0.02, device=DEVICE), "rowwise")
    x, a, b = (randn(40, 256, device=DEVICE) for _ in range(3))
    for m in (1, 5, 17):
        assert torch.equal(
            linear_scaled_large_m(x[:m], w_fp8, w_scale), linear_scaled_large_m(x, w_fp8, w_scale)[:m]
        )
        assert torch.equal(
            gated_linear_scaled_large_m(a[:m], b[:m], w_fp8, w_scale),
            gated_linear_scaled_large_m(a, b, w_fp8, w_scale)[:m],
        )


@pytest.mark.parametrize("act_amax", [False, True])
def test_batch_invariant_scaled_recipes_run_one_triton_kernel_for_every_m(act_amax):
    """rowwise with dynamic scales, or tensor with static ones: cuBLAS and the split-K decode
    kernel decline (each picks its work split by M), our Triton GEMM serves every M (the
    registry's order as on a GPU, under the interpreter), and a row's output does not depend
    on the rest of the batch."""
    pytest.importorskip("triton")
    model = GatedMLP(256, 512).to(BF16).requires_grad_(False)
    x = randn(40, 256)
    options = dict(recipe="rowwise")
    if act_amax:
        calibrated = fp8compile.calibrate(model, [x], recipe="tensor")
        options = dict(recipe="tensor", act_amax=calibrated.act_amax)
    backends = ("cublas", "triton_small_m", "triton")
    backend = CountingBackend(batch_invariant=True, backends=backends, **options)
    fn = torch.compile(model, backend=backend)
    with torch.no_grad():
        outs = {}
        for m in (40, 17, 5, 1):
            part = x[:m].clone()
            torch._dynamo.mark_dynamic(part, 0)
            outs[m] = fn(part)
    # (Their numbers: the kernel tests above on exact inputs, test_gpu_* on real ones. Random
    # inputs in the interpreter meet its float -> e4m3 conversion where rounding carries.)
    for m, out in outs.items():
        assert torch.equal(out, outs[40][:m]), f"rows of the M={m} batch differ from the M=40 batch"
    kernels = {k for r in backend.report.rewrites for _, k in r.kernels}
    assert kernels == {"triton"} and {r.kind for r in backend.report.rewrites} == {"linear", "silu_mul"}


def test_the_gated_cublas_and_decode_ops_trace_to_our_quantization_launch_and_one_gemm():
    """What passes/inline.py copies into the graph for a gated down projection (traced as
    AOTAutograd traces, symbolic M): our quantization kernel's launch, then aten._scaled_mm (the
    cuBLAS side) or the decode kernel's launch (act(gate, up) is not computed again there), and
    an amax reduction only for the tensor recipe's dynamic scale. Traced in a process without
    Triton's interpreter, which wrap_triton cannot trace through; on the CPU, as nothing runs."""
    pytest.importorskip("triton")
    script = textwrap.dedent("""
        import json
        import torch
        from torch._inductor.decomposition import select_decomp_table
        from torch._subclasses.functional_tensor import FunctionalTensorMode, dispatch_functionalize
        from torch.fx.experimental.proxy_tensor import make_fx
        from fp8compile.ops.linear import scaled_gated_mm, triton_scaled  # noqa: F401
        w = torch.empty(256, 512, dtype=torch.float8_e4m3fn)
        cases = (("rowwise", False), ("rowwise", True), ("tensor", False), ("tensor", True))
        for side, m in (("cublas", 300), ("decode", 12)):
            a = torch.empty(m, 512, dtype=torch.bfloat16)
            for recipe, static in cases:
                ws = torch.empty(256) if recipe == "rowwise" else torch.empty(())
                s = torch.tensor(0.1) if static else None
                if side == "cublas":
                    op = torch.ops.fp8compile.gated_linear_scaled_mm
                    call = lambda a, b, w, ws, s: op(a, b, w, ws, None, s, recipe)
                else:
                    op = torch.ops.fp8compile.linear_scaled_decode
                    call = lambda a, b, w, ws, s: op(a, w, ws, None, s, recipe, max_m=16, b=b)
                traced = make_fx(dispatch_functionalize(call, FunctionalTensorMode()),
                                 decomposition_table=select_decomp_table(),
                                 tracing_mode="symbolic")(a, a, w, ws, s)
                ops = (torch._ops.OpOverload, torch._ops.HigherOrderOperator)
                print(json.dumps([side, recipe, static, sorted(str(n.target) for n in traced.graph.nodes
                      if n.op == "call_function" and isinstance(n.target, ops))]))
    """)
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 8, done.stdout
    for line in lines:
        side, recipe, static, targets = json.loads(line)
        launches = targets.count("triton_kernel_wrapper_functional")
        assert launches == (1 if side == "cublas" else 2), targets
        assert targets.count("aten._scaled_mm.default") == (side == "cublas"), targets
        reductions = [t for t in targets if t in ("aten.amax.default", "aten.max.default")]
        tensor_dynamic = recipe == "tensor" and not static
        assert bool(reductions) == tensor_dynamic, (recipe, static, targets)
        # act(gate, up) is computed in our kernel only, but for the tensor recipe's one amax
        assert ("aten.sigmoid.default" in targets) == tensor_dynamic, targets


# --- the passes --------------------------------------------------------------------------------


class Block(nn.Module):
    """Attention (q, k, v over one x, biased) then a gated MLP: every merge the passes make."""

    def __init__(self):
        super().__init__()
        self.attn = Attention(256)
        self.mlp = GatedMLP(256, 512)

    def forward(self, x):
        h = x + self.attn(x)
        return h + self.mlp(h)


def scaled_calls(g):
    """The scaled recipes' op calls in a captured graph: plain linears, then gated down projections."""
    return g.ops(SCALED) + g.ops(GATED_SCALED)


def compiled(model, recipe, **options):
    backend = CountingBackend(recipe=recipe, **options)
    return torch.compile(model, backend=backend), backend


@pytest.mark.parametrize("recipe", RECIPES)
def test_linears_become_qlinear_scaled_still_merge_over_one_input_and_fuse_the_gated_product(
    recipe, captured
):
    model = Block().to(BF16).requires_grad_(False)
    x = randn(2, 9, 256)
    fn, backend = compiled(model, recipe)
    with torch.no_grad():
        out = fn(x)
    (g,) = captured
    assert g.count(BLOCK_LINEAR) == 0 and g.count(BLOCK_GATED) == 0
    # q|k|v one GEMM, o, gate|up one GEMM: three plain sites (one range on the CPU); the down
    # projection quantizes silu(gate) * up itself, with the recipe's scale (silu_mul pass)
    (down,) = g.ops(GATED_SCALED)
    calls = scaled_calls(g)
    assert len(calls) == 4 and {c.kwargs["recipe"] for c in calls} == {recipe}
    assert all(c.kwargs["x_scale"] is None for c in calls)
    report = backend.report
    assert {r.recipe for r in report.rewrites} == {f"{recipe}, dynamic"}
    assert report.counts()["linear"] == 6 and report.counts()["silu_mul"] == 1
    assert not report.skipped("silu_mul")
    assert f"recipe={recipe} act_scales=dynamic" in str(report) and f"{recipe}, dynamic" in str(report)
    # cuBLAS's fast accumulation by default, as torchao and vLLM run these recipes (Fp8Config.fast_accum)
    assert "fast_accum=True" in str(report) and all(c.kwargs["fast_accum"] is True for c in calls)
    # Bound: 2 GEMMs in series on the attention side, 3 on the MLP's (GATED_MLP)
    assert calc_diff(out.float(), model(x).float()) < GATED_MLP


def test_fast_accum_false_promotes_every_scaled_linear_and_the_report_says_so(captured):
    model = Block().to(BF16).requires_grad_(False)
    fn, backend = compiled(model, "rowwise", fast_accum=False)
    with torch.no_grad():
        fn(randn(2, 9, 256))
    calls = scaled_calls(captured[0])
    assert len(calls) == 4 and not any(c.kwargs.get("fast_accum", False) for c in calls)
    assert "fast_accum=False" in str(backend.report)


@pytest.mark.parametrize(
    "recipe, fast_accum, on",
    [("rowwise", None, True), ("tensor", None, True), ("block", None, False)]
    + [("rowwise", False, False), ("tensor", True, True), ("block", False, False)],
)
def test_fast_accum_none_means_on_for_the_scaled_recipes_and_off_for_block(recipe, fast_accum, on):
    assert fp8compile.make_config(recipe=recipe, fast_accum=fast_accum).cublas_fast_accum() is on


class OddK(nn.Module):
    def __init__(self):
        super().__init__()
        self.k272 = nn.Linear(272, 128)  # 17 x 16: whole FP8 tensor-core steps, not 128-wide groups
        self.k200 = nn.Linear(200, 128)  # 12.5 x 16

    def forward(self, x, y):
        return self.k272(x), self.k200(y)


def test_the_scaled_recipes_take_any_k_that_fp8_tensor_cores_take():
    model = OddK().to(BF16).requires_grad_(False)
    x, y = randn(4, 272), randn(4, 200)
    reasons = {}
    for recipe, rewritten in (("block", {"k272", "k200"}), ("rowwise", {"k272"})):
        fn, backend = compiled(model, recipe)
        with torch.no_grad():
            fn(x, y)
        assert {r.name for r in backend.report.rewrites} == rewritten
        reasons[recipe] = {s.name: s.reason for s in backend.report.skips}
        torch._dynamo.reset()
    assert reasons["block"] == {}  # K padded to whole 1x128 groups (tests/test_linear_pass.py)
    assert reasons["rowwise"] == {"k200": "K=200 is not a multiple of 16 (FP8 GEMMs read 16-byte rows)"}


def test_routed_experts_stay_bf16_in_the_scaled_recipes_with_the_reason():
    from tests.test_moe import compile_block, mixtral_block

    _, _, report = compile_block(mixtral_block("grouped_mm"), randn(1, 6, 256), recipe="rowwise")
    (skip,) = report.skipped("moe")
    assert "block recipe only (recipe='rowwise')" in skip.reason
    assert not any(report.counts().values())  # its router stays bf16 too (N = 8)


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_range_of_m_gives_the_numbers_of_one_kernel_without_recompiling(recipe, ranged_references):
    # The gate and up halves of the merged GEMM (row stride 2I) reach each branch of the down
    # projection's dispatch: the stride contract of the block recipe holds here too.
    model = Block().to(BF16).requires_grad_(False)
    fn, backend = compiled(model, recipe, backends=ranged_references, **RANGES)
    plain = torch.compile(model, backend=fp8compile.backend(recipe=recipe, backends=["reference"]))
    with torch.no_grad():
        for m in (3, 33, 64, 65, 130, 1):
            x = randn(1, m, 256)
            torch._dynamo.mark_dynamic(x, 1)
            got = fn(x)
            assert torch.equal(got, plain(x)), f"M={m}: the M dispatch changed the numbers"
            assert calc_diff(got.float(), model(x).float()) < GATED_MLP, m
    assert backend.compiles <= 2  # Dynamo specializes M = 1
    kernels = {k for r in backend.report.rewrites for _, k in r.kernels}
    assert kernels == {"ref_small", "ref_medium", "reference"}


def test_configs_refuse_what_the_scaled_recipes_cannot_do():
    with pytest.raises(ValueError, match="recipe='tensor' needs static scales"):
        fp8compile.make_config(recipe="tensor", batch_invariant=True)
    with pytest.raises(ValueError, match="serve the rowwise and tensor recipes"):
        fp8compile.make_config(act_amax={"fc": 1.0})
    with pytest.raises(ValueError, match="positive finite amax"):
        fp8compile.make_config(recipe="tensor", act_amax={"fc": 0.0})
    with pytest.raises(ValueError, match="act_amax_ub must be a number >= 0"):
        fp8compile.make_config(recipe="tensor", act_amax_ub=-1)
    with pytest.raises(ValueError, match="with act_amax the scales are static"):
        fp8compile.make_config(recipe="tensor", act_amax={"fc": 1.0}, act_amax_ub=2.0)
    with pytest.raises(ValueError, match="fast_accum serves the rowwise and tensor recipes' cuBLAS GEMM"):
        fp8compile.make_config(fast_accum=True)
    with pytest.raises(TypeError, match="fast_accum must be True, False or None"):
        fp8compile.make_config(recipe="rowwise", fast_accum=1)


def test_a_config_with_static_scales_stays_hashable_copyable_and_picklable():
    """transformers' CompileConfig deep-copies what it is given; Fp8Config is a frozen value."""
    import copy
    import pickle

    config = fp8compile.make_config(recipe="tensor", act_amax={"fc": 2.0})
    for twin in (copy.deepcopy(config), pickle.loads(pickle.dumps(config)), config.replace()):
        assert twin == config and hash(twin) == hash(config) and twin.act_amax["fc"] == 2.0
    with pytest.raises(TypeError):
        config.act_amax["fc"] = 3.0  # read-only: the compiled graphs hold its scales


# --- static scales -----------------------------------------------------------------------------


def test_calibrated_scales_round_trip_through_a_file_into_constant_scales_of_the_graph(tmp_path, captured):
    model = Block().to(BF16).requires_grad_(False)
    batches = [randn(2, 9, 256) for _ in range(3)]
    config = fp8compile.calibrate(model, batches, recipe="tensor")
    assert set(config.act_amax) == {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    # q, k and v saw the same input: the same amax
    assert config.act_amax["attn.q_proj"] == config.act_amax["attn.v_proj"]
    fp8compile.save_scales(config, tmp_path / "scales.pt")
    table = fp8compile.load_scales(tmp_path / "scales.pt", model)
    assert table == dict(config.act_amax)

    x = batches[0]
    outs = []
    for act_amax in (config.act_amax, table):
        fn, backend = compiled(model, "tensor", act_amax=act_amax)
        with torch.no_grad():
            outs.append(fn(x))
        torch._dynamo.reset()
    assert torch.equal(outs[0], outs[1])
    assert {r.recipe for r in backend.report.rewrites} == {"tensor, static"}
    for g in captured:
        scales = [c.kwargs["x_scale"] for c in scaled_calls(g)]
        assert len(scales) == 4 and all(s is not None and s.op == "placeholder" for s in scales)
    # Bound: the same as dynamic scales (the calibration batch is the one run).
    assert calc_diff(outs[0].float(), model(x).float()) < GATED_MLP


def test_static_scales_stay_within_1_2x_of_dynamic_ones_on_the_calibration_distribution():
    model = Block().to(BF16).requires_grad_(False)
    config = fp8compile.calibrate(model, [randn(2, 16, 256) for _ in range(4)], recipe="tensor")
    x = randn(2, 16, 256)  # the same distribution, another draw
    with torch.no_grad():
        exact = model(x).float()
        static = torch.compile(model, backend=fp8compile.backend(config))(x)
        torch._dynamo.reset()
        dynamic = torch.compile(model, backend=fp8compile.backend(recipe="tensor"))(x)
    assert calc_diff(static.float(), exact) < 1.2 * calc_diff(dynamic.float(), exact)


def test_a_table_of_another_model_is_a_clear_error_and_a_missing_linear_stays_bf16(tmp_path):
    model = Block().to(BF16).requires_grad_(False)
    fp8compile.save_scales({"encoder.fc1": 1.0, "attn.q_proj": 2.0}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"1 of its 2 names are no nn.Linear of it \(encoder.fc1\)"):
        fp8compile.load_scales(tmp_path / "other.pt", model)
    torch.save({"something": 1}, tmp_path / "junk.pt")
    with pytest.raises(ValueError, match="not an activation scale table"):
        fp8compile.load_scales(tmp_path / "junk.pt")

    partial = fp8compile.calibrate(model, [randn(1, 4, 256)], recipe="rowwise").act_amax
    partial = {k: v for k, v in partial.items() if k != "attn.o_proj"}
    fn, backend = compiled(model, "rowwise", act_amax=partial)
    with torch.no_grad():
        fn(randn(1, 4, 256))
    (skip,) = [s for s in backend.report.skips if s.name == "attn.o_proj"]
    assert "no calibrated activation amax" in skip.reason
    assert "attn.o_proj" not in {r.name for r in backend.report.rewrites}


# --- on the GPU ----------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("m", [1, 5, 16, 33, 64, 300])
@pytest.mark.parametrize("kernel", ["cublas", "cublas_fast_accum", "triton_small_m", "triton"])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.gpu
@gpu
def test_gpu_kernels_give_the_references_numbers(recipe, m, kernel, static):
    if kernel == "triton_small_m" and m > 64:
        pytest.skip("the decode kernel serves M <= 64")
    # cuBLAS in fast accumulation (the scaled recipes' default, Fp8Config.fast_accum): its GEMM
    # error at K = 4096 measured 2.3e-6 against the exact product of the same FP8 operands (H100,
    # BENCHMARKS.md "2026-11-26 (82a2db6)"), inside SCALED_KERNEL_BOUND too.
    kernel, fast_accum = ("cublas", True) if kernel == "cublas_fast_accum" else (kernel, False)
    x, w, bias = (
        randn(m, 4096, device="cuda"),
        randn(1536, 4096, scale=0.02, device="cuda"),
        randn(1536, device="cuda"),
    )
    w_fp8, w_scale = rs.quant_weight_scaled(w, recipe)
    x_scale = torch.tensor(3.0 / FP8_MAX, device="cuda") if static else None
    ref = rs.linear_scaled(x, w_fp8, w_scale, bias, recipe, x_scale)
    out = torch.ops.fp8compile.qlinear_scaled(
        x, w_fp8, w_scale, bias, x_scale, recipe, fast_accum=fast_accum, backend=kernel
    )
    # Tensor cores' accumulation against the exact fp64 sum, then bf16 (+ the bias, added in bf16
    # by the cuBLAS side): SCALED_KERNEL_BOUND, why there.
    assert calc_diff(out.float(), ref.float()) < SCALED_KERNEL_BOUND
    if kernel == "triton_small_m":
        traced_op = torch.ops.fp8compile.linear_scaled_decode(
            x, w_fp8, w_scale, bias, x_scale, recipe, max_m=64 if m > 16 else 16
        )
        assert calc_diff(traced_op.float(), out.float()) < 1e-6


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize(
    "m, k", [(1, 4096), (16, 4096), (64, 14336), (300, 14336), (300, 33024), (4100, 4096)]
)
@pytest.mark.parametrize("kernel", ["cublas", "triton_small_m", "triton"])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.gpu
@gpu
def test_gpu_gated_kernels_give_the_references_numbers(recipe, m, k, kernel, static):
    # K = 33024: past ONE_PASS_MAX, the quantization's two passes over chunks. cuBLAS in fast
    # accumulation (the default) up to K = 18944, where its GEMM error was measured (2.3e-6..7.2e-6,
    # SCALED_KERNEL_BOUND); at K = 33024 it measured 1.7e-5 (H100, 2026-11-26 (acad3b3)), past the
    # bound by the accumulation alone, so that K runs promoting: what is tested there is our kernel.
    if kernel == "triton_small_m" and m > 64:
        pytest.skip("the decode kernel serves M <= 64")
    a, b = randn(m, k, scale=2.0, device="cuda"), randn(m, k, device="cuda")
    w_fp8, w_scale = rs.quant_weight_scaled(randn(1536, k, scale=0.02, device="cuda"), recipe)
    bias = randn(1536, device="cuda")
    x_scale = torch.tensor(3.0 / FP8_MAX, device="cuda") if static else None
    ref = rs.gated_linear_scaled(a, b, w_fp8, w_scale, bias, recipe, x_scale)
    out = torch.ops.fp8compile.gated_qlinear_scaled(
        a,
        b,
        w_fp8,
        w_scale,
        bias,
        x_scale,
        recipe,
        fast_accum=kernel == "cublas" and k <= 18944,
        backend=kernel,
    )
    assert calc_diff(out.float(), ref.float()) < SCALED_KERNEL_BOUND
    if kernel == "triton_small_m":
        traced_op = torch.ops.fp8compile.linear_scaled_decode(
            a, w_fp8, w_scale, bias, x_scale, recipe, max_m=64 if m > 16 else 16, b=b
        )
        assert calc_diff(traced_op.float(), out.float()) < 1e-6


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
@pytest.mark.gpu
@gpu
def test_gpu_compiled_block_runs_every_range_of_m_in_both_modes(recipe, mode):
    model = Block().to("cuda", BF16).requires_grad_(False)
    backend = CountingBackend(recipe=recipe)
    fn = torch.compile(model, backend=backend, mode=mode)
    with torch.no_grad():
        for m in (3, 16, 33, 64, 300, 2100, 1):
            x = randn(1, m, 256, device="cuda")
            torch._dynamo.mark_dynamic(x, 1)
            for _ in range(3 if mode else 1):  # warm-up, record, replay
                got = fn(x)
            assert calc_diff(got.float(), model(x).float()) < GATED_MLP, m
    assert backend.compiles <= 2
    kernels = {k for r in backend.report.rewrites for _, k in r.kernels}
    assert kernels == {"triton_small_m", "cublas"}
    if mode:
        assert all(state.startswith("on") for state in backend.report.cuda_graphs.values()), backend.report
