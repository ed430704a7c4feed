"""Probe: decode attention at Llama-3-8B's GQA (8 K/V heads, 4 query heads each, D 128) on a
static cache: the grouped sdpa the gqa pass emits today, against splitting the cache into
chunks (flash-decoding: one lse per chunk, combined), a matmul-softmax-matmul, and the
repeat_kv copy bf16 Inductor runs. Prints us per layer; JSON under $OUT."""

import json
import os
import sys

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

aten = torch.ops.aten
KV, REP, D = 8, 4, 128


def grouped(q, k, v, mask, backend):
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def repeat(q32, k, v, mask):
    b, kv, n_keys, d = k.shape
    k = k[:, :, None].expand(b, kv, REP, n_keys, d).reshape(b, kv * REP, n_keys, d)
    v = v[:, :, None].expand(b, kv, REP, n_keys, d).reshape(b, kv * REP, n_keys, d)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q32, k, v, attn_mask=mask)


def split(q, k, v, mask, chunks, op):
    b, kv, r, d = q.shape
    n_keys = k.shape[2]
    lc = n_keys // chunks
    qs = q[:, :, None].expand(b, kv, chunks, r, d).reshape(b, kv * chunks, r, d)
    ks = k.view(b, kv * chunks, lc, d)
    vs = v.view(b, kv * chunks, lc, d)
    m = mask.expand(b, 1, r, n_keys).view(b, 1, r, chunks, lc).permute(0, 1, 3, 2, 4)
    m = m.expand(b, kv, chunks, r, lc).reshape(b, kv * chunks, r, lc)
    if op == "efficient":
        out, lse = aten._scaled_dot_product_efficient_attention(qs, ks, vs, m, True)[:2]
    else:
        out, lse = aten._scaled_dot_product_cudnn_attention(qs, ks, vs, m, True)[:2]
    out = out.view(b, kv, chunks, r, d).float()
    lse = lse[..., :r].reshape(b, kv, chunks, r).float()
    valid = (mask.view(b, 1, 1, n_keys) > float("-inf")).view(b, 1, chunks, lc).any(-1)  # (B, 1, C)
    valid = valid[:, :, :, None]  # a chunk with no key left reads nothing: its lse is a convention
    lse = torch.where(valid, lse, float("-inf"))
    top = lse.amax(2, keepdim=True)
    w = torch.where(valid, torch.exp(lse - top), 0)
    num = torch.where(w[..., None] > 0, w[..., None] * out, 0).sum(2)
    return (num / w.sum(2)[..., None]).to(q.dtype)


def matmuls(q, k, v, mask):
    s = (q.float() @ k.float().transpose(-1, -2)) * D**-0.5 + mask
    return torch.softmax(s, -1).to(q.dtype) @ v


def ours(q, k, v, mask, chunk):
    return torch.ops.fp8compile.gqa_decode_attention(q, k, v, mask, D**-0.5, REP, chunk)


def main():
    from fp8compile.ops import attention_op  # noqa: F401

    torch._dynamo.config.automatic_dynamic_shapes = False
    torch._dynamo.config.recompile_limit = 10000
    torch._dynamo.config.cache_size_limit = 10000
    out_dir = os.environ.get("OUT", ".")
    rows = []
    for n_keys in (1152, 4096):
        for b in (1, 4, 16, 64):
            pos = n_keys - 100
            q = torch.randn(b, KV, REP, D, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(b, KV, n_keys, D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(b, KV, n_keys, D, device="cuda", dtype=torch.bfloat16)
            mask = torch.zeros(b, 1, 1, n_keys, device="cuda", dtype=torch.bfloat16)
            mask[..., pos:] = float("-inf")
            ref = grouped(q, k, v, mask, SDPBackend.MATH).float()
            cands = {
                "grouped_cudnn": lambda: grouped(q, k, v, mask, SDPBackend.CUDNN_ATTENTION),
                "repeat_kv_cudnn": torch.compile(lambda: repeat(q.view(b, KV * REP, 1, D), k, v, mask)),
            }
            for chunk in (0, 128, 256, 512, 1024):
                cands[f"ours_chunk{chunk}"] = torch.compile(lambda chunk=chunk: ours(q, k, v, mask, chunk))
            keep = mask == 0
            cands["ours_bool_mask"] = torch.compile(lambda: ours(q, k, v, keep, 0))
            for c in ():
                if n_keys % c or (n_keys // c) % 8:
                    continue
                for op in ("efficient", "cudnn"):
                    cands[f"split{c}_{op}"] = torch.compile(lambda c=c, op=op: split(q, k, v, mask, c, op))
            for name, fn in cands.items():
                try:
                    got = fn().float()
                    if name.startswith("repeat"):
                        got = got.view(b, KV, REP, D)
                    err = ((got - ref).norm() / ref.norm()).item()
                    us = 1000 * triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
                except Exception as e:
                    err, us = None, None
                    print(name, "failed", type(e).__name__, str(e).splitlines()[0][:150])
                rows.append(dict(n_keys=n_keys, b=b, variant=name, us=us, rel_err=err))
                print(f"L={n_keys} B={b} {name}: {us and round(us, 1)} us, rel err {err}", flush=True)
    json.dump(rows, open(f"{out_dir}/attn_decode.json", "w"), indent=1)


if __name__ == "__main__":
    sys.exit(main())
