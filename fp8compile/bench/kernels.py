"""Kernel and layer benchmarks: `python -m fp8compile bench gemm | mlp | moe | tune`.

Timing: each variant is captured in a CUDA graph and replayed (triton.testing.do_bench_cudagraph,
median), so launch overhead does not hide the kernels, as in a decode loop under CUDA graphs.
Each graph runs the variant over R copies of the weights whose total is >= 4x the L2 cache:
every call streams its weights from HBM, as in a real model. Times are per call, in us.
Inputs are pre-quantized for cuBLAS FP8, DeepGEMM and our Triton GEMM (GEMM alone); FlashInfer,
triton_small_m and fp8compile (the compiled nn.Linear) take bf16 and quantize themselves.
"""
from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import torch

import fp8compile

from .output import pyplot

SHAPES = [(4096, 7168), (14336, 4096), (4096, 14336), (24576, 1536), (7168, 2048)]  # (N, K)
MS = [1, 16, 32, 128, 1024, 4096]
ANCHORS = ("deep_gemm", "flashinfer", "cublas_fp8")


def _copies(bytes_each: int) -> int:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(1, min(16, math.ceil(4 * l2 / bytes_each)))


def _time_us(fns) -> float | None:
    """Median us per call of one of `fns` (a list of zero-arg callables run back to back)."""
    import triton.testing

    try:
        for fn in fns:  # warm up: JIT, autotune, allocator
            fn()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench_cudagraph(lambda: [fn() for fn in fns], rep=30, return_mode="median")
    except Exception as e:  # a backend that cannot run this shape: report, keep going
        print(f"    failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        torch.cuda.synchronize()
        return None
    return ms * 1000 / len(fns)


class _Shape:
    """Everything that depends on (N, K) only: R weight copies (bf16 and FP8) and R nn.Linear
    modules compiled with backend="fp8" and dynamic M. One compiled graph serves every copy
    (same class, same shapes) and every M >= 2; Dynamo specializes M = 1 into a second graph."""

    def __init__(self, n: int, k: int):
        from fp8compile.ops import reference

        torch._dynamo.reset()
        self.n, self.k = n, k
        r8, r16 = _copies(n * k), _copies(2 * n * k)
        self.w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(max(r8, r16))]
        self.r16 = r16
        self.w8 = [reference.quant_weight_block(w) for w in self.w16[:r8]]
        self.linears, self.tuned = [], []
        fp8 = fp8compile.backend()  # the object, not the entry point: runs from a source tree too
        fp8_tuned = fp8compile.backend(autotune=True)
        for w in self.w16[:r8]:
            lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
            lin.weight.data.copy_(w)
            self.linears.append(torch.compile(lin, backend=fp8, dynamic=True))
            self.tuned.append(torch.compile(lin, backend=fp8_tuned, dynamic=True))

    def variants(self, m: int) -> dict:
        """name -> list of zero-arg callables, one per weight copy."""
        from fp8compile.ops import triton_gemm, triton_quant, vendors

        x = torch.randn(m, self.k, device="cuda", dtype=torch.bfloat16)
        x_fp8_row, x_scale_row = triton_quant.quant_act(x)
        x_fp8, x_scale_tma = triton_quant.quant_act(x, layout="mn_major")
        _, x_scale_col = triton_quant.quant_act(x, layout="col")
        out = torch.empty(m, self.n, device="cuda", dtype=torch.bfloat16)
        v = {"bf16": [lambda w=w: torch.nn.functional.linear(x, w) for w in self.w16[:self.r16]]}
        v["cublas_fp8"] = [lambda q=q: torch._scaled_mm(x_fp8, q[0].t(), scale_a=x_scale_col, scale_b=q[1].t(),
                                                         out_dtype=torch.bfloat16) for q in self.w8]
        if vendors.import_error("deep_gemm") is None:
            import deep_gemm

            v["deep_gemm"] = [lambda q=q: deep_gemm.fp8_gemm_nt((x_fp8, x_scale_tma), q, out, disable_ue8m0_cast=True)
                              for q in self.w8]
        if vendors.import_error("flashinfer") is None:
            from flashinfer.gemm import fp8_blockscale_gemm_sm90

            v["flashinfer"] = [lambda q=q: fp8_blockscale_gemm_sm90(x, q[0], None, q[1], out_dtype=torch.bfloat16)
                               for q in self.w8]
        if m <= triton_gemm.SMALL_M_MAX:
            v["triton_small_m"] = [lambda q=q: triton_gemm.linear_small_m(x, *q) for q in self.w8]
        if m >= 128:
            v["triton_gemm"] = [lambda q=q: triton_gemm.gemm_large_m(x_fp8_row, x_scale_row, *q) for q in self.w8]
        # what a user pays: the compiled nn.Linear, activation quantization and M dispatch included
        v["fp8compile"] = [lambda f=f: f(x) for f in self.linears]
        v["fp8compile_tuned"] = [lambda f=f: f(x) for f in self.tuned]  # Fp8Config(autotune=True)
        return v


