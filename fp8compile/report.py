"""What the backend did: every rewrite (with the kernel chosen for each side of the M dispatch)
and every candidate left unchanged, with the reason and the dtype it stays in."""

from __future__ import annotations

import dataclasses
from collections import Counter

from .config import WIDE_N

KINDS = ("linear", "silu_mul", "moe", "attention", "mqa_logits")


@dataclasses.dataclass(frozen=True)
class Rewrite:
    kind: str  # one of KINDS
    name: str  # module path, e.g. "model.layers.0.mlp.gate_proj"
    m: str  # "dynamic" or the static row count
    n: int
    k: int
    kernels: tuple[
        tuple[str, str], ...
    ]  # (("M <= 32", "triton"), ("M > 32", "deep_gemm")) or (("all M", ...),)
    graph: int
    detail: str = ""  # e.g. the gated activation of a silu_mul rewrite: "silu", "gelu_tanh", ...
    recipe: str = "block"  # its scaling: "block", or "rowwise" / "tensor" with "static" / "dynamic" scales
    shard: str = (
        ""  # tensor parallel: this rank's weight in its whole, "Shard(dim=0) over 2 ranks of 512x512"
    )


@dataclasses.dataclass(frozen=True)
class Skip:
    kind: str  # one of KINDS, or "graph" for a whole graph left alone
    name: str
    reason: str
    graph: int
    shape: str = ""
    dtype: str = ""  # the dtype the site stays in (the model's), where the pass knows it


