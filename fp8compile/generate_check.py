"""A model as users run it: generate() with a static cache, its decode step compiled by
transformers (GenerationConfig.compile_config), bf16 Inductor beside backend="fp8" in one mode.

Each side runs generate() twice, the first to compile and warm up, the second timed: tokens/s,
the graphs compiled during the second (recompiles after warm-up: none is right), and for fp8
whether its graphs replay CUDA graphs, and why not. The architecture matrix runs this per
architecture and mode (`python -m fp8compile models --generate`); a crash is a row of its own.
"""

from __future__ import annotations

import dataclasses
import time

import torch

PROMPT, NEW_TOKENS = 32, 32


@dataclasses.dataclass
class Decode:
    """One mode's generate() of one architecture, bf16 Inductor beside fp8."""

    mode: str
    bf16_tokens_per_s: float | None = None
    fp8_tokens_per_s: float | None = None
    recompiles: int | None = None  # fp8's graphs compiled in the timed call
    cuda_graphs: str = ""  # fp8's: "on", or each graph's reason where off
    error: str = ""  # the side and the exception, where one raised


def decode(model, mode: str, device: str, timed: bool, batch: int = 1) -> Decode:
    """generate() on model in mode ("default" or "reduce-overhead"), bf16 Inductor then fp8.
    timed: measure tokens/s (on a GPU; on the CPU the check is that it runs)."""
    import fp8compile

    result = Decode(mode)
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, PROMPT), device=device)
    for side in ("bf16", "fp8"):
        backend = fp8compile.backend() if side == "fp8" else "inductor"
        try:
            seconds, recompiles = _generate_twice(model, ids, backend, mode)
        except Exception as error:  # noqa: BLE001  a row of the matrix: a crash is what it must show
            result.error = f"{side}: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
            return result
        if timed:
            setattr(result, f"{side}_tokens_per_s", batch * NEW_TOKENS / seconds)
        if side == "fp8":
            result.recompiles = recompiles
            states = backend.report.cuda_graphs.values()
            off = [state for state in states if not state.startswith("on")]
            result.cuda_graphs = "on" if states and not off else "; ".join(dict.fromkeys(off))[:200]
    return result


def _generate_twice(model, ids, backend, mode: str) -> tuple[float, int]:
    """generate() twice with a compiled decode step: (the second call's seconds, the graphs
    Dynamo compiled during it)."""
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
            sync()
            begin = time.perf_counter()
            model.generate(ids, **kwargs)
            sync()
            return time.perf_counter() - begin, counters["stats"]["unique_graphs"] - graphs
    finally:
        torch._dynamo.reset()
