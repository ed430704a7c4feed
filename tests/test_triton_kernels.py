"""Our Triton kernels against their pure-PyTorch twins: on the GPU at real sizes, on the CPU in
Triton's interpreter at small sizes (with interpreter-safe inputs, see fp8_exact_activation)."""
import pytest
import torch

pytest.importorskip("triton")

from fp8compile import calc_diff  # noqa: E402
from fp8compile.ops import reference  # noqa: E402
from fp8compile.ops import triton_gemm, triton_quant  # noqa: E402
from tests.conftest import DEVICE, fp8_exact_activation, randn  # noqa: E402

ON_GPU = DEVICE == "cuda"


def activation(m, k):
    return randn(m, k, device=DEVICE) if ON_GPU else fp8_exact_activation(m, k)


def assert_bf16_close(out, ref):
    """Equal up to one bf16 rounding: the kernels accumulate in fp32, the reference in fp64."""
    assert out.dtype == ref.dtype == torch.bfloat16 and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-6 * ref.float().abs().max().item())


@pytest.mark.parametrize("m", [1, 7, 33, 130])
@pytest.mark.parametrize("layout", ["row", "mn_major"])
@pytest.mark.parametrize("e8m0", [False, True])
def test_quant_act_is_bit_exact_with_the_reference(m, layout, e8m0):
    x = activation(m, 384)
    x_fp8, scale = triton_quant.quant_act(x, e8m0, layout)
    ref_fp8, ref_scale = reference.quant_act_block(x, e8m0)
    assert torch.equal(x_fp8.view(torch.uint8), ref_fp8.view(torch.uint8))
    assert torch.equal(scale, ref_scale)
    if layout == "mn_major":  # column-major, columns padded to 16 bytes, as DeepGEMM/cuBLAS read it
        assert scale.stride() == (1, (m + 3) // 4 * 4)


@pytest.mark.parametrize("m, n", [(1, 128), (20, 200), (70, 384)])
@pytest.mark.parametrize("bias", [False, True])
def test_large_m_gemm_matches_the_reference(m, n, bias):
    x_fp8, x_scale = reference.quant_act_block(activation(m, 256))
    w_fp8, w_scale = reference.quant_weight_block(randn(n, 256, scale=0.02, device=DEVICE))
    b = randn(n, device=DEVICE) if bias else None
    out = triton_gemm.gemm_large_m(x_fp8, x_scale, w_fp8, w_scale, b)
    assert_bf16_close(out, reference.gemm_block(x_fp8, x_scale, w_fp8, w_scale, b))


@pytest.mark.parametrize("m", [1, 5, 16, 17, 33, 64])
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("e8m0", [False, True])
def test_small_m_kernel_with_fused_quantization_matches_the_reference(m, split_k, e8m0):
    x = activation(m, 256)
    w_fp8, w_scale = reference.quant_weight_block(randn(200, 256, scale=0.02, device=DEVICE), e8m0)
    b = randn(200, device=DEVICE)
    out = triton_gemm.linear_small_m(x, w_fp8, w_scale, b, e8m0, split_k=split_k)
    assert_bf16_close(out, reference.linear_block(x, w_fp8, w_scale, b, e8m0))


def test_small_m_kernel_refuses_large_m():
    w_fp8, w_scale = reference.quant_weight_block(randn(128, 128, device=DEVICE))
    with pytest.raises(ValueError, match="serves M <= 64"):
        triton_gemm.linear_small_m(randn(65, 128, device=DEVICE), w_fp8, w_scale)


def test_compiled_model_can_run_on_triton_kernels_when_asked():
    import fp8compile

    model = torch.nn.Linear(256, 384).to(torch.bfloat16).to(DEVICE)
    fp8 = fp8compile.backend(backends=["triton_small_m", "triton"])
    compiled = torch.compile(model, backend=fp8)
    on_reference = torch.compile(model, backend=fp8compile.backend(backends=["reference"]))
    with torch.no_grad():
        for m in (40, 5):
            x = activation(m, 256)
            torch._dynamo.mark_dynamic(x, 0)
            assert_bf16_close(compiled(x), on_reference(x))
    assert fp8.report.rewrites[0].kernels == (("M <= 32", "triton_small_m"), ("M > 32", "triton"))
