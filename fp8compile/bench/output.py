"""What the benches write: JSON with its table (save), plots (matplotlib where it is installed)
and host profiles."""

from __future__ import annotations

import json
from pathlib import Path


def pyplot():
    """matplotlib.pyplot on a file backend, or None (with a line saying so) where it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return None
    return plt


def profiled(fn, path: Path, lines: int = 40) -> None:
    """Run fn under cProfile; the functions with the most own time, then the most cumulative, to path."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(fn)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(lines)
    stats.sort_stats("cumulative").print_stats(lines)
    path.write_text(text.getvalue())


def save(out_dir: Path, name: str, rows: list[dict], table) -> list[dict]:
    """rows to out_dir/name as JSON, and their table printed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / name).write_text(json.dumps(rows, indent=1))
    print(table(rows))
    return rows


def best_fixed(rows: list[dict], key: str, count: int = 5) -> str:
    """The `count` best values of rows' `key` (a fixed choice, such as a tiling) by geometric-mean
    time ("us") over the points they were timed at; a choice that failed anywhere is left out."""
    import math

    times: dict[str, list] = {}
    for r in rows:
        times.setdefault(r[key], []).append(r["us"])
    ranked = sorted(
        (math.exp(sum(map(math.log, ts)) / len(ts)), name) for name, ts in times.items() if all(ts)
    )
    return "\n".join(
        ["best fixed choices by geometric-mean time over the points:"]
        + [f"   {name}: {score:.1f} us" for score, name in ranked[:count]]
    )