def bench_gemm(out_dir: Path, shapes=SHAPES, ms=MS, skip=()) -> list[dict]:
    """skip: variant names to leave out (fp8compile_tuned alone times ~100 kernels per shape)."""
    from tqdm import tqdm

    rows = []
    device = torch.cuda.get_device_name(0)
    with torch.no_grad(), tqdm(total=len(shapes) * len(ms), desc="bench gemm") as progress:
        for n, k in shapes:
            shape = _Shape(n, k)
            for m in ms:
                for name, fns in shape.variants(m).items():
                    if name in skip:
                        continue
                    us = _time_us(fns)
                    rows.append(dict(device=device, n=n, k=k, m=m, variant=name, us=us,
                                     tflops=None if us is None else 2 * m * n * k / us / 1e6,
                                     weight_tbps=None if us is None
                                     else n * k * (2 if name == "bf16" else 1) / us / 1e6))
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
    names = ["bf16", "cublas_fp8", "deep_gemm", "flashinfer", "triton_small_m", "triton_gemm", "fp8compile",
             "fp8compile_tuned"]
    width = {name: max(11, len(name)) for name in names}
    head = (f"{'N':>6} {'K':>6} {'M':>5} " + " ".join(f"{n:>{width[n]}}" for n in names)
            + "   ours/bf16 ours/best_anchor tri/dg tuned/bf16")
    lines = ["times in us (CUDA-graph replay, median); ratios are speedups (>1 = ours faster)", head]
    for (n, k, m) in sorted({(r["n"], r["k"], r["m"]) for r in rows}):
        t = {name: by.get((n, k, m, name)) for name in names}
        cells = " ".join(f"{t[x]:>{width[x]}.1f}" if t[x] else f"{'-':>{width[x]}}" for x in names)
        anchors = [t[a] for a in ANCHORS if t[a]]
        ours = t["fp8compile"]
        r1 = f"{t['bf16'] / ours:9.2f}" if ours and t["bf16"] else f"{'-':>9}"
        r2 = f"{min(anchors) / ours:16.2f}" if ours and anchors else f"{'-':>16}"
        r3 = f"{t['deep_gemm'] / t['triton_gemm']:7.2f}" if t["triton_gemm"] and t["deep_gemm"] else f"{'-':>7}"
        r4 = f"{t['bf16'] / t['fp8compile_tuned']:11.2f}" if t["fp8compile_tuned"] and t["bf16"] else f"{'-':>11}"
        lines.append(f"{n:>6} {k:>6} {m:>5} {cells}   {r1} {r2} {r3}{r4}")
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    shapes = sorted({(r["n"], r["k"]) for r in rows})
    fig, axes = plt.subplots(2, len(shapes), figsize=(4 * len(shapes), 7), squeeze=False)
    for col, (n, k) in enumerate(shapes):
        for variant in sorted({r["variant"] for r in rows}):
            pts = sorted((r["m"], r) for r in rows if (r["n"], r["k"], r["variant"]) == (n, k, variant) and r["us"])
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


MLPS = {"llama3-8b": (4096, 14336), "qwen2.5-7b": (3584, 18944)}  # (hidden, intermediate), bias-free
MLP_MS = [1, 16, 128, 4096]


