"""`python -m fp8compile bench tune --kernels gqa_decode`: the split-KV decode attention
(ops/attention/) at every launch of a sweep (keys a step, warps, stages, programs an SM, which
also sets the chunk count) against the op's own (triton_attention.launch_for).

Llama-3-8B's heads (8 K/V heads of 4 query heads, D = 128; Gemma's 8 of 2, D = 256, at three
points), one query token a sequence, the boolean (B, 1, 1, L) mask a static cache gives, a row
per sequence, its last positions not written yet. At 1057 keys (`bench model`'s cache: prompt
1024, 32 steps and one) the mask's rows do not start on 16 bytes and the kernel reads one row a
step, at 1088 a tile of rows (triton_attention.one_mask_row); a sweep at 1088 alone missed the
in-model time at 1057. Each timed call reads its keys and values from a copy of its own, the
copies together larger than L2 (harness.copies), so every call reads them cold, as each layer of
a model does; the combine kernel is timed with the split one. A launch whose output strays from
the fp32 attention, or that asks for more shared memory than the GPU has, is reported, not
timed. Times: harness.py (CUDA-graph replay, median us); TB/s against the keys' and values'
bytes.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

import fp8compile

from . import harness
from .output import best_fixed, save

# (K/V heads, query heads each, head width): Llama-3-8B's; Gemma-2-9B's and Gemma-3-12B's
LLAMA, GEMMA = (8, 4, 128), (8, 2, 256)
# (batch, keys[, heads]), Llama's heads unless named: a 1024-token prompt and 64 steps, and 32
# steps and one (the mask's rows unaligned); a 4096-key context; Gemma's heads at 1057 keys,
# and at 1024, Gemma-3's window (LeanDecoder's ring, fp8compile/ring_window.py).
POINTS = [
    (1, 1088),
    (16, 1088),
    (64, 1088),
    (1, 1057),
    (16, 1057),
    (64, 1057),
    (1, 4096),
    (16, 4096),
    (1, 1057, GEMMA),
    (16, 1057, GEMMA),
    (16, 1024, GEMMA),
]
# calc_diff against the fp32 attention above which a launch's output counts as wrong: the op
# measures about 1e-5 (bf16 probabilities and output; tests/test_decode_attention.py), a lost
# chunk 0.15 and more.
WRONG = 1e-3


def launches():
    """The sweep: every combination around the op's launch. One program an SM halves the chunks:
    at Llama-3-8B's batch 16 the keys stay whole, with no combine kernel."""
    from fp8compile.ops.attention.triton_attention import Launch

    return [
        Launch(block_l, warps, stages, per_sm)
        for block_l, warps, stages, per_sm in itertools.product((64, 128), (4, 8), (2, 3, 4), (1, 2, 4))
    ]


def _case(batch: int, keys: int, device: torch.device, heads=LLAMA):
    """One sequence-batch's query, keys, values and mask (a row per sequence, the last 16
    positions masked)."""
    kv, rep, d = heads
    q = torch.randn(batch, kv, rep, d, device=device, dtype=torch.bfloat16)
    k = torch.randn(batch, kv, keys, d, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    mask = torch.ones(batch, 1, 1, keys, dtype=torch.bool, device=device)
    mask[..., keys - 16 :] = False
    return q, k, v, mask


def _reference(q, k, v, mask):
    """The fp32 attention of one query token over repeat_kv'd keys and values: (B, KV, rep, D)."""
    b, kv, rep, d = q.shape

    def repeated(t):
        return t.float()[:, :, None].expand(b, kv, rep, *t.shape[2:]).reshape(b, kv * rep, *t.shape[2:])

    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().reshape(b, kv * rep, 1, d), repeated(k), repeated(v), attn_mask=mask
    )
    return out.reshape(b, kv, rep, d)


def tune_gqa_decode(out: Path, points=POINTS, sweep=None, device: torch.device | None = None) -> list[dict]:
    """Time every launch of `sweep` (default: launches()) at each (batch, keys) point; print the
    op's launch against the best per point and the best fixed launches by geometric mean."""
    from triton.runtime.errors import OutOfResources

    from fp8compile.ops.attention import op, triton_attention

    device = device or torch.device("cuda")
    sweep = sweep or launches()
    rows = []
    for batch, keys, *named in points:
        heads = named[0] if named else LLAMA
        kv, rep, d = heads
        default = triton_attention.launch_for(d)
        kv_bytes = 2 * batch * kv * keys * d * 2
        cases = [
            _case(batch, keys, device, heads)
            for _ in range(harness.copies(kv_bytes) if device.type == "cuda" else 1)
        ]
        want = _reference(*cases[0])
        for launch in dict.fromkeys([default, *sweep]):

            def run(case, launch=launch, rep=rep, d=d):
                return op.split_kv_attention(*case, d**-0.5, rep, 0, launch)

            try:
                error = fp8compile.calc_diff(run(cases[0]), want)
            except OutOfResources:  # more shared memory than the GPU has: reported, not timed
                error = None
            timed = error is not None and error < WRONG and device.type == "cuda"
            us = harness.time_us([lambda c=c, run=run: run(c) for c in cases]) if timed else None
            chunk = triton_attention.chunk_keys(keys, batch, kv, device, launch)
            rows.append(
                dict(
                    batch=batch,
                    keys=keys,
                    heads=str(heads),
                    launch=str(tuple(vars(launch).values())),
                    **vars(launch),
                    chunks=-(-keys // chunk),
                    calc_diff=error,
                    us=us,
                    tbps=us and kv_bytes / us / 1e6,
                    default=launch == default,
                )
            )
        here = [r for r in rows if (r["batch"], r["keys"], r["heads"]) == (batch, keys, str(heads))]
        ours = next(r for r in here if r["default"])
        timed = [r for r in here if r["us"]]
        best = min(timed, key=lambda r: r["us"]) if timed else None
        print(
            f"B={batch} keys={keys} heads={heads}: "
            + f"the op's launch {ours['us'] and round(ours['us'], 1)} us, best "
            + (f"{best['launch']} {best['us']:.1f} us" if best else "none timed")
            + "".join(
                f"; {r['launch']} wrong (calc_diff {r['calc_diff']:.1e})"
                for r in here
                if r["calc_diff"] is not None and r["calc_diff"] >= WRONG
            )
            + "".join(f"; {r['launch']} does not fit" for r in here if r["calc_diff"] is None),
            flush=True,
        )
    return save(
        out,
        "tune_gqa_decode.json",
        rows,
        lambda rows: (
            "launch = (keys a step, warps, stages, programs an SM)\n"
            + "\n".join(
                f"heads {heads} (K/V heads, query heads each, width): "
                + best_fixed([r for r in rows if r["heads"] == heads], "launch")
                for heads in dict.fromkeys(r["heads"] for r in rows)
            )
        ),
    )
