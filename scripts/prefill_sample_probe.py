"""Probe (one session): where the default-mode prefill's host time goes, by sampling, not cProfile.

Run under `py-spy record -f raw` (line numbers on), one variant per process:
    py-spy record -r 2000 -f raw -o $OUT/fp8.txt -- python scripts/prefill_sample_probe.py fp8 8
Builds Qwen3-30B-A3B widths with LAYERS layers, compiles in default mode, warms up a 2048-token
prefill, then times STEPS prefills (host time to return, then a synchronize). Copies the Inductor
wrapper modules the samples name into $OUT/wrappers, so their line numbers can be read.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import torch

import fp8compile
from fp8compile.bench import model as bm

OUT = Path(os.environ.get("OUT", "/tmp/out"))
VARIANT, LAYERS = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0
STEPS = int(os.environ.get("STEPS", "40"))
WRAPPER = re.compile(r"\(c[a-z0-9]{51}\.py:")  # py-spy names an Inductor wrapper by its hash file name


def run() -> None:
    model = bm.build("qwen3-30b-a3b", LAYERS, "cuda")
    backend = fp8compile.backend() if VARIANT == "fp8" else "inductor"
    compiled = torch.compile(model, backend=backend)
    compiled(torch.randint(0, 1000, (1, 64), device="cuda"), use_cache=False)
    ids = torch.randint(0, model.config.vocab_size, (1, 2048), device="cuda")

    def step():
        compiled(ids, use_cache=False, logits_to_keep=1)

    for _ in range(5):  # warm-up (lazy compiles, autotuning) outside `step`, which the summary reads
        compiled(ids, use_cache=False, logits_to_keep=1)
    torch.cuda.synchronize()
    hosts, walls = [], []
    for _ in range(STEPS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        hosts.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - start) * 1e3)
    print(VARIANT, "host ms", sorted(hosts)[len(hosts) // 2], "wall ms", sorted(walls)[len(walls) // 2])
    (OUT / f"{VARIANT}_{LAYERS}_times.json").write_text(json.dumps(dict(host_ms=hosts, wall_ms=walls)))
    profile(compiled, ids)
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    wrappers = OUT / f"wrappers_{VARIANT}"
    wrappers.mkdir(exist_ok=True)
    for path in Path(cache_dir()).rglob("*.py"):
        text = path.read_text(errors="replace")
        if "def call(" in text and len(text) > 20000:
            shutil.copy(path, wrappers / path.name)


def profile(compiled, ids, calls: int = 3) -> None:
    """torch.profiler over a few prefills: host time per op and CUDA runtime call (a hidden
    synchronize shows as cudaStreamSynchronize / cudaMemcpy / cudaMalloc), GPU time per kernel."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            compiled(ids, use_cache=False, logits_to_keep=1)
        torch.cuda.synchronize()
    rows = [
        dict(
            name=e.key[:120],
            count=e.count // calls,
            self_cpu_us=e.self_cpu_time_total / calls,
            cpu_us=e.cpu_time_total / calls,
            device_us=e.self_device_time_total / calls,
        )
        for e in prof.key_averages()
    ]
    by_cpu = sorted(rows, key=lambda r: -r["self_cpu_us"])[:60]
    by_gpu = sorted(rows, key=lambda r: -r["device_us"])[:40]
    gpu_total = sum(r["device_us"] for r in rows)
    (OUT / f"{VARIANT}_{LAYERS}_profile.json").write_text(
        json.dumps(dict(gpu_us_per_call=gpu_total, by_self_cpu=by_cpu, by_gpu=by_gpu), indent=1)
    )


def summarize(raw: Path, top: int = 45) -> dict:
    """py-spy's raw stacks ("f (file:line);...;g (file:line) count") of the timed steps only:
    self time per function, inclusive time per line of the Inductor wrapper modules."""
    leaf, lines, calls, total, waiting = {}, {}, {}, 0, 0
    for row in raw.read_text().splitlines():
        stack, _, count = row.rpartition(" ")
        count = int(count)
        frames = stack.split(";")
        at = [i for i, f in enumerate(frames) if f.split(" (")[0].endswith("step") and "probe.py" in f]
        if not at:
            continue
        frames = frames[at[0] + 1 :]
        if any("convert_frame" in f for f in frames):  # a (re)compile, not a timed step
            continue
        total += count
        if any("synchronize" in f for f in frames):
            waiting += count
            continue
        name = frames[-1].rpartition(":")[0] if frames else "step"
        leaf[name] = leaf.get(name, 0) + count
        for f in set(frames):
            if WRAPPER.search(f):
                lines[f] = lines.get(f, 0) + count
        # inclusive time of each call site: the calling line and the function it calls
        for edge in {(a, b.rpartition(" (")[0]) for a, b in zip(frames, frames[1:])}:
            site = f"{edge[0]} -> {edge[1]}"
            calls[site] = calls.get(site, 0) + count
    busy = total - waiting
    return dict(
        samples=total,
        waiting=waiting,
        leaf=sorted(((c / busy, n) for n, c in leaf.items()), reverse=True)[:top],
        wrapper_lines=sorted(((c / busy, n) for n, c in lines.items()), reverse=True)[: top * 3],
        call_sites=sorted(((c / busy, n) for n, c in calls.items()), reverse=True)[: top * 4],
    )


if VARIANT == "summarize":
    for raw in sorted(OUT.glob("*.txt")):
        (OUT / f"{raw.stem}_summary.json").write_text(json.dumps(summarize(raw), indent=1))
        probe_rows = [row for row in raw.read_text().splitlines() if "probe.py" in row]
        (OUT / f"{raw.stem}_rows_sample.txt").write_text("\n".join(probe_rows[:300]))
        raw.unlink()
else:
    with torch.no_grad():
        run()
