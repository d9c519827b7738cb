"""A data-parallel start interrupted (Ctrl-C, SIGTERM) while ranks still load their weights:
the frontend gives them a short grace and kills them, rather than waiting 30 s for ranks that
read their Shutdown only once loaded. Every case carries a timeout and checks that no rank
process is left."""

from __future__ import annotations

import time

import psutil
import pytest

from batchgen import LLM
from rank_hooks import slow_model_load

from batchgen.distributed import rank_set


def _children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.is_running()]


@pytest.mark.timeout(180)
def test_interrupted_start_kills_ranks_still_loading(checkpoint_dir, tmp_path, monkeypatch):
    slow_model_load(tmp_path, monkeypatch, 120)
    before = {p.pid for p in _children()}
    raised_at = []

    def interrupted(self, ranks):  # the ranks are set up and loading: Ctrl-C now
        time.sleep(1.0)
        raised_at.append(time.monotonic())
        raise KeyboardInterrupt

    monkeypatch.setattr(rank_set.RankSet, "_wait_ready", interrupted)
    with pytest.raises(KeyboardInterrupt):
        LLM(str(checkpoint_dir("mixtral")), data_parallel_size=2)
    took = time.monotonic() - raised_at[0]
    # The grace, then the kill and its wait; a polite shutdown would have waited 30 s.
    assert took < rank_set.START_SHUTDOWN_GRACE_S + 10, took
    deadline = time.monotonic() + 10
    while {p.pid for p in _children()} - before and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in _children() if p.pid not in before]
    assert not left, [p.cmdline() for p in left]
