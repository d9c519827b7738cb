"""``batchgen run -i -``: the batch from standard input, in process with a fake engine (file
descriptor 0 swapped for a pipe, a file, a terminal or nothing). Before, ``-i -`` was refused as
"input file '-' does not exist", and ``-o -`` wrote a file named "-"."""

from __future__ import annotations

import contextlib
import os

import pytest
from test_batch_runner import FakeEngine, completion_line, read_results

from batchgen.entrypoints import cli, cli_flags


class RecordingEngine(FakeEngine):
    """A `FakeEngine` that keeps the prompt of every request added."""

    def __init__(self) -> None:
        super().__init__()
        self.prompts: list[str] = []

    def add_request(self, request_id, prompt, params, **kwargs) -> None:
        self.prompts.append(prompt)
        super().add_request(request_id, prompt, params, **kwargs)


@pytest.fixture
def engines(monkeypatch):
    """Each engine `batchgen run` starts (a `RecordingEngine`)."""
    started: list[RecordingEngine] = []

    def start(kwargs):
        started.append(RecordingEngine())
        return started[-1]

    monkeypatch.setattr(cli_flags, "start_engine", start)
    return started


@contextlib.contextmanager
def stdin_fd(fd: int | None):
    """File descriptor 0 is ``fd`` (closed when None) inside the block, then as it was."""
    saved = os.dup(0)
    try:
        if fd is None:
            os.close(0)
        else:
            os.dup2(fd, 0)
        yield
    finally:
        os.dup2(saved, 0)
        os.close(saved)


@contextlib.contextmanager
def piped(text: str):
    """Standard input is a pipe holding ``text`` (then end of file), as ``zcat f | ...``."""
    read_end, write_end = os.pipe()
    os.write(write_end, text.encode())  # a few lines: within the pipe's buffer
    os.close(write_end)
    try:
        with stdin_fd(read_end):
            yield
    finally:
        os.close(read_end)


LINES = [completion_line(c, prompt=f"prompt {c}") for c in ("a", "b", "c")]
TEXT = "".join(line + "\n" for line in LINES)


def test_dash_reads_a_pipe_on_standard_input(tmp_path, engines, capsys):
    out = tmp_path / "out.jsonl"
    with piped(TEXT):
        assert cli.main(["run", "-i", "-", "-o", str(out), "--no-progress"]) == 0
    assert sorted(r["custom_id"] for r in read_results(out)) == ["a", "b", "c"]
    assert all(r["error"] is None for r in read_results(out))
    assert engines[0].prompts == ["prompt a", "prompt b", "prompt c"]
    err = capsys.readouterr().err
    assert err.startswith("batchgen run: 3 ok, 0 failed of 3 requests; ")
    assert err.endswith(f"; results in {out}\n")


def test_dash_reads_a_file_redirected_to_standard_input(tmp_path, engines):
    """``batchgen run -i - < in.jsonl``: a regular file, counted for the progress bar."""
    src = tmp_path / "in.jsonl"
    src.write_text(TEXT)
    out = tmp_path / "out.jsonl"
    with open(src, "rb") as f, stdin_fd(f.fileno()):
        assert cli.main(["run", "-i", "-", "-o", str(out)]) == 0
    assert sorted(r["custom_id"] for r in read_results(out)) == ["a", "b", "c"]


def test_resume_with_the_same_lines_piped_again_runs_only_the_missing(tmp_path, engines):
    """As with ``-i <(zcat in.jsonl.gz)``: a pipe is read once per run, and --resume skips the
    custom_ids the output already holds, so feeding the same input again finishes the job."""
    out = tmp_path / "out.jsonl"
    argv = ["run", "-i", "-", "-o", str(out), "--no-progress", "--resume"]
    with piped(TEXT):
        assert cli.main(argv) == 0
    kept = [line for line in out.read_text().splitlines() if '"custom_id":"b"' not in line]
    assert len(kept) == 2
    out.write_text("\n".join(kept) + "\n")
    with piped(TEXT):
        assert cli.main(argv) == 0
    assert engines[1].prompts == ["prompt b"]
    assert sorted(r["custom_id"] for r in read_results(out)) == ["a", "b", "c"]


def test_dash_output_is_refused(tmp_path, engines, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text(TEXT)
    assert cli.main(["run", "-i", str(src), "-o", "-"]) == 2
    assert capsys.readouterr().err == (
        "batchgen run: error: -o -: results are written to a file (the one --resume "
        "continues), not to standard output; name one, e.g. -o results.jsonl\n"
    )
    assert engines == [] and not os.path.exists("-")


def test_a_terminal_or_closed_standard_input_is_refused(tmp_path, engines, capsys):
    argv = ["run", "-i", "-", "-o", str(tmp_path / "out.jsonl")]
    leader, follower = os.openpty()
    try:
        with stdin_fd(follower):
            assert cli.main(argv) == 2
    finally:
        os.close(leader)
        os.close(follower)
    assert capsys.readouterr().err == (
        "batchgen run: error: -i -: standard input is a terminal; pipe the batch in (zcat "
        "in.jsonl.gz | batchgen run -i - ...) or pass its path\n"
    )
    with stdin_fd(None):
        assert cli.main(argv) == 2
    assert capsys.readouterr().err == (
        "batchgen run: error: -i -: standard input is closed; pipe the batch in or pass its path\n"
    )
    assert engines == [] and not (tmp_path / "out.jsonl").exists()
