"""The multi-process tests' harness (tests/ranks.py): a rank that never finishes fails the test at
its deadline with where it stood, its last mark and its Python stack, instead of hanging CI."""

import time

import pytest

from tests import ranks


def _stuck_worker(rank: int, port: int, out_dir: str) -> None:
    ranks.mark(out_dir, rank, "waiting on a peer that never comes")
    _wait_forever()


def _wait_forever() -> None:
    time.sleep(600)


def test_a_rank_past_its_deadline_is_killed_and_named_with_its_mark_and_stack(tmp_path, monkeypatch):
    # the stacks 1 s after each rank starts; the kill at 12 s (a rank starts in 2-5 s on CI's CPUs)
    monkeypatch.setattr(ranks, "STACKS_LEAD_S", 11)
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failed:
        ranks.spawn(_stuck_worker, 2, tmp_path, 12)
    assert time.monotonic() - start < 60
    message = str(failed.value)
    assert "did not finish in 12 s" in message
    for rank in (0, 1):
        assert f"rank {rank} at 'waiting on a peer that never comes'" in message
    assert message.count("in _wait_forever") == 2  # each rank's main thread, in the function it hangs in