def _save(out_dir: Path, name: str, rows: list[dict], table) -> list[dict]:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / name).write_text(json.dumps(rows, indent=1))
    print(table(rows))
    return rows


def _variant_rows(compile_variant, variants, inputs, row, report=False):
    """Time every variant on every input, one variant at a time: Dynamo is reset before each,
    so no variant runs out of its recompile budget (a code object shared by several backends
    keeps at most torch._dynamo.config.cache_size_limit graphs, then silently runs eagerly)."""
    rows = []
    for variant in variants:
        torch._dynamo.reset()
        fns = compile_variant(variant)
        for key, x in inputs:
            us = _time_us([lambda f=f: f(x) for f in fns])
            rows.append(row(variant, key, us))
        if report and isinstance(variants[variant], fp8compile.Fp8Backend):
            print(f"{variant}: {variants[variant].report}")
    return rows


def bench_mlp(out_dir: Path, ms=MLP_MS, mlps=MLPS, device: str = "cuda") -> list[dict]:
    """Gated MLP down(silu(gate(x)) * up(x)): bf16 torch.compile (Inductor) vs the fp8 backend
    with every fusion (`fp8`: gate and up as one GEMM, silu_mul fused into the down projection),
    with gate and up as two GEMMs (`fp8_gate_up_apart`: fusions=("silu_mul",)), and with no
    fusion (`fp8_unfused`). One compiled graph per variant and model serves every weight copy and
    every M >= 2 (dynamic M)."""
    from tqdm import tqdm

    from fp8compile.demo import GatedMLP

    rows = []
    device_name = torch.cuda.get_device_name(0) if device == "cuda" else device
    backends = {"bf16_inductor": "inductor", "fp8_unfused": fp8compile.backend(fusions=()),
                "fp8_gate_up_apart": fp8compile.backend(fusions=("silu_mul",)), "fp8": fp8compile.backend()}
    with torch.no_grad():
        for model_name, (hidden, inter) in tqdm(mlps.items(), desc="bench mlp"):
            copies = [GatedMLP(hidden, inter).to(device, torch.bfloat16) for _ in range(_copies(3 * hidden * inter))]
            inputs = [(m, torch.randn(m, hidden, device=device, dtype=torch.bfloat16)) for m in ms]
            rows += _variant_rows(
                lambda v: [torch.compile(c, backend=backends[v]) for c in copies], backends, inputs,
                lambda v, m, us: dict(device=device_name, model=model_name, hidden=hidden, inter=inter, m=m, variant=v,
                                      us=us, weight_tbps=None if us is None else
                                      3 * hidden * inter * (2 if v == "bf16_inductor" else 1) / us / 1e6))
            copies = None  # free this model before the next
            torch.cuda.empty_cache()
    return _save(out_dir, "bench_mlp.json", rows, mlp_table)


MLP_COLUMNS = ("bf16_inductor", "fp8_unfused", "fp8_gate_up_apart", "fp8")


def mlp_table(rows: list[dict]) -> str:
    by = {(r["model"], r["m"], r["variant"]): r["us"] for r in rows}
    lines = ["times in us (CUDA-graph replay, median); ratios are speedups of fp8 (>1 = fp8 faster)",
             f"{'model':<12} {'M':>5} " + " ".join(f"{v:>17}" for v in MLP_COLUMNS)
             + "  vs_bf16 vs_unfused vs_gate_up_apart"]
    for model, m in sorted({(r["model"], r["m"]) for r in rows}, key=lambda t: (t[0], t[1])):
        t = {v: by.get((model, m, v)) for v in MLP_COLUMNS}
        cells = " ".join(f"{t[v]:>17.1f}" if t[v] else f"{'-':>17}" for v in MLP_COLUMNS)
        ratios = " ".join(f"{t[v] / t['fp8']:>{w}.2f}" if t["fp8"] and t[v] else f"{'-':>{w}}"
                          for v, w in (("bf16_inductor", 8), ("fp8_unfused", 10), ("fp8_gate_up_apart", 16)))
        lines.append(f"{model:<12} {m:>5} {cells}  {ratios}")
    return "\n".join(lines)


