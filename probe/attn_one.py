"""Probe: one compiled call of fp8compile::gqa_decode_attention, errors in full (compile threads 1)."""

import os
import traceback

os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
import torch  # noqa: E402

from fp8compile.ops import attention_op  # noqa: E402, F401

q = torch.randn(1, 8, 4, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(1, 8, 1152, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn(1, 8, 1152, 128, device="cuda", dtype=torch.bfloat16)
mask = torch.zeros(1, 1, 1, 1152, device="cuda", dtype=torch.bfloat16)


def run(mask):
    torch._dynamo.reset()
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float().view(1, 32, 1, 128),
        k.float()[:, :, None].expand(1, 8, 4, 1152, 128).reshape(1, 32, 1152, 128),
        v.float()[:, :, None].expand(1, 8, 4, 1152, 128).reshape(1, 32, 1152, 128),
        attn_mask=mask if mask is None or mask.dtype == torch.bool else mask.float(),
        scale=0.088,
    ).view(1, 8, 4, 128)
    eager = torch.ops.fp8compile.gqa_decode_attention(q, k, v, mask, 0.088, 4, 0)
    print("eager", ((eager.float() - ref).norm() / ref.norm()).item())
    try:
        fn = torch.compile(lambda: torch.ops.fp8compile.gqa_decode_attention(q, k, v, mask, 0.088, 4, 0))
        got = fn()
        print("compiled", ((got.float() - ref).norm() / ref.norm()).item())
    except Exception:
        print(traceback.format_exc()[-4000:])


mask[..., 1000:] = float("-inf")
for m in (mask, mask == 0, None):
    run(m)
