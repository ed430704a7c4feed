"""Ranks in processes of their own for the multi-process tests, with a deadline that says where
each rank stood when it passed.

A collective that one rank never reaches hangs the others, and a hang killed from outside (a
lease's time limit) leaves nothing to read. So each worker marks its stages as it goes
(`mark`), and `spawn` fails the test at its deadline naming each rank's last stage, with the
Python stack each rank's threads stood in shortly before it (faulthandler).
"""

from __future__ import annotations

import faulthandler
import socket
import time
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mark(out_dir: str | Path, rank: int, stage: str) -> None:
    """Rank `rank` has reached `stage` (what spawn names if the deadline passes)."""
    (Path(out_dir) / f"rank{rank}.stage").write_text(stage)


def spawn(worker, nprocs: int, out_dir: Path, deadline_s: float, *args) -> None:
    """worker(rank, port, out_dir, *args) in nprocs processes; a failing rank's error raised here,
    and ranks still running after deadline_s killed and the test failed with each one's last mark.
    Tensors among args made with share_memory_() are the same memory in every rank."""
    import torch.multiprocessing as mp

    context = mp.spawn(
        _with_stacks,
        args=(worker, max(1.0, deadline_s - STACKS_LEAD_S), free_port(), str(out_dir), *args),
        nprocs=nprocs,
        join=False,
    )
    deadline = time.monotonic() + deadline_s
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            where = ", ".join(f"rank {r} at {_last_mark(out_dir, r)}" for r in range(nprocs))
            stacks = "".join(f"\nrank {r}: {_stacks(out_dir, r)}" for r in range(nprocs))
            pytest.fail(f"the ranks did not finish in {deadline_s:.0f} s: {where}{stacks}")


# How long before the deadline each rank writes its threads' stacks (a rank starts a few seconds
# after spawn: the stacks come 5-15 s before the kill).
STACKS_LEAD_S = 15


def _with_stacks(rank: int, worker, stacks_after_s: float, port: int, out_dir: str, *args) -> None:
    """worker(rank, port, out_dir, *args), every thread's Python stack written to rank<r>.stacks if
    it still runs stacks_after_s from its start (a rank blocked in a collective shows where)."""
    with open(Path(out_dir) / f"rank{rank}.stacks", "w") as file:
        faulthandler.dump_traceback_later(stacks_after_s, file=file)
        try:
            worker(rank, port, out_dir, *args)
        finally:
            faulthandler.cancel_dump_traceback_later()


def _stacks(out_dir: Path, rank: int) -> str:
    path = Path(out_dir) / f"rank{rank}.stacks"
    text = path.read_text() if path.exists() else ""
    return text.strip() or "no stacks written"


def _last_mark(out_dir: Path, rank: int) -> str:
    path = Path(out_dir) / f"rank{rank}.stage"
    return repr(path.read_text()) if path.exists() else "no mark (before its first)"
