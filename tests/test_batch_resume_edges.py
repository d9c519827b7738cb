"""Edge cases of ``batchgen run --resume`` / ``--retry-failed`` found by adversarial testing:
every input line must end with exactly one result, and no earlier success may change."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
def test_cli_refuses_an_output_it_cannot_rewrite_before_the_model(tmp_path, monkeypatch, capsys):
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


# ---- one run at a time per output


HOLD = """
import sys, time
from batchgen.entrypoints.output_lock import output_lock
with output_lock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(60)
"""


@pytest.fixture
def holder():
    """Start a process holding an output's lock; every one started is killed at the end."""
    procs = []

    def start(path: Path) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True
        )
        procs.append(proc)
        assert proc.stdout.readline() == "locked\n"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(timeout=10)


def _argv(src: Path, dst: Path, *flags: str) -> list[str]:
    return ["run", "-i", str(src), "-o", str(dst), "--no-progress", *flags]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags", [(), ("--resume",), ("--retry-failed",)])
def test_a_second_run_on_a_locked_output_is_refused_and_changes_nothing(
    tmp_path, monkeypatch, capsys, holder, flags
):
    from batchgen.entrypoints import cli, cli_flags

    src, dst, before = _failed_job(tmp_path)
    with dst.open("ab") as f:
        f.write(b'{"custom_id": "hal')  # a half-written line: not cut either
    before = dst.read_bytes()
    started = []
    monkeypatch.setattr(cli_flags, "start_engine", lambda kw: started.append(kw) or FakeEngine())
    proc = holder(dst)
    capsys.readouterr()
    assert cli.main(_argv(src, dst, *flags)) == 2 and started == []
    assert capsys.readouterr().err == (
        f"batchgen run: error: another batchgen run (pid {proc.pid}) is writing {dst} (it holds "
        f"{tmp_path / '.out.jsonl.lock'}); wait for it to end, or stop it: two runs on one "
        "output would write some results twice or lose some\n"
    )
    assert dst.read_bytes() == before
    # Through a symlink to it: the same lock.
    link = tmp_path / "link.jsonl"
    link.symlink_to(dst)
    assert cli.main(_argv(src, link, *flags)) == 2 and started == []
    # Its holder killed (SIGKILL: the lock file stays), the next run goes on and cleans up.
    proc.kill()
    proc.wait(timeout=10)
    assert (tmp_path / ".out.jsonl.lock").exists()
    assert cli.main(_argv(src, dst, "--retry-failed")) == 0 and len(started) == 1
    assert _keys(dst) == Counter({("a", None): 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "link.jsonl", "out.jsonl"]


@pytest.mark.timeout(30)
def test_the_lock_is_taken_again_when_its_file_was_replaced(tmp_path, monkeypatch):
    """A run that locked a lock file another run removed (at its end) in between locks the
    file now at that path instead."""
    from batchgen.entrypoints import output_lock as lock_module

    dst = tmp_path / "out.jsonl"
    checks = []
    same_file = lock_module._same_file

    def replaced_once(fd, path):
        checks.append(path)
        return len(checks) > 1 and same_file(fd, path)

    monkeypatch.setattr(lock_module, "_same_file", replaced_once)
    with lock_module.output_lock(dst) as held:
        assert held == tmp_path / ".out.jsonl.lock" and len(checks) == 2
        assert held.read_text() == f"{os.getpid()}\n"
        with pytest.raises(lock_module.OutputLockedError):
            with lock_module.output_lock(dst):
                pass
    assert not held.exists()
    with lock_module.output_lock(dst):  # free again
        pass


# ---- symlinks where batchgen keeps its own files


@pytest.mark.timeout(30)
@pytest.mark.parametrize("target", ["out.jsonl", "elsewhere.jsonl"])
def test_a_symlink_left_at_the_temporary_path_is_not_written_through(tmp_path, target):
    """A symlink at ``.out.jsonl.retry-failed.tmp`` (to the output itself, or to any file) was
    opened for writing and truncated its target: the output lost every result."""
    src, dst, before = _failed_job(tmp_path)
    elsewhere = tmp_path / "elsewhere.jsonl"
    elsewhere.write_bytes(b"keep me\n")
    (tmp_path / ".out.jsonl.retry-failed.tmp").symlink_to(target)
    summary = run(FakeEngine(), src, dst, retry_failed=True)
    assert (summary.succeeded, summary.dropped_errors) == (1, 1)
    assert _keys(dst) == Counter({("a", None): 1})
    assert elsewhere.read_bytes() == b"keep me\n"
    assert not dst.is_symlink()
    assert not (tmp_path / ".out.jsonl.retry-failed.tmp").exists()


@pytest.mark.timeout(30)
def test_a_symlink_at_the_lock_path_is_refused_not_followed(tmp_path, monkeypatch, capsys):
    from batchgen.entrypoints import cli, cli_flags

    src, dst, before = _failed_job(tmp_path)
    (tmp_path / ".out.jsonl.lock").symlink_to("out.jsonl")
    monkeypatch.setattr(cli_flags, "start_engine", lambda kw: FakeEngine())
    capsys.readouterr()
    assert cli.main(_argv(src, dst, "--retry-failed")) == 2
    assert capsys.readouterr().err == (
        f"batchgen run: error: {tmp_path / '.out.jsonl.lock'} (where batchgen run keeps the "
        f"lock of {dst}) is a symlink; remove it\n"
    )
    assert dst.read_bytes() == before


@pytest.mark.timeout(30)
@pytest.mark.parametrize("flag", ["--resume", "--retry-failed"])
def test_resuming_into_a_fifo_is_refused_instead_of_waiting_forever(
    tmp_path, monkeypatch, capsys, flag
):
    from batchgen.entrypoints import cli, cli_flags
    from batchgen.entrypoints.batch_runner import BatchFileError

    src = write_lines(tmp_path / "in.jsonl", [completion_line("a")])
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    started = []
    monkeypatch.setattr(cli_flags, "start_engine", lambda kw: started.append(kw) or FakeEngine())
    capsys.readouterr()
    assert cli.main(_argv(src, fifo, flag)) == 2 and started == []
    assert capsys.readouterr().err == (
        f"batchgen run: error: --resume reads the results already in the output, but {fifo} "
        "is a pipe; name a file for the results, or run without --resume\n"
    )
    with pytest.raises(BatchFileError):
        run(FakeEngine(), src, fifo, resume=True)


# ---- a duplicate's error line, and the input edited since


def _dup_error(custom_id: str, line: int, first_line: int) -> bytes:
    from batchgen.entrypoints.openai_protocol import duplicate_custom_id_line

    return (json.dumps(duplicate_custom_id_line(custom_id, line, first_line)) + "\n").encode()


@pytest.mark.timeout(30)
def test_a_stale_duplicate_error_does_not_answer_the_first_use_of_its_custom_id(tmp_path):
    """Killed while line 1 ("a") ran, after line 2's duplicate error was written; line 1 then
    edited to "b". Line 2 is now the first "a": the old error keyed (2, "a") is no answer
    for it, so it must run (it was skipped on every resume, never answered)."""
    src = write_lines(tmp_path / "in.jsonl", [completion_line("b"), completion_line("a")])
    dst = tmp_path / "out.jsonl"
    done = tmp_path / "done.jsonl"
    run(FakeEngine(), write_lines(tmp_path / "c.jsonl", [completion_line("c")]), done)
    write_lines(src, [completion_line("b"), completion_line("a"), completion_line("c")])
    dst.write_bytes(_dup_error("a", 2, 1) + done.read_bytes())
    summary = run(FakeEngine(), src, dst, resume=True)
    assert (summary.skipped, summary.succeeded, summary.failed) == (1, 2, 0)
    assert _keys(dst) == Counter(
        {("a", "duplicate_custom_id"): 1, ("a", None): 1, ("b", None): 1, ("c", None): 1}
    )  # the stale error stays (a result for no line now: --resume warns about it)


@pytest.mark.timeout(30)
def test_a_later_duplicate_is_answered_after_a_stale_duplicate_error(tmp_path):
    """Input [a, a] run (a ok, (2, "a") duplicate); line 1 edited to "b" and a third "a"
    added: line 2 is the first "a" (answered by the old success), line 3 its duplicate."""
    lines = [completion_line("a"), completion_line("a")]
    src, dst = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    run(FakeEngine(), src, dst)
    write_lines(src, [completion_line("b"), completion_line("a"), completion_line("a")])
    summary = run(FakeEngine(), src, dst, resume=True)
    assert (summary.skipped, summary.succeeded, summary.failed) == (1, 1, 1)
    dups = [r["error"]["line"] for r in read_results(dst) if r["error"]]
    assert sorted(dups) == [2, 3]  # the stale one (now for no line) and line 3's
    again = run(FakeEngine(), src, dst, resume=True)
    assert (again.skipped, again.succeeded, again.failed) == (3, 0, 0)


@pytest.mark.timeout(30)
@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_retry_failed_as_root_keeps_the_outputs_owner(tmp_path):
    src, dst, before = _failed_job(tmp_path)
    os.chown(dst, 12345, 23456)
    dst.chmod(0o640)
    summary = run(FakeEngine(), src, dst, retry_failed=True)
    assert (summary.succeeded, summary.dropped_errors) == (1, 1)
    st = dst.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (12345, 23456, 0o640)


@pytest.mark.timeout(30)
def test_the_foreign_warning_names_a_numeric_custom_id_as_it_is(tmp_path, caplog):
    import logging

    src = write_lines(tmp_path / "in.jsonl", [completion_line("a")])
    dst = tmp_path / "out.jsonl"
    run(FakeEngine(), src, dst)
    ok = {"id": "x", "response": {"status_code": 200, "body": {}}, "error": None}
    with dst.open("a") as f:
        for custom_id in (7, None, ["x"] * 20):
            f.write(json.dumps({**ok, "custom_id": custom_id}) + "\n")
    write_lines(src, [completion_line("a"), completion_line("b")])
    with caplog.at_level(logging.WARNING, logger="batchgen.entrypoints.batch_resume"):
        run(FakeEngine(), src, dst, resume=True)
    assert [r.getMessage() for r in caplog.records] == [
        f"{dst}: 3 of its 4 results are for no request of {src} (custom_ids custom_id 7, "
        'custom_id null, custom_id ["x", "x", "x", "x", "x", "x", "x", "x"…); they stay in the '
        "output (lines deleted from the input?)"
    ]
