"""A model as users run it: generate() with a static cache, its decode step compiled by
transformers (GenerationConfig.compile_config), bf16 Inductor beside backend="fp8" in one mode.

Each side runs generate() once to compile and warm up, then REPEAT times timed; timed, the sides
run in the order TIMED_ORDER and the first block's time is dropped. Reported: tokens/s of the mean
of each side's two median calls, every block's median (`blocks`), the graphs compiled during the
timed calls (recompiles after warm-up: none is right), and for fp8 whether its graphs replay CUDA
graphs, and why not. A small model's decode step is host-bound (1.1-2.0 ms per step, of it about
0.2 ms of GPU time: Qwen2, Llama and GPT-OSS at 2 layers on an H200), and the time of one call
is noisy: GPT-OSS's fp8 over bf16 ratio read 0.58x in one run and 1.08x in a later one (H200,
2026-11-27), while the profiler saw fp8's steps take no more host time than bf16's. A ratio
stands on medians, and on both sides' runs placed alike in the process. `null=True` times bf16
Inductor on both sides: the ratio the method reads where nothing differs, its noise floor.

The architecture matrix runs this per architecture and mode (`python -m fp8compile models
--generate`); a crash is a row of its own.
"""

from __future__ import annotations

import dataclasses
import statistics
from time import perf_counter

import torch

PROMPT, NEW_TOKENS = 32, 32
REPEAT = 5  # timed generate() calls per side and mode (their median)


@dataclasses.dataclass
class Decode:
    """One mode's generate() of one architecture, bf16 Inductor beside fp8."""

    mode: str
    bf16_tokens_per_s: float | None = None
    fp8_tokens_per_s: float | None = None
    recompiles: int | None = None  # fp8's graphs compiled in its timed calls
    cuda_graphs: str = ""  # fp8's: "on", or each graph's reason where off
    error: str = ""  # the side and the exception, where one raised
    null: bool = False  # both sides bf16 Inductor (the method's noise floor)
    blocks: list = dataclasses.field(default_factory=list)  # [side, median s of its block], in order


# Timed, the sides run in this order and the first block is not counted. The first side timed
# in a process ran faster in StableLM's runs (2 layers, H200: bf16 1.47 and fp8 1.67 ms/step in
# that order, fp8 1.58 and bf16 1.81 in the other); dropping the first block and timing fp8, bf16,
# bf16, fp8 gives each side two blocks at the same mean position, neither of them the first. The
# blocks still spread more than their calls do, each its own compile (BENCHMARKS.md, "The timing's
# noise floor": --null reads 0.78x-1.62x at 2 layers).
TIMED_ORDER = ("bf16", "fp8", "bf16", "bf16", "fp8")
UNTIMED_BLOCKS = 1


def decode(model, mode: str, device: str, timed: bool, batch: int = 1, null: bool = False) -> Decode:
    """generate() on model in mode ("default" or "reduce-overhead"), bf16 Inductor beside fp8.
    timed: measure tokens/s (on a GPU; on the CPU the check is that it runs, each side once).
    null: bf16 Inductor on the "fp8" side too, to read the ratio of two equal sides."""
    import fp8compile

    result = Decode(mode, null=null)
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, PROMPT), device=device)
    seconds: dict[str, list[float]] = {"bf16": [], "fp8": []}
    result.recompiles = 0
    for block, side in enumerate(TIMED_ORDER if timed else ("bf16", "fp8")):
        backend = fp8compile.backend() if side == "fp8" and not null else "inductor"
        try:
            took, recompiles = _generate_timed(model, ids, backend, mode, REPEAT if timed else 1)
        except Exception as error:  # noqa: BLE001  a row of the matrix: a crash is what it must show
            result.error = f"{side}: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
            result.recompiles = None
            return result
        result.blocks.append([side, took])
        if not timed or block >= UNTIMED_BLOCKS:
            seconds[side].append(took)
        if side == "fp8":
            result.recompiles += recompiles
            if not null:
                states = backend.report.cuda_graphs.values()
                off = [state for state in states if not state.startswith("on")]
                result.cuda_graphs = "on" if states and not off else "; ".join(dict.fromkeys(off))[:200]
    if timed:
        for side, took in seconds.items():
            setattr(result, f"{side}_tokens_per_s", batch * NEW_TOKENS / (sum(took) / len(took)))
    return result


def _generate_timed(model, ids, backend, mode: str, repeat: int) -> tuple[float, int]:
    """generate() with a compiled decode step, once to warm up, then `repeat` times: (the median
    timed call's seconds, the graphs Dynamo compiled during the timed calls)."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    torch._dynamo.reset()
    config = CompileConfig(backend=backend, mode=mode, fullgraph=False)
    kwargs = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        cache_implementation="static",
        compile_config=config,
    )
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    try:
        with torch.no_grad():
            model.generate(ids, **kwargs)
            graphs = counters["stats"]["unique_graphs"]
            seconds = []
            for _ in range(repeat):
                sync()
                begin = perf_counter()
                model.generate(ids, **kwargs)
                sync()
                seconds.append(perf_counter() - begin)
            return statistics.median(seconds), counters["stats"]["unique_graphs"] - graphs
    finally:
        torch._dynamo.reset()
