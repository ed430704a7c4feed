"""What the benches write besides JSON: plots (matplotlib where it is installed) and host profiles."""
from __future__ import annotations

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
