"""Probe (one session): what the routed experts' two Gluon GEMM calls cost the host inside a
default-mode Qwen3-MoE prefill, and what Triton GEMMs launched by Inductor in their place give.

    python scripts/moe_prefill_host_probe.py VARIANT LAYERS    # VARIANT: bf16 fp8 fp8_triton fp8_stub

fp8_triton: FP8COMPILE_PROBE_MOE_GEMM=triton (set by the caller), moe_gluon's GEMMs as
_moe_gemm_kernel launches. fp8_stub: fp8compile::gluon_grouped_gemm answers a kept tensor and
launches nothing (wrong numbers; the host time without the calls). Qwen3-30B-A3B widths, 2048-token
prefill, host time to return and wall time of STEPS calls, medians; JSON line to $OUT.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

import fp8compile
from fp8compile.bench import model as bm
from fp8compile.numerics import calc_diff

OUT = Path(os.environ.get("OUT", "/tmp/out"))
VARIANT, LAYERS = sys.argv[1], int(sys.argv[2])
STEPS = int(os.environ.get("STEPS", "100"))


def stub_gluon_gemm() -> None:
    kept: dict = {}

    def stub(a, a_scale, w_fp8, w_scale, block_expert, bias=None, block_m=64):
        key = (a.shape[0], w_fp8.shape[1])
        if key not in kept:
            kept[key] = torch.zeros(*key, dtype=torch.bfloat16, device=a.device)
        return kept[key]

    lib = torch.library.Library("fp8compile", "IMPL")
    lib.impl("gluon_grouped_gemm", stub, "CUDA")
    stub_gluon_gemm.lib = lib  # keep the registration alive


def main() -> None:
    if VARIANT == "fp8_stub":
        stub_gluon_gemm()
    model = bm.build("qwen3-30b-a3b", LAYERS, "cuda")
    backend = "inductor" if VARIANT == "bf16" else fp8compile.backend()
    compiled = torch.compile(model, backend=backend)
    ids = torch.randint(0, model.config.vocab_size, (1, 2048), device="cuda")
    start = time.perf_counter()
    compiled(torch.randint(0, 1000, (1, 64), device="cuda"), use_cache=False)
    logits = compiled(ids, use_cache=False, logits_to_keep=1).logits
    torch.cuda.synchronize()
    first_s = time.perf_counter() - start
    for _ in range(5):
        compiled(ids, use_cache=False, logits_to_keep=1)
    torch.cuda.synchronize()
    hosts, walls = [], []
    for _ in range(STEPS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        compiled(ids, use_cache=False, logits_to_keep=1)
        hosts.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - start) * 1e3)
    # The same calls behind a long GPU sleep: the host enqueues the whole prefill while the GPU
    # runs nothing of it, so its time is its own work (or, if it blocks, the launch queue is full).
    busy = []
    for _ in range(10):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)
        start = time.perf_counter()
        compiled(ids, use_cache=False, logits_to_keep=1)
        busy.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        for _ in range(3):
            compiled(ids, use_cache=False, logits_to_keep=1)
        torch.cuda.synchronize()
    gpu_ms = sum(e.self_device_time_total for e in prof.key_averages()) / 3 / 1e3
    reference = model(ids, use_cache=False, logits_to_keep=1).logits
    row = dict(
        variant=VARIANT,
        layers=LAYERS,
        host_ms=sorted(hosts)[len(hosts) // 2],
        wall_ms=sorted(walls)[len(walls) // 2],
        host_ms_gpu_asleep=sorted(busy)[len(busy) // 2],
        gpu_ms=gpu_ms,
        first_s=first_s,
        calc_diff=float(calc_diff(logits.double(), reference.double())),
    )
    print(json.dumps(row))
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "moe_prefill_host_probe.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    if os.environ.get("KEEP_WRAPPERS"):  # the Inductor wrappers of this run, to read their launches
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        for path in Path(cache_dir()).rglob("*.py"):
            text = path.read_text(errors="replace")
            if "def call(" in text and "fp8compile" in text:
                (OUT / f"wrapper_{VARIANT}_{path.name}").write_text(text)


if __name__ == "__main__":
    with torch.no_grad():
        main()
