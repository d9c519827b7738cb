"""`run_batch_file` and `batchgen run` against a fake engine (no model, milliseconds)."""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from pathlib import Path

import pytest

from batchgen.entrypoints import cli, cli_flags
from batchgen.entrypoints.batch_runner import (
    BatchFileError,
    load_resume_state,
    run_batch_file,
    truncate_partial_last_line,
)
from batchgen.entrypoints.openai_protocol import (
    CHAT_COMPLETIONS_URL,
    COMPLETIONS_URL,
    BlankLines,
)
from batchgen.outputs import CompletionOutput, Logprob, RequestOutput
from batchgen.sampling_params import SamplingParams

REPLY = "generated!"  # every sample generates a prefix of this


class CharTokenizer:
    """Token id = code point (ids < 256)."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


class Stop(Exception):
    """Raised by the fake engine to simulate a crash after some steps."""


class FakeEngine:
    """Deterministic stand-in for `LLMEngine`.

    Requests finish first-in first-out, ``per_step`` per step. A sample generates the first
    ``max_tokens`` characters of `REPLY` (finish "length"), or all of it (finish "stop"). The
    prompt "FAIL" fails inside the engine; prompts longer than ``max_model_len`` or token ids
    >= 256 are rejected by ``add_request`` with ValueError, as the real engine does.
    """

    model_name = "fake-model"
    max_model_len = 64

    def __init__(self, *, per_step: int = 2, limit: int | None = None, crash_after: int = -1):
        self.tokenizer = CharTokenizer()
        self.per_step = per_step
        self.limit = limit
        self.crash_after = crash_after
        self.requests: dict[str, tuple[list[int], str | None, SamplingParams]] = {}
        self.max_unfinished = 0
        self.num_steps = 0
        self.aborted: list[str] = []
        self.chat_calls: list[list[dict]] = []
        self.before_step = None  # optional callback(engine)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        self.chat_calls.append(messages)
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
        return self.tokenizer.encode(text)

    def add_request(
        self, request_id: str, prompt, params: SamplingParams, *, max_tokens_must_fit=False
    ) -> None:
        assert isinstance(params, SamplingParams)
        assert request_id not in self.requests
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) > self.max_model_len:
            err = ValueError(f"prompt has {len(ids)} tokens, more than max_model_len 64")
            err.code = "context_length_exceeded"  # as `LLMEngine.add_request` marks it
            raise err
        if max(ids) >= 256:
            raise ValueError(f"token id {max(ids)} is out of range [0, 256)")
        self.requests[request_id] = (ids, prompt if isinstance(prompt, str) else None, params)
        self.max_unfinished = max(self.max_unfinished, len(self.requests))
        if self.limit is not None:
            assert len(self.requests) <= self.limit, "more requests in flight than allowed"

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def step(self) -> list[RequestOutput]:
        if self.before_step is not None:
            self.before_step(self)
        if self.num_steps == self.crash_after:
            raise Stop("simulated crash")
        self.num_steps += 1
        done = list(self.requests)[: self.per_step]
        return [self._output(rid, *self.requests.pop(rid)) for rid in done]

    def _output(self, rid: str, ids: list[int], text: str | None, params: SamplingParams):
        if text == "FAIL":
            return RequestOutput(rid, text, ids, finished=True, error="kernel exploded")
        length = min(params.max_tokens or len(REPLY), len(REPLY))
        samples = []
        for index in range(params.n):
            tokens = self.tokenizer.encode(REPLY[:length])
            logprobs = None
            if params.logprobs is not None:
                logprobs = [{t: Logprob(-0.5, 1), 0: Logprob(-3.0, 2)} for t in tokens]
            finish = "stop" if length == len(REPLY) else "length"
            samples.append(CompletionOutput(index, REPLY[:length], tokens, None, logprobs, finish))
        return RequestOutput(rid, text, ids, outputs=samples, finished=True)


def completion_line(custom_id: str, prompt="Hello", **body) -> str:
    body = {"model": "fake-model", "prompt": prompt, "max_tokens": 4, **body}
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": COMPLETIONS_URL, "body": body}
    )


def chat_line(custom_id: str, content: str = "Hi", **body) -> str:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 3, **body}
    return json.dumps({"custom_id": custom_id, "url": CHAT_COMPLETIONS_URL, "body": body})


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def read_results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def by_id(results: list[dict]) -> dict[str, dict]:
    return {r["custom_id"]: r for r in results if r["custom_id"] is not None}


def run(engine, src: Path, dst: Path, **kwargs):
    return run_batch_file(engine, src, dst, progress=False, **kwargs)


MIXED = [
    completion_line("ok-1"),
    "{this is not json",
    "[1, 2, 3]",
    json.dumps({"url": COMPLETIONS_URL, "body": {"prompt": "no id"}}),
    completion_line("ok-2", n=2, logprobs=1),
    completion_line("ok-1", prompt="again"),  # duplicate custom_id
    json.dumps({"custom_id": "bad-url", "url": "/v1/embeddings", "body": {"input": "x"}}),
    completion_line("bad-temp", temperature="hot"),
    completion_line("stream", stream=True),
    completion_line("too-long", prompt="x" * 100),
    completion_line("engine-fail", prompt="FAIL"),
    "",
    '{"prompt": "plain line"}',
    chat_line("chat-1", logprobs=True, top_logprobs=1),
    completion_line("ok-3", max_tokens=None),
]


def test_mixed_file_runs_every_good_line(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", MIXED)
    engine = FakeEngine()
    summary = run(engine, src, tmp_path / "out.jsonl")
    results = read_results(tmp_path / "out.jsonl")

    assert (summary.total, summary.succeeded, summary.failed, summary.skipped) == (14, 5, 9, 0)
    assert len(results) == 14
    ok = {r["custom_id"] for r in results if r["error"] is None}
    assert ok == {"ok-1", "ok-2", "line-13", "chat-1", "ok-3"}
    codes = Counter(r["error"]["code"] for r in results if r["error"] is not None)
    assert codes == {
        "invalid_json_line": 2,
        "missing_required_parameter": 1,
        "duplicate_custom_id": 1,
        "invalid_url": 1,
        "invalid_request": 1,
        "unsupported_parameter": 1,
        "context_length_exceeded": 1,
        "request_failed": 1,
    }
    errors = [r["error"] for r in results if r["error"] is not None]
    assert sorted(e["line"] for e in errors) == [2, 3, 4, 6, 7, 8, 9, 10, 11]
    assert by_id(results)["too-long"]["error"]["param"] == "prompt"
    assert all(e["message"].startswith(f"line {e['line']}: ") for e in errors)
    dup = next(r for r in results if r["error"] and r["error"]["code"] == "duplicate_custom_id")
    assert dup["custom_id"] == "ok-1"
    assert dup["error"]["message"] == 'line 6: custom_id "ok-1" already used on line 1'
    # the first "ok-1" succeeded with its own prompt
    first = next(r for r in results if r["custom_id"] == "ok-1" and r["error"] is None)
    assert first["response"]["body"]["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 4,
        "total_tokens": 9,
    }
    assert summary.prompt_tokens == sum(
        r["response"]["body"]["usage"]["prompt_tokens"] for r in results if r["error"] is None
    )
    # ok-1: 4, ok-2: 2 x 4, plain line (OpenAI default 16) and ok-3 (null): all of REPLY, chat: 3
    assert summary.generated_tokens == 4 + 2 * 4 + len(REPLY) + 3 + len(REPLY)


def test_success_bodies(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", MIXED)
    run(FakeEngine(), src, tmp_path / "out.jsonl")
    results = by_id(read_results(tmp_path / "out.jsonl"))

    ok2 = results["ok-2"]["response"]
    assert ok2["status_code"] == 200 and ok2["request_id"].startswith("req_")
    body = ok2["body"]
    assert (body["object"], body["model"]) == ("text_completion", "fake-model")
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["text"] == "gene" and body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][1]["logprobs"]["tokens"] == list("gene")
    assert body["choices"][1]["logprobs"]["top_logprobs"][0] == {"g": -0.5, "\x00": -3.0}

    chat = results["chat-1"]["response"]["body"]
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "gen"}
    assert len(chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 1

    ok3 = results["ok-3"]["response"]["body"]["choices"][0]  # max_tokens null: to the end
    assert (ok3["text"], ok3["finish_reason"]) == (REPLY, "stop")


def test_blank_lines_between_requests_are_skipped_with_a_warning(tmp_path, caplog):
    lines = ["", completion_line("a"), "", "  \t ", completion_line("b"), "", "   "]
    src = write_lines(tmp_path / "in.jsonl", lines)
    with caplog.at_level(logging.WARNING, logger="batchgen.entrypoints.batch_runner"):
        summary = run(FakeEngine(), src, tmp_path / "out.jsonl")
    assert (summary.total, summary.succeeded, summary.failed) == (2, 2, 0)
    assert summary.blank_lines == 3  # lines 1, 3, 4; the trailing lines 6 and 7 are not counted
    assert sorted(r["custom_id"] for r in read_results(tmp_path / "out.jsonl")) == ["a", "b"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "skipped 3 blank lines (lines 1, 3, 4) between requests" in warnings[0]
    assert "in.jsonl" in warnings[0]
    assert "3 blank lines skipped" in summary.describe()


def test_requests_naming_another_model_run_with_one_warning_per_name(tmp_path, caplog):
    lines = [
        completion_line("a", model="gpt-4o-mini"),
        completion_line("b", model="gpt-4o-mini"),
        completion_line("c"),  # the served name: no warning
        chat_line("d"),  # no model: no warning
        chat_line("e", model="gpt-3.5-turbo-instruct"),
        completion_line("f", model="gpt-4o-mini", temperature="hot"),  # did not run
        completion_line("g", model="gpt-4o-mini"),
    ]
    src = write_lines(tmp_path / "in.jsonl", lines)
    with caplog.at_level(logging.WARNING, logger="batchgen.entrypoints.batch_runner"):
        summary = run(FakeEngine(), src, tmp_path / "out.jsonl")
    assert (summary.succeeded, summary.failed) == (6, 1)
    results = by_id(read_results(tmp_path / "out.jsonl"))
    assert results["a"]["response"]["body"]["model"] == "fake-model"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"{src}: 3 lines name model 'gpt-4o-mini'; they ran on 'fake-model' "
        "(--served-model-name sets the name)",
        f"{src}: 1 line names model 'gpt-3.5-turbo-instruct'; it ran on 'fake-model' "
        "(--served-model-name sets the name)",
    ]


@pytest.mark.parametrize("tail", ["\n", "\n\n", "\n  \n"])
def test_a_trailing_newline_or_empty_last_line_is_silent(tmp_path, caplog, tail):
    src = tmp_path / "in.jsonl"
    src.write_text(completion_line("a") + "\n" + completion_line("b") + tail)
    with caplog.at_level(logging.WARNING, logger="batchgen.entrypoints.batch_runner"):
        summary = run(FakeEngine(), src, tmp_path / "out.jsonl")
    assert (summary.total, summary.succeeded, summary.blank_lines) == (2, 2, 0)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "blank" not in summary.describe()


def test_blank_lines_listed_up_to_a_limit():
    blank = BlankLines()
    lines = ["x"] + [""] * 25 + ["x", ""]
    assert [blank.skip(i, raw) for i, raw in enumerate(lines, start=1)] == [
        False,
        *[True] * 25,
        False,
        True,
    ]
    assert (blank.count, blank.lines) == (25, list(range(2, 22)))
    assert blank.describe() == f"25 blank lines (lines {', '.join(map(str, range(2, 22)))}, ...)"


def test_chat_goes_through_the_chat_template(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [chat_line("c", content="Bonjour")])
    engine = FakeEngine()
    run(engine, src, tmp_path / "out.jsonl")
    assert engine.chat_calls == [[{"role": "user", "content": "Bonjour"}]]
    usage = read_results(tmp_path / "out.jsonl")[0]["response"]["body"]["usage"]
    assert usage["prompt_tokens"] == len("<user>Bonjour<assistant>")


def test_max_in_flight_is_respected(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [completion_line(f"r{i}") for i in range(10)])
    engine = FakeEngine(per_step=1, limit=3)
    summary = run(engine, src, tmp_path / "out.jsonl", max_in_flight=3)
    assert summary.succeeded == 10
    assert engine.max_unfinished == 3  # used, never exceeded (the fake asserts)
    with pytest.raises(ValueError, match="max_in_flight"):
        run(engine, src, tmp_path / "out.jsonl", max_in_flight=0)


def test_results_are_written_as_they_finish(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [completion_line(f"r{i}") for i in range(6)])
    dst = tmp_path / "out.jsonl"
    engine = FakeEngine(per_step=2)
    seen_before_step: list[int] = []
    engine.before_step = lambda _: seen_before_step.append(len(read_results(dst)))
    run(engine, src, dst)
    assert seen_before_step == [0, 2, 4]


def test_engine_exceptions_propagate_and_keep_finished_results(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [completion_line(f"r{i}") for i in range(6)])
    dst = tmp_path / "out.jsonl"
    engine = FakeEngine(per_step=2, crash_after=1)
    with pytest.raises(Stop):
        run(engine, src, dst)
    assert [r["custom_id"] for r in read_results(dst)] == ["r0", "r1"]
    assert len(engine.aborted) == 4 and not engine.requests  # in-flight requests aborted


class LostEngine(FakeEngine):
    def step(self):
        self.requests.clear()
        return []


def test_an_engine_that_loses_requests_is_a_bug_not_a_hang(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [completion_line("r0")])
    with pytest.raises(RuntimeError, match="no unfinished requests"):
        run(LostEngine(), src, tmp_path / "out.jsonl")


def test_existing_output_is_overwritten_without_resume(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [completion_line("a")])
    dst = write_lines(tmp_path / "out.jsonl", ['{"custom_id": "old"}', "garbage"])
    run(FakeEngine(), src, dst)
    assert [r["custom_id"] for r in read_results(dst)] == ["a"]


def test_resume_after_a_crash_runs_each_custom_id_exactly_once(tmp_path):
    lines = [completion_line(f"r{i}") for i in range(8)]
    lines[3] = "{broken"
    lines.append(completion_line("r1"))  # duplicate, line 9
    src = write_lines(tmp_path / "in.jsonl", lines)
    dst = tmp_path / "out.jsonl"
    with pytest.raises(Stop):
        run(FakeEngine(per_step=2, crash_after=2), src, dst, max_in_flight=4)
    first = read_results(dst)
    with dst.open("ab") as f:  # a line half-written when the process was killed
        f.write(b'{"id": "batch_req_1", "custom_id": "r7", "respo')

    engine = FakeEngine(per_step=3)
    summary = run(engine, src, dst, resume=True)
    results = read_results(dst)
    assert results[: len(first)] == first  # old results kept, untouched
    ids = Counter(r["custom_id"] for r in results)
    assert ids == {**{f"r{i}": 1 for i in range(8) if i != 3}, "r1": 2, None: 1}
    assert summary.skipped == len(first) and summary.total == 9
    assert summary.succeeded + summary.failed == 9 - len(first)

    # a second resume has nothing left to do
    again = run(FakeEngine(), src, dst, resume=True)
    assert (again.skipped, again.succeeded, again.failed) == (9, 0, 0)
    assert read_results(dst) == results


def test_an_invalid_json_line_keeps_the_custom_id_its_text_names_and_resume_skips_it(tmp_path):
    lines = [
        completion_line("a"),
        '{"custom_id": "bad-json", "url": "/v1/completions", "body": {"prompt": "x"',  # cut short
        completion_line("b"),
        '{"custom_id": "c1", "custom_id": "c2", "body":',  # two: no id recovered
        completion_line("bad-json"),  # a valid line with the id: a duplicate, as for any error
    ]
    src = write_lines(tmp_path / "in.jsonl", lines)
    dst = tmp_path / "out.jsonl"
    with pytest.raises(Stop):  # killed after the error lines and one success are written
        run(FakeEngine(per_step=1, crash_after=1), src, dst)
    first = read_results(dst)
    bad = next(r for r in first if r["error"] and r["error"]["line"] == 2)
    assert bad["custom_id"] == "bad-json" and bad["error"]["code"] == "invalid_json_line"
    assert bad["error"]["message"].startswith("line 2: not valid JSON at column")
    no_id = next(r for r in first if r["error"] and r["error"]["line"] == 4)
    assert no_id["custom_id"] is None
    dup = next(r for r in first if r["error"] and r["error"]["line"] == 5)
    assert (dup["custom_id"], dup["error"]["code"]) == ("bad-json", "duplicate_custom_id")
    assert dup["error"]["message"] == 'line 5: custom_id "bad-json" already used on line 2'

    summary = run(FakeEngine(), src, dst, resume=True)
    assert summary.skipped == len(first) and summary.failed == 0
    results = read_results(dst)
    keys = Counter((r["custom_id"], r["error"] and r["error"]["line"]) for r in results)
    assert keys == {("a", None): 1, ("b", None): 1, ("bad-json", 2): 1, (None, 4): 1,
                    ("bad-json", 5): 1}  # every line answered exactly once
    assert run(FakeEngine(), src, dst, resume=True).skipped == 5


def test_resume_runs_a_first_occurrence_whose_duplicate_was_already_reported(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [completion_line("a"), completion_line("a")])
    dst = tmp_path / "out.jsonl"
    dup = {
        "id": "batch_req_0",
        "custom_id": "a",
        "response": None,
        "error": {"code": "duplicate_custom_id", "message": "line 2: ...", "line": 2},
    }
    write_lines(dst, [json.dumps(dup)])  # killed before line 1 finished
    summary = run(FakeEngine(), src, dst, resume=True)
    assert (summary.succeeded, summary.failed, summary.skipped) == (1, 0, 1)
    results = read_results(dst)
    assert [r["error"] is None for r in results] == [False, True]


def test_resume_answers_a_line_inserted_where_a_duplicate_was_reported(tmp_path):
    """A duplicate's error line is keyed by its line number and custom_id: a new line inserted
    at that number since is run, not skipped, and the moved duplicate gets its own error."""
    src = write_lines(tmp_path / "in.jsonl", [completion_line("r1"), completion_line("r1")])
    dst = tmp_path / "out.jsonl"
    first = run(FakeEngine(), src, dst)
    assert (first.succeeded, first.failed) == (1, 1)
    lines = [completion_line("r1"), completion_line("r2-new"), completion_line("r1")]
    write_lines(src, lines)
    summary = run(FakeEngine(), src, dst, resume=True)
    assert (summary.succeeded, summary.failed, summary.skipped) == (1, 1, 1)
    results = read_results(dst)
    assert {(r["custom_id"], r["error"] and r["error"]["line"]) for r in results} == {
        ("r1", None), ("r1", 2), ("r2-new", None), ("r1", 3)
    }
    assert run(FakeEngine(), src, dst, resume=True).skipped == 3


def test_resume_without_an_output_file_starts_fresh(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [completion_line("a")])
    summary = run(FakeEngine(), src, tmp_path / "new.jsonl", resume=True)
    assert summary.succeeded == 1


def test_resume_refuses_a_file_that_is_not_a_result_file(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [completion_line("a")])
    dst = write_lines(tmp_path / "out.jsonl", ["not json", '{"custom_id": "a"}'])
    with pytest.raises(BatchFileError, match="out.jsonl:1 is not a batch result line"):
        run(FakeEngine(), src, dst, resume=True)


@pytest.mark.parametrize(
    "content",
    [b"hello\nworld", b"PK\x03\x04binary without newline", b'{"custom_id": "a"}\nnot json\n'],
)
def test_resume_on_a_foreign_file_changes_nothing_in_it(tmp_path, content):
    src = write_lines(tmp_path / "in.jsonl", [completion_line("a")])
    dst = tmp_path / "notes.txt"
    dst.write_bytes(content)
    with pytest.raises(BatchFileError, match="cannot resume"):
        run(FakeEngine(), src, dst, resume=True)
    assert dst.read_bytes() == content


def test_input_from_a_pipe_is_streamed(tmp_path):
    import os
    import threading

    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    lines = [completion_line(f"p{i}") for i in range(5)]

    def feed():
        with open(fifo, "w") as f:
            f.write("\n".join(lines) + "\n")

    writer = threading.Thread(target=feed)
    writer.start()
    dst = tmp_path / "out.jsonl"
    run(FakeEngine(), fifo, dst)
    writer.join()
    assert sorted(r["custom_id"] for r in read_results(dst)) == [f"p{i}" for i in range(5)]


def test_truncate_partial_last_line(tmp_path):
    path = tmp_path / "f"
    for content, kept in [
        (b"", b""),
        (b"a\nb\n", b"a\nb\n"),
        (b"a\nb\npart", b"a\nb\n"),
        (b"no newline", b""),
        (b"x" * 70000 + b"\n" + b"y" * 70000, b"x" * 70000 + b"\n"),
    ]:
        path.write_bytes(content)
        assert truncate_partial_last_line(path) == len(content) - len(kept)
        assert path.read_bytes() == kept


def test_load_resume_state(tmp_path):
    rows = [
        {"custom_id": "ok", "response": {}, "error": None},
        {"custom_id": "bad", "response": None, "error": {"code": "invalid_request", "line": 2}},
        {"custom_id": None, "response": None, "error": {"code": "invalid_json_line", "line": 3}},
        {"custom_id": "ok", "response": None, "error": {"code": "duplicate_custom_id", "line": 4}},
    ]
    path = write_lines(tmp_path / "out.jsonl", [json.dumps(r) for r in rows])
    state = load_resume_state(path)
    assert state.done_ids == {"ok", "bad"} and state.done_lines == {(3, None), (4, "ok")}


def test_file_errors(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [completion_line("a")])
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        run(FakeEngine(), tmp_path / "missing.jsonl", tmp_path / "out.jsonl")
    with pytest.raises(BatchFileError, match="is the input file"):
        run(FakeEngine(), src, src)
    assert read_results(src)[0]["custom_id"] == "a"  # the input is untouched


def test_progress_bar_goes_to_stderr(tmp_path, capsys):
    src = write_lines(tmp_path / "in.jsonl", [completion_line(f"r{i}") for i in range(3)])
    run_batch_file(FakeEngine(), src, tmp_path / "out.jsonl", progress=True)
    captured = capsys.readouterr()
    assert captured.out == "" and "3/3" in captured.err and "gen tok/s" in captured.err


# ------------------------------------------------------------------------------ CLI


def test_cli_run_with_a_fake_engine(tmp_path, monkeypatch, capsys):
    src = write_lines(tmp_path / "in.jsonl", [completion_line("a"), "", "{bad", ""])
    dst = tmp_path / "out.jsonl"
    given: dict = {}

    def fake_start(kwargs):
        given.update(kwargs)
        return FakeEngine()

    monkeypatch.setattr(cli_flags, "start_engine", fake_start)
    argv = ["run", "-i", str(src), "-o", str(dst), "--no-progress", "--max-num-seqs", "8"]
    assert cli.main([*argv, "--dtype", "float32", "--kv-cache-memory-gb", "0.5"]) == 0
    assert given == {"max_num_seqs": 8, "dtype": "float32", "kv_cache_memory_gb": 0.5}
    assert len(read_results(dst)) == 2
    err = capsys.readouterr().err
    assert "1 ok, 1 failed of 2 requests; 1 blank line skipped; " in err
    assert "generated tokens/s" in err
    assert "in.jsonl: skipped 1 blank line (line 2) between requests" in err


@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "-tp"])
def test_cli_run_accepts_vllms_tensor_parallel_size_1_and_refuses_others(
    tmp_path, monkeypatch, capsys, flag
):
    src = write_lines(tmp_path / "in.jsonl", [completion_line("a")])
    given: dict = {}

    def fake_start(kwargs):
        given.update(kwargs)
        return FakeEngine()

    monkeypatch.setattr(cli_flags, "start_engine", fake_start)
    argv = ["run", "-i", str(src), "-o", str(tmp_path / "out.jsonl"), "--no-progress"]
    assert cli.main([*argv, flag, "1"]) == 0
    assert given == {} and "1 ok, 0 failed" in capsys.readouterr().err  # a no-op
    for value, got in (("2", "2"), ("x", "'x'")):
        with pytest.raises(SystemExit) as info:
            cli.main([*argv, flag, value])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert (
            f"argument -tp/--tensor-parallel-size: must be 1, got {got}: "
            "BatchGen has no tensor parallelism (1 is accepted as a no-op); for several ranks "
            "use --data-parallel-size N --enable-expert-parallel"
        ) in err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["run", "-i", "{tmp}/missing.jsonl", "-o", "{tmp}/out.jsonl"], "does not exist"),
        (["run", "-i", "{tmp}/in.jsonl", "-o", "{tmp}/no/dir/out.jsonl"], "output directory"),
        (["run", "-i", "{tmp}/in.jsonl", "-o", "{tmp}/o", "--max-in-flight", "0"], ">= 1"),
        (["run", "-i", "{tmp}/in.jsonl", "-o", "{tmp}/in.jsonl"], "is the input file"),
    ],
)
def test_cli_user_errors_exit_2_with_one_line(tmp_path, monkeypatch, capsys, argv, words):
    write_lines(tmp_path / "in.jsonl", [completion_line("a")])
    monkeypatch.setattr(cli_flags, "start_engine", lambda kwargs: FakeEngine())
    assert cli.main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("batchgen run: error: ") and words in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["run", "-i", "{tmp}/in.jsonl", "-o", "{tmp}"], "output file '{tmp}' is a directory"),
        (["run", "-i", "{tmp}", "-o", "{tmp}/out.jsonl"], "input file '{tmp}' is a directory"),
        (["run", "-i", "{tmp}/in.jsonl", "-o", "{tmp}/in.jsonl"], "is the input file"),
        (["run", "-i", "{tmp}/in.jsonl", "-o", "{tmp}/link.jsonl"], "is the input file"),
    ],
)
def test_cli_a_directory_for_a_file_fails_before_the_engine_starts(
    tmp_path, monkeypatch, capsys, argv, words
):
    """Path mistakes fail before the model loads (minutes with a real checkpoint): a directory
    for a file, or the input named again as the output, by its path or through a link."""
    write_lines(tmp_path / "in.jsonl", [completion_line("a")])
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "in.jsonl")

    def no_engine(kwargs):
        raise AssertionError("the engine must not start")

    monkeypatch.setattr(cli_flags, "start_engine", no_engine)
    assert cli.main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("batchgen run: error: ") and words.format(tmp=tmp_path) in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_cli_an_input_without_requests_says_so_and_loads_no_model(
    tmp_path, monkeypatch, capsys, content
):
    src = tmp_path / "in.jsonl"
    src.write_text(content)
    out = tmp_path / "out.jsonl"
    out.write_text("stale\n")

    def no_engine(kwargs):
        raise AssertionError("the engine must not start")

    monkeypatch.setattr(cli_flags, "start_engine", no_engine)
    assert cli.main(["run", "-i", str(src), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"batchgen run: nothing to do: {src} has no request lines" in err
    assert out.read_bytes() == b""  # overwritten, as any run without --resume
    out.write_text("kept\n")
    assert cli.main(["run", "-i", str(src), "-o", str(out), "--resume"]) == 0
    assert out.read_text() == "kept\n"


def test_cli_engine_flags_follow_engine_config():
    parser = cli.build_parser()
    args = parser.parse_args(["run", "-i", "a", "-o", "b", "--max-model-len", "128"])
    assert cli.engine_kwargs(args) == {"max_model_len": 128}
    assert cli.engine_kwargs(parser.parse_args(["run", "-i", "a", "-o", "b"])) == {}
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "-i", "a", "-o", "b", "--block-size", "x"])


def test_output_to_dev_null_or_a_pipe_runs_without_fsync(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(completion_line("a", prompt="hi", max_tokens=2) + "\n")
    summary = run_batch_file(FakeEngine(), src, "/dev/null", progress=False)
    assert (summary.succeeded, summary.failed) == (1, 0)
    read_fd, write_fd = os.pipe()
    with os.fdopen(read_fd, "rb") as reader:
        summary = run_batch_file(FakeEngine(), src, f"/dev/fd/{write_fd}", progress=False)
        os.close(write_fd)
        (line,) = reader.read().decode().splitlines()
    assert (summary.succeeded, json.loads(line)["custom_id"]) == (1, "a")


def test_summary_reports_the_engine_prefix_cache(tmp_path):
    """`batchgen run`'s summary line says how many prompt tokens the prefix cache served (an
    engine without `get_metrics`, as `FakeEngine`, leaves it out)."""
    src = write_lines(tmp_path / "in.jsonl", [completion_line("a"), completion_line("b")])
    summary = run(FakeEngine(), src, tmp_path / "out.jsonl")
    assert "prefix cache" not in summary.describe()
    engine = FakeEngine()
    engine.get_metrics = lambda: {"prefix_cache_queries": 400, "prefix_cache_hits": 300}
    summary = run(engine, src, tmp_path / "out2.jsonl")
    assert (summary.prefix_cache_queries, summary.prefix_cache_hits) == (400, 300)
    assert "prefix cache: 300 of 400 prompt tokens cached (75.0%)" in summary.describe()
