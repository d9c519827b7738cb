"""``batchgen run --resume`` / ``--retry-failed`` against the fake engine (no model): the
fix-and-rerun loop, the atomic drop of error results and what a kill at each moment leaves, an
output of another input refused, one with some foreign results warned about, and a snapshot
holding error results refused."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import Counter
from pathlib import Path

import pytest
from test_batch_runner import FakeEngine, Stop, completion_line, read_results, run, write_lines
from test_snapshot_store import _writer

from batchgen.entrypoints import batch_resume, cli, cli_flags
from batchgen.entrypoints.batch_output import is_failed_result
from batchgen.entrypoints.batch_runner import BatchFileError
from batchgen.entrypoints.snapshot_store import SnapshotStore

RESUME_LOGGER = "batchgen.entrypoints.batch_resume"


def _job(tmp_path: Path) -> tuple[Path, Path]:
    """An input of 5 lines, two of them bad (an unknown field, a prompt the engine fails),
    run once: the output holds 3 successes and 2 error lines."""
    lines = [
        completion_line("a"),
        completion_line("b", max_token=4),  # typo: unsupported_parameter
        completion_line("c"),
        completion_line("d", prompt="FAIL"),  # fails inside the engine: request_failed
        completion_line("e"),
    ]
    src, dst = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    summary = run(FakeEngine(), src, dst)
    assert (summary.succeeded, summary.failed) == (3, 2)
    return src, dst


def _fix(src: Path) -> None:
    lines = src.read_text().splitlines()
    lines[1], lines[3] = completion_line("b", max_tokens=4), completion_line("d", prompt="ok")
    write_lines(src, lines)


def _success_lines(dst: Path) -> list[bytes]:
    return [raw for raw in dst.read_bytes().splitlines(keepends=True) if b'"error":null' in raw]


def _ids(dst: Path) -> Counter:
    return Counter(r["custom_id"] for r in read_results(dst))


def test_is_failed_result():
    assert is_failed_result({"custom_id": "a", "error": {"code": "x"}, "response": None})
    assert is_failed_result({"custom_id": "a", "error": None, "response": {"status_code": 500}})
    assert is_failed_result({"custom_id": "a", "error": None, "response": {"status_code": 404}})
    assert not is_failed_result({"custom_id": "a", "error": None, "response": {"status_code": 200}})
    assert not is_failed_result({"custom_id": "a", "error": None, "response": None})


def test_retry_failed_runs_the_fixed_lines_and_replaces_their_error_lines(tmp_path):
    src, dst = _job(tmp_path)
    successes = _success_lines(dst)
    _fix(src)
    # --resume alone: error results count as done, the fixed lines do not run.
    again = run(FakeEngine(), src, dst, resume=True)
    assert (again.skipped, again.succeeded, again.failed) == (5, 0, 0)

    summary = run(FakeEngine(), src, dst, retry_failed=True)  # implies resume
    assert (summary.skipped, summary.succeeded, summary.failed) == (3, 2, 0)
    assert summary.dropped_errors == 2
    assert (
        ", 3 skipped (already done), 2 earlier error results dropped and run again of 5 "
        "requests;" in summary.describe()
    )
    results = read_results(dst)
    assert len(results) == 5 and _ids(dst) == Counter("abcde")
    assert all(r["error"] is None for r in results)
    assert dst.read_bytes().startswith(b"".join(successes))  # kept byte for byte, in order
    assert not (tmp_path / ".out.jsonl.retry-failed.tmp").exists()
    # Nothing left to retry: the file stays as it is.
    before = dst.read_bytes()
    last = run(FakeEngine(), src, dst, retry_failed=True)
    assert (last.skipped, last.succeeded, last.dropped_errors) == (5, 0, 0)
    assert dst.read_bytes() == before


def test_a_line_that_fails_again_keeps_one_error_line(tmp_path):
    src, dst = _job(tmp_path)  # not fixed: the same two lines fail again
    summary = run(FakeEngine(), src, dst, retry_failed=True)
    assert (summary.skipped, summary.succeeded, summary.failed) == (3, 0, 2)
    results = read_results(dst)
    assert len(results) == 5 and _ids(dst) == Counter("abcde")
    errors = {r["custom_id"]: r["error"]["code"] for r in results if r["error"]}
    assert errors == {"b": "unsupported_parameter", "d": "request_failed"}


def test_retry_failed_reruns_lines_without_a_custom_id_and_duplicates(tmp_path, caplog):
    """Their error lines are keyed by line number (and the duplicate's custom_id): fixed, they
    are no request of the input any more, and are dropped with the other errors, unwarned."""
    lines = [completion_line("a"), "{not json", completion_line("a"), completion_line("b")]
    src, dst = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    run(FakeEngine(), src, dst)
    lines[1], lines[2] = completion_line("x"), completion_line("y")  # both fixed
    write_lines(src, lines)
    with caplog.at_level(logging.WARNING, logger=RESUME_LOGGER):
        summary = run(FakeEngine(), src, dst, retry_failed=True)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert (summary.skipped, summary.succeeded, summary.failed) == (2, 2, 0)
    assert summary.dropped_errors == 2
    assert _ids(dst) == Counter("abxy") and all(r["error"] is None for r in read_results(dst))


def test_a_success_beside_an_error_for_one_custom_id_is_kept_and_the_error_dropped(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [completion_line("a")])
    dst = tmp_path / "out.jsonl"
    run(FakeEngine(), src, dst)
    ok = dst.read_bytes()
    error = {"id": "x", "custom_id": "a", "response": {"status_code": 500}, "error": None}
    dst.write_bytes(ok + (json.dumps(error) + "\n").encode())  # not written by batchgen
    summary = run(FakeEngine(), src, dst, retry_failed=True)
    assert (summary.skipped, summary.succeeded, summary.dropped_errors) == (1, 0, 1)
    assert dst.read_bytes() == ok


class Killed(BaseException):
    """Stands for the process being killed at that moment."""


@pytest.mark.parametrize("moment", ["fchmod", "fsync", "replace"])
def test_killed_before_the_rename_the_output_is_unchanged(tmp_path, monkeypatch, moment):
    """The temporary is written, fsync'ed, then renamed: stopped anywhere before the rename,
    the output is byte for byte what it was (errors included), and the retry then works."""
    src, dst = _job(tmp_path)
    _fix(src)
    before = dst.read_bytes()

    def kill(*args):
        raise Killed(moment)

    with monkeypatch.context() as patch:
        patch.setattr(batch_resume.os, moment, kill)
        with pytest.raises(Killed):
            run(FakeEngine(), src, dst, retry_failed=True)
    assert dst.read_bytes() == before
    assert not (tmp_path / ".out.jsonl.retry-failed.tmp").exists()
    summary = run(FakeEngine(), src, dst, retry_failed=True)
    assert (summary.skipped, summary.succeeded, summary.failed) == (3, 2, 0)
    assert _ids(dst) == Counter("abcde")


def test_a_temporary_left_by_a_sigkill_is_overwritten(tmp_path):
    src, dst = _job(tmp_path)
    _fix(src)
    (tmp_path / ".out.jsonl.retry-failed.tmp").write_bytes(b'{"custom_id": "half')
    summary = run(FakeEngine(), src, dst, retry_failed=True)
    assert (summary.skipped, summary.succeeded) == (3, 2)
    assert _ids(dst) == Counter("abcde")
    assert not (tmp_path / ".out.jsonl.retry-failed.tmp").exists()


def test_killed_after_the_rename_every_success_stays_and_resume_finishes(tmp_path):
    lines = [completion_line(f"r{i}", prompt="FAIL" if i % 2 else "ok") for i in range(8)]
    src, dst = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    run(FakeEngine(), src, dst)
    successes = _success_lines(dst)
    assert len(successes) == 4
    write_lines(src, [completion_line(f"r{i}") for i in range(8)])  # all fixed
    with pytest.raises(Stop):  # killed after one engine step: r1 and r3 redone
        run(FakeEngine(per_step=2, crash_after=1), src, dst, retry_failed=True)
    assert dst.read_bytes().startswith(b"".join(successes))
    assert _ids(dst) == Counter(["r0", "r2", "r4", "r6", "r1", "r3"])  # no error line left
    summary = run(FakeEngine(), src, dst, resume=True)
    assert (summary.skipped, summary.succeeded) == (6, 2)
    assert _ids(dst) == Counter(f"r{i}" for i in range(8))
    assert all(r["error"] is None for r in read_results(dst))


def test_retry_rewrites_a_linked_output_in_place_and_keeps_its_mode(tmp_path):
    src, real = _job(tmp_path)
    _fix(src)
    real.chmod(0o640)
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    summary = run(FakeEngine(), src, link, retry_failed=True)
    assert (summary.skipped, summary.succeeded) == (3, 2)
    assert link.is_symlink() and _ids(real) == Counter("abcde")
    assert real.stat().st_mode & 0o777 == 0o640


# ---- an output that is not this input's


def _other_output(tmp_path: Path, n: int = 37) -> Path:
    other = write_lines(tmp_path / "other.jsonl", [completion_line(f"o{i:02d}") for i in range(n)])
    dst = tmp_path / "out.jsonl"
    run(FakeEngine(per_step=8), other, dst)
    return dst


def test_resume_onto_another_inputs_output_is_refused_and_changes_nothing(tmp_path):
    dst = _other_output(tmp_path)
    with dst.open("ab") as f:
        f.write(b'{"custom_id": "o9')  # a half-written line: not cut either
    before = dst.read_bytes()
    src = write_lines(tmp_path / "in.jsonl", [completion_line(c) for c in "xyz"])
    for kwargs in ({"resume": True}, {"retry_failed": True}):
        with pytest.raises(BatchFileError) as err:
            run(FakeEngine(), src, dst, **kwargs)
        assert str(err.value) == (
            f"cannot resume: none of the 37 results in {dst} is for a request of {src} "
            '(custom_ids "o00", "o01", "o02" and 34 more); is it another input\'s output? '
            "Name another -o, or move the file away to start over"
        )
        assert dst.read_bytes() == before


def test_resume_with_some_foreign_results_warns_once_and_goes_on(tmp_path, caplog):
    lines = [completion_line(c) for c in "abcdef"]
    src, dst = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    run(FakeEngine(), src, dst)
    write_lines(src, [lines[0], lines[2], lines[4], completion_line("g")])  # b, d, f deleted
    with caplog.at_level(logging.WARNING, logger=RESUME_LOGGER):
        summary = run(FakeEngine(), src, dst, resume=True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f'{dst}: 3 of its 6 results are for no request of {src} (custom_ids "b", "d", "f"); '
        "they stay in the output (lines deleted from the input?)"
    ]
    assert (summary.skipped, summary.succeeded) == (3, 1)
    assert _ids(dst) == Counter("abcdefg")


def test_retry_drops_the_error_of_a_line_deleted_from_the_input(tmp_path, caplog):
    src, dst = _job(tmp_path)
    lines = src.read_text().splitlines()
    write_lines(src, [lines[0], lines[2], lines[4]])  # the two bad lines deleted
    with caplog.at_level(logging.WARNING, logger=RESUME_LOGGER):
        summary = run(FakeEngine(), src, dst, retry_failed=True)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert (summary.skipped, summary.succeeded, summary.dropped_errors) == (3, 0, 2)
    assert _ids(dst) == Counter("ace") and all(r["error"] is None for r in read_results(dst))


# ---- the CLI


@pytest.fixture
def engines(monkeypatch):
    started = []

    def start(kwargs):
        started.append(kwargs)
        return FakeEngine()

    monkeypatch.setattr(cli_flags, "start_engine", start)
    return started


def test_cli_fix_and_rerun_loop(tmp_path, engines, capsys):
    src, dst = _job(tmp_path)
    argv = ["run", "-i", str(src), "-o", str(dst), "--no-progress"]
    _fix(src)
    capsys.readouterr()
    assert cli.main([*argv, "--resume"]) == 0 and engines == []
    assert capsys.readouterr().err == (
        f"batchgen run: nothing to do: all 5 requests of {src} already have a result in {dst} "
        "(--resume; 2 of them errors: add --retry-failed to run those again); the model was "
        "not loaded\n"
    )
    assert cli.main([*argv, "--retry-failed"]) == 0 and len(engines) == 1
    err = capsys.readouterr().err
    assert (
        "batchgen run: 2 ok, 0 failed, 3 skipped (already done), 2 earlier error results "
        "dropped and run again of 5 requests;" in err
    )
    assert len(read_results(dst)) == 5 and _ids(dst) == Counter("abcde")
    assert cli.main([*argv, "--retry-failed"]) == 0 and len(engines) == 1
    assert capsys.readouterr().err == (
        f"batchgen run: nothing to do: all 5 requests of {src} already have a successful "
        f"result in {dst} (--retry-failed); the model was not loaded\n"
    )


def test_cli_a_deleted_failing_line_without_and_with_retry_failed(tmp_path, engines, capsys):
    """--resume keeps (and warns about) the error of a line deleted from the input;
    --retry-failed drops it without loading the model when nothing else is left to run."""
    src, dst = _job(tmp_path)
    lines = src.read_text().splitlines()
    write_lines(src, [lines[0], lines[2], lines[4]])
    argv = ["run", "-i", str(src), "-o", str(dst), "--no-progress"]
    before = dst.read_bytes()
    capsys.readouterr()
    assert cli.main([*argv, "--resume"]) == 0 and engines == []
    warning, done = capsys.readouterr().err.splitlines()
    assert warning.endswith(
        f"WARNING batchgen.entrypoints.cli_run: {dst}: 2 of its 5 results are for no request of "
        f'{src} (custom_ids "b", "d"); they stay in the output (lines deleted from the input?)'
    )
    assert done == (
        f"batchgen run: nothing to do: all 3 requests of {src} already have a result in {dst} "
        "(--resume); the model was not loaded"
    )
    assert dst.read_bytes() == before
    assert cli.main([*argv, "--retry-failed"]) == 0 and engines == []
    assert capsys.readouterr().err == (
        f"batchgen run: nothing to do: all 3 requests of {src} already have a successful result "
        f"in {dst} (--retry-failed; dropped its 2 other error results); the model was not "
        "loaded\n"
    )
    assert _ids(dst) == Counter("ace") and all(r["error"] is None for r in read_results(dst))
    assert [r for r in before.splitlines(keepends=True) if b'"error":null' in r] == (
        dst.read_bytes().splitlines(keepends=True)
    )


def test_cli_resume_onto_another_inputs_output_exits_2_before_the_model(tmp_path, engines, capsys):
    dst = _other_output(tmp_path)
    before = dst.read_bytes()
    src = write_lines(tmp_path / "in.jsonl", [completion_line(c) for c in "xyz"])
    argv = ["run", "-i", str(src), "-o", str(dst), "--no-progress", "--resume"]
    capsys.readouterr()
    assert cli.main(argv) == 2 and engines == []
    assert capsys.readouterr().err == (
        f"batchgen run: error: cannot resume: none of the 37 results in {dst} is for a request "
        f'of {src} (custom_ids "o00", "o01", "o02" and 34 more); is it another input\'s '
        "output? Name another -o, or move the file away to start over\n"
    )
    assert dst.read_bytes() == before


def test_cli_help_names_retry_failed(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "--retry-failed implies --resume, and also runs again the lines whose result is an "
        "error" in out
    )


# ---- with a snapshot


@pytest.mark.timeout(60)
def test_retry_with_a_snapshot_holding_errors_is_refused(tmp_path, engines, capsys):
    src, dst, snap = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "snap"
    write_lines(src, [completion_line("a"), completion_line("b", prompt="FAIL")])
    argv = ["run", "-i", str(src), "-o", str(dst), "--no-progress", "--model", "tiny"]
    argv += ["--snapshot-storage-uri", str(snap)]
    assert cli.main(argv) == 0 and len(engines) == 1
    before = dst.read_bytes()
    capsys.readouterr()
    assert cli.main([*argv, "--retry-failed"]) == 2 and len(engines) == 1  # no model loaded
    assert capsys.readouterr().err == (
        f"batchgen run: error: --retry-failed: the snapshot at {snap} holds 1 error results for "
        "this input, and a snapshot's results are never changed, so it would restore them "
        "instead of running their lines again. Rerun with --retry-failed and a new "
        "--snapshot-storage-uri (the output's successful results are stored there first), or "
        "without --retry-failed\n"
    )
    assert dst.read_bytes() == before
    # The line fixed (another input: another job), on a new URI: the output's success is
    # stored there, the fixed line runs, and neither copy keeps an error.
    write_lines(src, [completion_line("a"), completion_line("b")])
    new = tmp_path / "snap2"
    argv[-1] = str(new)
    assert cli.main([*argv, "--retry-failed"]) == 0 and len(engines) == 2
    stored = [json.loads(line) for line in SnapshotStore(str(new)).iter_result_lines()]
    assert Counter(r["custom_id"] for r in stored) == Counter("ab")
    assert all(r["error"] is None for r in stored)
    assert _ids(dst) == Counter("ab") and all(r["error"] is None for r in read_results(dst))


@pytest.mark.timeout(60)
def test_foreign_results_of_a_resumed_output_are_not_stored_in_the_snapshot(tmp_path):
    lines = [completion_line(c) for c in "abcd"]
    src, dst = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    run(FakeEngine(), src, dst)
    write_lines(src, lines[:2])  # c and d deleted
    uri = f"file://{tmp_path / 'snap'}"
    summary = run(FakeEngine(), src, dst, resume=True, snapshot=_writer(uri, src))
    assert (summary.skipped, summary.succeeded) == (2, 0)
    stored = [json.loads(line) for line in SnapshotStore(uri).iter_result_lines()]
    assert Counter(r["custom_id"] for r in stored) == Counter("ab")
    assert _ids(dst) == Counter("abcd")


@pytest.mark.timeout(30)
def test_pipe_input_is_resumed_without_the_foreign_check(tmp_path):
    """A pipe can be read once only: its custom_ids are not known before the run."""
    dst = _other_output(tmp_path, n=3)
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)

    def feed():
        with open(fifo, "w") as f:
            f.write(completion_line("x") + "\n")

    writer = threading.Thread(target=feed)
    writer.start()
    summary = run(FakeEngine(), fifo, dst, resume=True)
    writer.join()
    assert summary.succeeded == 1 and _ids(dst) == Counter(["o00", "o01", "o02", "x"])


def test_an_interrupted_retry_says_to_rerun_with_retry_failed(capsys):
    """Stopped while the model loads, a --retry-failed run has not dropped the error lines
    yet: --resume alone would not run them, so the stop line names --retry-failed."""
    import argparse

    from batchgen.entrypoints.cli_flags import Subcommand

    def interrupted(args):
        raise KeyboardInterrupt

    command = Subcommand("run", "", lambda p: None, interrupted, uses_torch=False)
    assert cli._run_command(command, argparse.Namespace(retry_failed=True)) == 130
    assert capsys.readouterr().err == (
        "batchgen run: interrupted (rerun with --retry-failed to continue)\n"
    )
    assert cli._run_command(command, argparse.Namespace(retry_failed=False)) == 130
    assert (
        capsys.readouterr().err == "batchgen run: interrupted (rerun with --resume to continue)\n"
    )