# (hidden, moe_intermediate, experts, top_k): Qwen3-30B-A3B and DeepSeek-V3 (all 256 experts:
# 22.5 GB of bf16 expert weights plus their 11 GB FP8 copy fit an H200 or an H100).
MOE_LAYERS = {"qwen3-30b-a3b": (2048, 768, 128, 8), "deepseek-v3": (7168, 2048, 256, 8)}
MOE_TOKENS = [1, 16, 128, 1024, 4096]


def _moe_block(hidden: int, inter: int, experts: int, top_k: int):
    """transformers' Qwen3MoeSparseMoeBlock (router, top-k, experts under "grouped_mm") on the GPU."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                         num_experts_per_tok=top_k, norm_topk_prob=True)
    cfg._experts_implementation = "grouped_mm"
    with torch.device("cuda"):
        block = Qwen3MoeSparseMoeBlock(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    return block


def _deep_gemm_experts(block, tokens: int, top_k: int):
    """DeepGEMM's two grouped GEMMs alone, on this routing's contiguous layout (pre-quantized
    inputs): the anchor for the experts' GEMM time, without routing, activation or top-k sum."""
    import deep_gemm

    from fp8compile.ops.triton_moe import route
    from fp8compile.ops.triton_quant import quant_act
    from fp8compile.weights import fp8_experts

    experts = block.experts
    num_experts, two_i, hidden = experts.gate_up_proj.shape
    w13, w2 = fp8_experts(experts.gate_up_proj, gate_up="concat"), fp8_experts(experts.down_proj)
    ids = torch.topk(torch.rand(tokens, num_experts, device="cuda"), top_k, dim=-1).indices
    slots, block_expert = route(ids, num_experts, deep_gemm.get_mk_alignment_for_contiguous_layout())
    rows = slots.numel()
    row_expert = torch.where(slots < ids.numel(), block_expert.repeat_interleave(rows // block_expert.numel()), -1)
    a = quant_act(torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16), layout="mn_major")
    h = quant_act(torch.randn(rows, two_i // 2, device="cuda", dtype=torch.bfloat16), layout="mn_major")
    c1 = torch.empty(rows, two_i, device="cuda", dtype=torch.bfloat16)
    c2 = torch.empty(rows, hidden, device="cuda", dtype=torch.bfloat16)

    def run():
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, w13, c1, row_expert, disable_ue8m0_cast=True)
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(h, w2, c2, row_expert, disable_ue8m0_cast=True)
    return run


def bench_moe(out_dir: Path, tokens=MOE_TOKENS, layers=MOE_LAYERS) -> list[dict]:
    """A routed-experts layer (router + top-k + experts): bf16 torch.compile (Inductor, grouped_mm)
    vs the fp8 backend (default kernels, and Triton only) vs DeepGEMM's grouped GEMMs alone.
    One compiled graph per variant serves every token count >= 2 (dynamic tokens)."""
    from tqdm import tqdm

    rows = []
    device_name = torch.cuda.get_device_name(0)
    backends = {"bf16_inductor": "inductor", "fp8": fp8compile.backend(),
                "fp8_triton": fp8compile.backend(backends=("triton", "reference"))}
    with torch.no_grad():
        for name, (hidden, inter, experts, top_k) in tqdm(layers.items(), desc="bench moe"):
            block = _moe_block(hidden, inter, experts, top_k)
            expert_bytes = 3 * hidden * inter  # FP8 bytes of one expert
            active = {}  # experts a routing of t tokens touches (router of random weights)
            inputs = []
            for t in tokens:
                x = torch.randn(1, t, hidden, device="cuda", dtype=torch.bfloat16)
                torch._dynamo.mark_dynamic(x, 1)
                inputs.append((t, x))
                logits = torch.nn.functional.linear(x.view(t, hidden), block.gate.weight)
                active[t] = int(torch.topk(logits, top_k).indices.unique().numel())

            def row(variant, t, us):
                streamed = active[t] * expert_bytes * (2 if variant == "bf16_inductor" else 1)
                return dict(device=device_name, layer=name, hidden=hidden, inter=inter, experts=experts, top_k=top_k,
                            tokens=t, variant=variant, us=us, active_experts=active[t],
                            weight_tbps=None if us is None else streamed / us / 1e6)

            rows += _variant_rows(lambda v: [torch.compile(block, backend=backends[v])], backends, inputs, row,
                                  report=True)
            for t, _ in inputs:
                try:
                    rows.append(row("deep_gemm_gemms", t, _time_us([_deep_gemm_experts(block, t, top_k)])))
                except Exception as e:  # DeepGEMM missing or failing: the other columns still count
                    print(f"    deep_gemm_gemms: {type(e).__name__}: {str(e)[:120]}")
            block = None  # free this layer before the next
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    return _save(out_dir, "bench_moe.json", rows, moe_table)


def moe_table(rows: list[dict]) -> str:
    variants = ("bf16_inductor", "fp8", "fp8_triton", "deep_gemm_gemms")
    by = {(r["layer"], r["tokens"], r["variant"]): r["us"] for r in rows}
    lines = ["times in us (CUDA-graph replay, median); ratios are speedups (>1 = faster)",
             f"{'layer':<14} {'tokens':>6} " + " ".join(f"{v:>15}" for v in variants)
             + "   fp8/bf16 fp8/dg_gemms"]
    for layer, t in sorted({(r["layer"], r["tokens"]) for r in rows}):
        us = {v: by.get((layer, t, v)) for v in variants}
        cells = " ".join(f"{us[v]:>15.1f}" if us[v] else f"{'-':>15}" for v in variants)
        r1 = f"{us['bf16_inductor'] / us['fp8']:10.2f}" if us["fp8"] and us["bf16_inductor"] else f"{'-':>10}"
        r2 = f"{us['deep_gemm_gemms'] / us['fp8']:12.2f}" if us["fp8"] and us["deep_gemm_gemms"] else f"{'-':>12}"
        lines.append(f"{layer:<14} {t:>6} {cells}   {r1} {r2}")
    return "\n".join(lines)


# Large-M candidates: (tile config, activation-scale layout). BLOCK_N divides 128 (one weight
# scale per tile and group); 128x256 and 256x128 tiles spilled in the first sweep
# (benchmarks/tune_h200_first.json: 235-311 TFLOP/s against 520-630).
LARGE_M_SWEEP = [
    (dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=4), "row"),
    (dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4), "row"),
    (dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=4, tma=True), "row"),
    (dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=5, tma=True), "row"),
    (dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=4, tma=True), "row"),
    (dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, tma=True), "row"),
    (dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4, tma=True), "row"),
    (dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4, tma=True), "mn_major"),
    (dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=4, tma=True), "mn_major"),
    (dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=4, tma=True, persistent=2), "row"),
    (dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, tma=True, persistent=1), "row"),
    (dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4, tma=True, persistent=1), "row"),
    (dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4, tma=True, persistent=1), "mn_major"),
]


