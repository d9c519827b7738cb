"""Edge cases of ``batchgen run --resume`` / ``--retry-failed`` found by adversarial testing:
every input line must end with exactly one result, and no earlier success may change."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from test_batch_runner import FakeEngine, Stop, completion_line, read_results, run, write_lines



def _keys(dst: Path) -> Counter:
    """(custom_id, error code or None) of each result."""
    return Counter(
        (r["custom_id"], r["error"]["code"] if r["error"] else None) for r in read_results(dst)
    )


# A line whose custom_id an earlier line already used, and which is also invalid (an unknown
# url): its result is the duplicate's error, keyed by its line number.
BAD_DUPLICATE = json.dumps({"custom_id": "a", "url": "/v1/bogus", "body": {"prompt": "x"}})


@pytest.mark.timeout(30)
def test_retry_failed_rewrites_the_error_of_an_invalid_duplicate(tmp_path):
    lines = [completion_line("a"), BAD_DUPLICATE, completion_line("b")]
    src, dst = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    run(FakeEngine(), src, dst)
    expected = Counter({("a", None): 1, ("a", "duplicate_custom_id"): 1, ("b", None): 1})
    assert _keys(dst) == expected
    summary = run(FakeEngine(), src, dst, retry_failed=True)
    assert (summary.skipped, summary.failed, summary.dropped_errors) == (2, 1, 1)
    assert _keys(dst) == expected  # the duplicate's error line is written again


@pytest.mark.timeout(30)
def test_resume_after_a_kill_answers_an_invalid_duplicate(tmp_path):
    """Killed after the first line's result and before the duplicate's: the resumed run must
    not take the duplicate for done because its custom_id is."""
    lines = [completion_line("a"), completion_line("b"), BAD_DUPLICATE]
    src, dst = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    with pytest.raises(Stop):  # a finishes, b is admitted, then the crash
        run(FakeEngine(per_step=1, crash_after=1), src, dst, max_in_flight=1)
    assert _keys(dst) == Counter({("a", None): 1})
    summary = run(FakeEngine(), src, dst, resume=True)
    assert (summary.skipped, summary.succeeded, summary.failed) == (1, 1, 1)
    assert _keys(dst) == Counter({("a", None): 1, ("b", None): 1, ("a", "duplicate_custom_id"): 1})
