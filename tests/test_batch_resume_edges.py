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


# ---- rewriting the output: a long name, a directory that cannot be written


@pytest.mark.timeout(30)
def test_retry_failed_rewrites_an_output_whose_name_is_near_the_limit(tmp_path):
    """``.<name>.retry-failed.tmp`` would pass 255 bytes: a shortened, hashed name is used."""
    lines = [completion_line("a"), completion_line("b", prompt="FAIL")]
    src = write_lines(tmp_path / "in.jsonl", lines)
    dst = tmp_path / ("o" * 240 + ".jsonl")
    run(FakeEngine(), src, dst)
    write_lines(src, [completion_line("a"), completion_line("b")])
    summary = run(FakeEngine(), src, dst, retry_failed=True)
    assert (summary.skipped, summary.succeeded, summary.dropped_errors) == (1, 1, 1)
    assert _keys(dst) == Counter({("a", None): 1, ("b", None): 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["in.jsonl", dst.name])


def _failed_job(tmp_path: Path) -> tuple[Path, Path, bytes]:
    src = write_lines(tmp_path / "in.jsonl", [completion_line("a", prompt="FAIL")])
    dst = tmp_path / "out.jsonl"
    run(FakeEngine(), src, dst)
    write_lines(src, [completion_line("a")])
    return src, dst, dst.read_bytes()


@pytest.mark.timeout(30)
def test_a_failed_rename_is_a_batch_file_error_and_changes_nothing(tmp_path, monkeypatch):
    from batchgen.entrypoints import batch_resume
    from batchgen.entrypoints.batch_runner import BatchFileError

    src, dst, before = _failed_job(tmp_path)

    def read_only(*args):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(batch_resume.os, "replace", read_only)
    with pytest.raises(BatchFileError) as err:
        run(FakeEngine(), src, dst, retry_failed=True)
    assert str(err.value) == (
        f"--retry-failed rewrites {dst} into .out.jsonl.retry-failed.tmp beside it and renames "
        "that over it, which failed: Read-only file system (a directory that is not "
        "writable?); the output is unchanged. Run with --resume only, or copy the output to a "
        "writable directory"
    )
    assert dst.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]


@pytest.mark.timeout(30)
def test_cli_refuses_an_output_it_cannot_rewrite_before_the_model(
    tmp_path, monkeypatch, capsys
):
    from batchgen.entrypoints import batch_resume, cli, cli_flags

    src, dst, before = _failed_job(tmp_path)
    started = []
    monkeypatch.setattr(cli_flags, "start_engine", lambda kw: started.append(kw) or FakeEngine())
    nowhere = tmp_path / "gone" / ".out.jsonl.retry-failed.tmp"  # its directory is missing
    monkeypatch.setattr(batch_resume, "retry_temporary", lambda path: nowhere)
    capsys.readouterr()
    argv = ["run", "-i", str(src), "-o", str(dst), "--no-progress", "--retry-failed"]
    assert cli.main(argv) == 2 and started == []
    assert capsys.readouterr().err.startswith(
        f"batchgen run: error: --retry-failed rewrites {dst} into .out.jsonl.retry-failed.tmp "
        "beside it and renames that over it, which failed: No such file or directory"
    )
    assert dst.read_bytes() == before
