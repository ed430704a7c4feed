"""Device diagnostics behind the kernel tolerances (tests/test_triton_kernels.py): error
statistics of the small-M kernel against the fp64 reference. Run on the GPU:
source .whl/prelude.sh && python scripts/gpu_diag.py
(Large-M tile timings moved to `python -m fp8compile bench tune`; the two-accumulator "overlap"
variant measured in BENCHMARKS.md was removed from the kernel.)"""
import torch

from fp8compile.ops import reference, triton_gemm, triton_quant

torch.manual_seed(0)
print("small-M kernel vs reference: max|err|, max|err|/rms(ref), calc_diff, elements beyond bf16 rtol")
for e8m0 in (False, True):
    for split in (1, 2):
        for m in (1, 5, 16, 17, 33, 64):
            x = torch.randn(m, 256, device="cuda").bfloat16()
            w_fp8, w_scale = reference.quant_weight_block((torch.randn(200, 256, device="cuda") * 0.02).bfloat16(), e8m0)
            b = torch.randn(200, device="cuda").bfloat16()
            out = triton_gemm.linear_small_m(x, w_fp8, w_scale, b, e8m0, split_k=split).float()
            ref = reference.linear_block(x, w_fp8, w_scale, b, e8m0).float()
            err = (out - ref).abs()
            rms = ref.square().mean().sqrt()
            beyond = (err > 2**-7 * ref.abs() + 1e-6 * ref.abs().max()).sum().item()
            d = 1 - 2 * (out.double() * ref.double()).sum() / (out.double() ** 2 + ref.double() ** 2).sum()
            xq, xs = reference.quant_act_block(x, e8m0)
            tq, ts = triton_quant.quant_act(x, e8m0)
            print(f"e8m0={e8m0} split={split} m={m:3d}: {err.max():.2e} {err.max() / rms:.2e} {d:.2e} {beyond:4d}"
                  f"  quant bit-exact={torch.equal(xq.view(torch.uint8), tq.view(torch.uint8)) and torch.equal(xs, ts)}")
