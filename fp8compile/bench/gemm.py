"""`python -m fp8compile bench gemm`: one linear, our kernels and the compiled nn.Linear against
bf16 cuBLAS, cuBLAS FP8, DeepGEMM and FlashInfer, over shapes x M. Inputs are pre-quantized for
cuBLAS FP8, DeepGEMM and our Triton GEMM (GEMM alone); FlashInfer, triton_small_m and
fp8compile (the compiled nn.Linear) take bf16 and quantize themselves. At decode sizes `read`
is a plain read of the FP8 weight (read.py), what streaming its bytes costs here, and the last
column the share of the read's speed the compiled linear reaches. Times: harness.py, each call on
the next of enough weight copies that none is in L2 when its turn comes (what a model's decode
step meets); with warm_l2 (`--warm-l2`), every call on one copy, which stays in L2 where it fits
(50 MB on an H100 or H200): what a linear would take had its weight been fetched ahead, the most
an L2 prefetch could give it."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import fp8compile

from . import harness
from .output import pyplot

SHAPES = [(4096, 7168), (14336, 4096), (4096, 14336), (24576, 1536), (7168, 2048)]  # (N, K)
MS = [1, 16, 32, 128, 1024, 4096]
ANCHORS = ("deep_gemm", "flashinfer", "cublas_fp8")


class _Shape:
    """Everything that depends on (N, K) only: R weight copies (bf16 and FP8) and R nn.Linear
    modules compiled with backend="fp8" and dynamic M. One compiled graph serves every copy
    (same class, same shapes) and every M >= 2; Dynamo specializes M = 1 into a second graph."""

    def __init__(self, n: int, k: int, warm_l2: bool = False):
        from fp8compile.ops.quant import reference as quant_reference

        torch._dynamo.reset()
        self.n, self.k = n, k
        r8, r16 = (1, 1) if warm_l2 else (harness.copies(n * k), harness.copies(2 * n * k))
        self.w16 = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(max(r8, r16))
        ]
        self.r16 = r16
        self.w8 = [quant_reference.quant_weight_block(w) for w in self.w16[:r8]]
        self.linears, self.tuned = [], []
        self.read_tiling = None  # read.fastest_tiling, at the first decode size
        fp8 = fp8compile.backend()  # the object, not the entry point: runs from a source tree too
        fp8_tuned = fp8compile.backend(autotune=True)
        for w in self.w16[:r8]:
            lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
            lin.weight.data.copy_(w)
            self.linears.append(torch.compile(lin, backend=fp8, dynamic=True))
            self.tuned.append(torch.compile(lin, backend=fp8_tuned, dynamic=True))

    def variants(self, m: int) -> dict:
        """name -> list of zero-arg callables, one per weight copy."""
        from fp8compile.ops.linear import triton_gemm
        from fp8compile.ops.quant import triton_quant
        from fp8compile.ops import vendors

        x = torch.randn(m, self.k, device="cuda", dtype=torch.bfloat16)
        x_fp8_row, x_scale_row = triton_quant.quant_act(x)
        x_fp8, x_scale_tma = triton_quant.quant_act(x, layout="mn_major")
        _, x_scale_col = triton_quant.quant_act(x, layout="col")
        out = torch.empty(m, self.n, device="cuda", dtype=torch.bfloat16)
        v = {"bf16": [lambda w=w: torch.nn.functional.linear(x, w) for w in self.w16[: self.r16]]}
        v["cublas_fp8"] = [
            lambda q=q: torch._scaled_mm(
                x_fp8, q[0].t(), scale_a=x_scale_col, scale_b=q[1].t(), out_dtype=torch.bfloat16
            )
            for q in self.w8
        ]
        if vendors.import_error("deep_gemm") is None:
            import deep_gemm

            v["deep_gemm"] = [
                lambda q=q: deep_gemm.fp8_gemm_nt((x_fp8, x_scale_tma), q, out, disable_ue8m0_cast=True)
                for q in self.w8
            ]
        if vendors.import_error("flashinfer") is None:
            from flashinfer.gemm import fp8_blockscale_gemm_sm90

            v["flashinfer"] = [
                lambda q=q: fp8_blockscale_gemm_sm90(x, q[0], None, q[1], out_dtype=torch.bfloat16)
                for q in self.w8
            ]
        if m <= triton_gemm.SMALL_M_MAX:
            from .read import fastest_tiling, plain_read

            if self.read_tiling is None:
                self.read_tiling = fastest_tiling([q[0] for q in self.w8])
            v["read"] = [lambda q=q: plain_read(q[0], *self.read_tiling) for q in self.w8]
            v["triton_small_m"] = [lambda q=q: triton_gemm.linear_small_m(x, *q) for q in self.w8]
        if m >= 128:
            v["triton_gemm"] = [
                lambda q=q: triton_gemm.gemm_large_m(x_fp8_row, x_scale_row, *q) for q in self.w8
            ]
        # what a user pays: the compiled nn.Linear, activation quantization and M dispatch included
        v["fp8compile"] = [lambda f=f: f(x) for f in self.linears]
        v["fp8compile_tuned"] = [lambda f=f: f(x) for f in self.tuned]  # Fp8Config(autotune=True)
        return v


def bench_gemm(out_dir: Path, shapes=SHAPES, ms=MS, skip=(), warm_l2=False) -> list[dict]:
    """skip: variant names to leave out (fp8compile_tuned alone times ~100 kernels per shape);
    warm_l2: one weight copy a shape, not copies enough to keep it out of L2 (module docstring)."""
    from tqdm import tqdm

    rows = []
    device = torch.cuda.get_device_name(0)
    with torch.no_grad(), tqdm(total=len(shapes) * len(ms), desc="bench gemm") as progress:
        for n, k in shapes:
            shape = _Shape(n, k, warm_l2)
            for m in ms:
                for name, fns in shape.variants(m).items():
                    if name in skip:
                        continue
                    us = harness.time_us(fns)
                    rows.append(
                        dict(
                            device=device,
                            n=n,
                            k=k,
                            m=m,
                            variant=name,
                            l2="warm" if warm_l2 else "cold",
                            us=us,
                            tflops=None if us is None or name == "read" else 2 * m * n * k / us / 1e6,
                            weight_tbps=None
                            if us is None
                            else n * k * (2 if name == "bf16" else 1) / us / 1e6,
                        )
                    )
                progress.update()
            del shape
            torch.cuda.empty_cache()
            out_dir.mkdir(parents=True, exist_ok=True)  # after every shape: a cut-off run keeps its rows
            (out_dir / "bench_gemm.json").write_text(json.dumps(rows, indent=1))
    print(gemm_table(rows))
    _plot(rows, out_dir / "bench_gemm.png")
    return rows


def gemm_table(rows: list[dict]) -> str:
    by = {(r["n"], r["k"], r["m"], r["variant"]): r["us"] for r in rows}
    names = [
        "read",
        "bf16",
        "cublas_fp8",
        "deep_gemm",
        "flashinfer",
        "triton_small_m",
        "triton_gemm",
        "fp8compile",
        "fp8compile_tuned",
    ]
    width = {name: max(11, len(name)) for name in names}
    head = (
        f"{'N':>6} {'K':>6} {'M':>5} "
        + " ".join(f"{n:>{width[n]}}" for n in names)
        + "   ours/bf16 ours/best_anchor tri/dg tuned/bf16 read/ours"
    )
    warm = any(r.get("l2") == "warm" for r in rows)
    weights = "one weight copy, warm in L2 where it fits" if warm else "weights cold (copies cycled)"
    lines = [
        f"times in us (CUDA-graph replay, median; {weights}); ratios are speedups (>1 = ours faster)",
        head,
    ]
    for n, k, m in sorted({(r["n"], r["k"], r["m"]) for r in rows}):
        t = {name: by.get((n, k, m, name)) for name in names}
        cells = " ".join(f"{t[x]:>{width[x]}.1f}" if t[x] else f"{'-':>{width[x]}}" for x in names)
        anchors = [t[a] for a in ANCHORS if t[a]]
        ours = t["fp8compile"]
        r1 = f"{t['bf16'] / ours:9.2f}" if ours and t["bf16"] else f"{'-':>9}"
        r2 = f"{min(anchors) / ours:16.2f}" if ours and anchors else f"{'-':>16}"
        r3 = (
            f"{t['deep_gemm'] / t['triton_gemm']:7.2f}"
            if t["triton_gemm"] and t["deep_gemm"]
            else f"{'-':>7}"
        )
        r4 = (
            f"{t['bf16'] / t['fp8compile_tuned']:11.2f}"
            if t["fp8compile_tuned"] and t["bf16"]
            else f"{'-':>11}"
        )
        r5 = f"{t['read'] / ours:10.2f}" if ours and t["read"] else f"{'-':>10}"
        lines.append(f"{n:>6} {k:>6} {m:>5} {cells}   {r1} {r2} {r3}{r4} {r5}")
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    shapes = sorted({(r["n"], r["k"]) for r in rows})
    fig, axes = plt.subplots(2, len(shapes), figsize=(4 * len(shapes), 7), squeeze=False)
    for col, (n, k) in enumerate(shapes):
        for variant in sorted({r["variant"] for r in rows}):
            pts = sorted(
                (r["m"], r) for r in rows if (r["n"], r["k"], r["variant"]) == (n, k, variant) and r["us"]
            )
            if not pts:
                continue
            style = dict(marker="o", lw=2.5 if variant == "fp8compile" else 1, label=variant)
            axes[0][col].plot([m for m, _ in pts], [r["tflops"] for _, r in pts], **style)
            axes[1][col].plot([m for m, _ in pts], [r["weight_tbps"] for _, r in pts], **style)
        axes[0][col].set_title(f"N={n} K={k}")
        for row, label in ((0, "TFLOP/s"), (1, "weight TB/s")):
            axes[row][col].set_xscale("log", base=2)
            axes[row][col].set_xlabel("M")
            axes[row][col].set_ylabel(label)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"fp8compile linear vs anchors, {rows[0]['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