def _deep_gemm_us(x_q, w8, n: int) -> float | None:
    import deep_gemm

    out = torch.empty(x_q[0].shape[0], n, device="cuda", dtype=torch.bfloat16)
    return _time_us([lambda q=q: deep_gemm.fp8_gemm_nt(x_q, q, out, disable_ue8m0_cast=True) for q in w8])


def tune(out_dir: Path, shapes=SHAPES, kernels=("small_m", "large_m")) -> dict:
    """Sweep the Triton kernels' tile constants; print the best fixed choice by geometric mean.
    kernels: "small_m", "large_m", and "tiles" (the large-M GEMM's 64- against 128-row tiles by
    M, and whether they give the same bits)."""
    from fp8compile.ops import reference, triton_gemm, triton_quant, vendors

    from tqdm import tqdm

    results = {"small_m": [], "large_m": [], "tiles": []}
    with torch.no_grad():
        for n, k in tqdm(shapes, desc="tune"):
            r8 = _copies(n * k)
            w8 = [reference.quant_weight_block(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
                  for _ in range(r8)]
            for m in (1, 16, 32) if "small_m" in kernels else ():
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                for block_n, ppsm, stages in itertools.product((32, 64, 128), (1, 2, 4, 8), (3, 4)):
                    n_blocks = math.ceil(n / block_n)
                    sms = torch.cuda.get_device_properties(0).multi_processor_count
                    split = max(1, min(k // 128, round(ppsm * sms / n_blocks)))
                    us = _time_us([lambda q=q: triton_gemm.linear_small_m(x, *q, split_k=split, block_n=block_n,
                                                                          num_stages=stages) for q in w8])
                    results["small_m"].append(dict(n=n, k=k, m=m, block_n=block_n, ppsm=ppsm, stages=stages,
                                                   split=split, us=us, weight_tbps=us and n * k / us / 1e6))
            for m in (1024, 4096) if "large_m" in kernels else ():
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                x_q = {layout: triton_quant.quant_act(x, layout=layout) for layout in ("row", "mn_major")}
                dg = _deep_gemm_us(x_q["mn_major"], w8[:2], n) if vendors.import_error("deep_gemm") is None else None
                first = None
                for cfg, layout in LARGE_M_SWEEP:
                    cfg = {"GROUP_M": 8, "tma": False, **cfg}
                    try:  # every candidate must compute what the first one does
                        out = triton_gemm.gemm_large_m(*x_q[layout], *w8[0], config=cfg)
                        first = out if first is None else first
                        agrees = fp8compile.calc_diff(out, first) < 1e-6
                    except Exception as e:
                        print(f"    {cfg}: failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                        agrees = False
                    # a candidate that fails or disagrees is not timed: no time, TFLOP/s or ratio for it
                    us = agrees and _time_us([lambda q=q: triton_gemm.gemm_large_m(*x_q[layout], *q, config=cfg)
                                              for q in w8[:2]]) or None
                    results["large_m"].append(dict(n=n, k=k, m=m, **{"persistent": 0, **cfg},
                                                   scales=layout, agrees=agrees, us=us,
                                                   tflops=us and 2 * m * n * k / us / 1e6, deep_gemm_us=dg,
                                                   vs_deep_gemm=us and dg and dg / us))
            for m in (64, 128, 256, 512, 1024, 2048) if "tiles" in kernels else ():
                x_q = triton_quant.quant_act(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
                small, large = triton_gemm.SMALL_TILE_CONFIG, triton_gemm.LARGE_M_CONFIG
                same = torch.equal(triton_gemm.gemm_large_m(*x_q, *w8[0], config=small),
                                   triton_gemm.gemm_large_m(*x_q, *w8[0], config=large))
                us = {name: _time_us([lambda q=q: triton_gemm.gemm_large_m(*x_q, *q, config=cfg) for q in w8[:2]])
                      for name, cfg in (("small_tiles", small), ("large_tiles", large))}
                results["tiles"].append(dict(n=n, k=k, m=m, same_bits=same, **us))
                print(f"   N={n} K={k} M={m}: 64-row tiles {us['small_tiles']:.1f} us, 128-row tiles "
                      f"{us['large_tiles']:.1f} us, same bits: {same}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tune.json").write_text(json.dumps(results, indent=1))
    large_keys = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "tma", "persistent", "scales")
    for kind, keys in (("small_m", ("block_n", "ppsm", "stages")), ("large_m", large_keys)):
        if not results[kind]:
            continue
        groups: dict[tuple, list] = {}
        for r in results[kind]:
            groups.setdefault(tuple(r[key] for key in keys), []).append(r["us"])
        scored = sorted((math.exp(sum(map(math.log, ts)) / len(ts)), cfg) for cfg, ts in groups.items() if all(ts))
        print(f"{kind}: best fixed configs by geometric-mean time over shapes x M ({', '.join(keys)}):")
        for score, cfg in scored[:5]:
            print(f"   {cfg}: {score:.1f} us")
        best_each = {}
        for r in results[kind]:
            key = (r["n"], r["k"], r["m"])
            if r["us"] and (key not in best_each or r["us"] < best_each[key]["us"]):
                best_each[key] = r
        for key, r in sorted(best_each.items()):
            print(f"   best for N={key[0]} K={key[1]} M={key[2]}: {tuple(r[x] for x in keys)} {r['us']:.1f} us"
                  + (f" ({r['weight_tbps']:.2f} TB/s)" if kind == "small_m" else
                     f" ({r['tflops']:.0f} TFLOP/s, DeepGEMM/ours {r['vs_deep_gemm'] or 0:.2f})"))
    return results
