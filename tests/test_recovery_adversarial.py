"""Adversarial cases of the frontend's failure handling, on a `DPEngineClient` with fake ranks
(no processes): a failure that ends the job must not swallow the outputs that arrived with it,
and an exception in elastic recovery's background thread must not be lost with the thread.
"""

from __future__ import annotations

import time

import pytest
from test_rebalance import _add, _FakeRankSet, _frontend

from batchgen.distributed import protocol as msg
from batchgen.distributed.rank_handle import RankFailedError
from batchgen.outputs import RequestOutput


class _FailingRankSet(_FakeRankSet):
    """Ranks that fail at the next `receive`, with ``held`` outputs arriving together with the
    failure (as `RankSet._fail` keeps them for `take_held`)."""

    def __init__(self, failure: RankFailedError, held: list) -> None:
        super().__init__()
        self.retired_ranks: list[int] = []
        self._failure, self._held = failure, held
        self.shutdowns = 0

    def receive(self, timeout: float) -> list:
        self.failure = self._failure
        self._failure.lost = [0, 1]
        raise self._failure

    def take_held(self) -> list:
        held, self._held = self._held, []
        return held

    def restartable(self, ranks: list[int]) -> bool:
        return True

    def shutdown(self, timeout: float = 30.0) -> None:
        self.shutdowns += 1
        self.closed = True


def _finished_output(request_id: str) -> RequestOutput:
    return RequestOutput(request_id, None, [1, 2, 3, 4], [], finished=True)


@pytest.mark.parametrize("left", [True, False])
def test_a_fatal_failure_returns_the_outputs_that_came_with_it_before_raising(left):
    """Rank 0's output for "a" arrives in the same read as rank 1's death, recovery is off:
    `step` returns "a" (`batchgen run` writes it) and the failure comes from the next call;
    when "a" was the last request, nothing is raised at all (the job is complete)."""
    client = _frontend()
    died = RankFailedError("rank 1 died: killed by SIGKILL", [1], recoverable=True)
    _add(client, "a", 5, rank=0)
    if left:
        _add(client, "b", 5, rank=1)
    with_it = [(client._ranks[0], msg.Outputs(0, [_finished_output("a")]))]
    client.rank_set = _FailingRankSet(died, with_it)
    got = client.step()
    assert [o.request_id for o in got] == ["a"]
    assert client.rank_set.shutdowns == 1  # every rank is stopped at once
    assert client.has_unfinished_requests() is left
    if left:
        with pytest.raises(RankFailedError, match="rank 1 died") as e:
            client.step()
        assert e.value is died
        with pytest.raises(RankFailedError):  # and again
            client.step()


def test_a_fatal_failure_with_nothing_finished_raises_at_once():
    client = _frontend()
    died = RankFailedError("rank 1 died: killed by SIGKILL", [1], recoverable=True)
    _add(client, "b", 5, rank=1)
    client.rank_set = _FailingRankSet(died, [])
    with pytest.raises(RankFailedError, match="rank 1 died"):
        client.step()


def test_an_exception_in_the_background_thread_is_not_lost(monkeypatch):
    """The watcher's poll raises something other than a rank failure (a bug, a bad message):
    the thread records it and exits (a later failure may start a new one), the ranks are
    stopped, and the next call raises a `RankFailedError` carrying it (before: the thread died
    with it, stayed registered as running, and the engine carried on half-recovered)."""
    from batchgen.distributed import frontend_recovery

    monkeypatch.setattr(frontend_recovery, "JOIN_POLL_S", 0.01)
    client = _frontend(enable_elastic_recovery=True)
    client.rank_set = _FailingRankSet(RankFailedError("unused", [1]), [])
    client.rank_set.joining = True
    _add(client, "a", 5, rank=0)

    def broken_poll():
        raise KeyError("a message the frontend did not expect")

    client._poll = broken_poll
    client._watch_joining()
    deadline = time.monotonic() + 10
    while client.__dict__.get("_watcher") is not None:
        assert time.monotonic() < deadline, "the background thread never exited"
        time.sleep(0.01)
    assert client.rank_set.shutdowns == 1
    with pytest.raises(RankFailedError, match="background thread failed: KeyError") as e:
        client.step()
    assert isinstance(e.value.__cause__, KeyError)
    with pytest.raises(RankFailedError, match="background thread failed"):
        client.add_request("b", "prompt")