class Report:
    """Collects Rewrite and Skip records over every graph a backend compiles.

    print(report) renders a table; report.counts() gives {"linear": 14, ...}.
    """

    def __init__(self, config=None):
        self.config = config
        self.rewrites: list[Rewrite] = []
        self.skips: list[Skip] = []
        self.graphs = 0
        self.cuda_graphs: dict[
            int, str
        ] = {}  # graph index -> whether its calls replay CUDA graphs, or why not
        # Under torch.distributed: (this rank, world size), and per graph a digest of the graph our
        # passes handed to Inductor. Every rank of a tensor-parallel model should show the same
        # rewrites and the same digests; ranks that differ compiled different programs.
        self.rank: tuple[int, int] | None = None
        self.digests: dict[int, str] = {}
        # per graph, under torch.distributed: its functional collectives by name (all_reduce: 16)
        self.collectives: dict[int, dict[str, int]] = {}
        # what the all-reduces run, per group and device ("0 on cuda:0": symmetric memory's kernels,
        # or the group's own collective and why), or per graph left as written ("graph 1": why;
        # passes/all_reduce.py)
        self.all_reduce_paths: dict[str, str] = {}
        # A graph compiled so far held an FP8 checkpoint's linears (passes/context.py): the
        # model's graphs after it (a graph break's, the lm_head's alone) are that checkpoint's.
        self.fp8_checkpoint = False

    def counts(self) -> dict[str, int]:
        """Rewrites per kind; every kind in KINDS is present, 0 where nothing matched."""
        found = Counter(r.kind for r in self.rewrites)
        return {kind: found.get(kind, 0) for kind in KINDS}

    def skipped(self, kind: str | None = None) -> list[Skip]:
        return [s for s in self.skips if kind is None or s.kind == kind]

    def collective_lines(self) -> list[str]:
        """Under torch.distributed: each graph's collectives and where they run, and what each
        all-reduce runs on (the report's lines; `bench model --tp` prints them)."""
        lines = [
            f"graph {g}'s collectives: {_collective_list(found)}, {self._where(g)}"
            for g, found in sorted(self.collectives.items())
            if found
        ]
        for where, path in sorted(self.all_reduce_paths.items()):
            lines.append(f"all-reduces, {'' if where.startswith('graph') else 'group '}{where}: {path}")
        return lines

    def __str__(self) -> str:
        head = (
            f"fp8compile report: {len(self.rewrites)} rewritten, {len(self.skips)} left unchanged, "
            f"{self.graphs} graph(s)"
        )
        if self.config is not None:
            c = self.config
            head += (
                f"\nconfig: recipe={c.recipe}{_scales(c)} e8m0={c.e8m0} batch_invariant={c.batch_invariant} "
                f"small_m={c.small_m} large_m={_large_m(c)} autotune={c.autotune}"
                + ("" if c.recipe == "block" else f" fast_accum={c.cublas_fast_accum()}")
            )
        if self.rank is not None:
            digests = ", ".join(f"{g}: {d}" for g, d in sorted(self.digests.items()))
            head += f"\nrank {self.rank[0]} of {self.rank[1]} (torch.distributed); graph digests {digests}"
            head += "".join(f"\n{line}" for line in self.collective_lines())
        lines = [head]
        if self.rewrites:
            sharded = any(r.shard for r in self.rewrites)
            rows = [
                (
                    f"{r.kind}[{r.detail}]" if r.detail else r.kind,
                    r.name,
                    r.m,
                    f"{r.k} -> {r.n}",
                    r.recipe,
                    *((r.shard or "whole",) if sharded else ()),
                    "; ".join(f"{side}: {k}" for side, k in r.kernels),
                )
                for r in self.rewrites
            ]
            header = (
                "kind",
                "module",
                "M",
                "K -> N",
                "recipe",
                *(("this rank's shard",) if sharded else ()),
                "kernel",
            )
            lines += ["", "rewritten:", *_table(header, rows)]
        if self.skips:
            # the dtype they stay in: in the heading where it is one, else a column of its own
            # (a whole graph's skip has none)
            stay = {s.dtype for s in self.skips if s.dtype}
            if len(stay) <= 1:
                rows = [(s.kind, s.name, s.shape, s.reason) for s in self.skips]
                heading = f"left unchanged, in {stay.pop()}:" if stay else "left unchanged:"
                lines += ["", heading, *_table(("kind", "module", "shape", "reason"), rows)]
            else:
                rows = [(s.kind, s.name, s.shape, s.dtype or "-", s.reason) for s in self.skips]
                header = ("kind", "module", "shape", "dtype", "reason")
                lines += ["", "left unchanged:", *_table(header, rows)]
        if self.cuda_graphs:
            lines += [
                "",
                "CUDA graphs:",
                *(f"graph {g}: {state}" for g, state in sorted(self.cuda_graphs.items())),
            ]
        return "\n".join(lines)

    __repr__ = __str__

    def _where(self, graph: int) -> str:
        """Whether a graph's collectives replay inside its CUDA graph or launch at each call."""
        state = self.cuda_graphs.get(graph)
        if state is None:
            return "launched with the graph"
        if state.startswith("on"):
            return "inside its CUDA graph (captured with it, NCCL included)"
        return "launched at each call (no CUDA graph)"


def _collective_list(found: dict[str, int]) -> str:
    return ", ".join(f"{n} {name}" for name, n in sorted(found.items()))


def _large_m(config) -> str:
    """large_m as set, or the width rule that stands in for it (Fp8Config.large_m_for)."""
    if config.large_m is not None:
        return str(config.large_m)
    return f"{config.large_m_for(WIDE_N)} (N >= {WIDE_N}) / {config.large_m_for(WIDE_N - 1)} (narrower)"


def _scales(config) -> str:
    """How the config scales activations, where the recipe lets it choose."""
    if getattr(config, "recipe", "block") == "block":
        return ""
    if config.act_amax is not None:
        return f" act_scales=static ({len(config.act_amax)} calibrated)"
    return " act_scales=dynamic" + (f" (amax <= {config.act_amax_ub:g})" if config.act_amax_ub else "")


def _table(header: tuple[str, ...], rows: list[tuple]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths[:-1]) + "  {}"
    return [
        fmt.format(*header),
        fmt.format(*("-" * w for w in widths)),
        *(fmt.format(*map(str, r)) for r in rows),
    ]
