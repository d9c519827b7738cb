"""The job store, validation/finalization and the engine loop without a server or a model:
SQLite store on tmp, a fake engine that finishes each request after a fixed number of steps."""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field

import pytest

from batchgen.engine.input_processor import ProcessedPrompt
from batchgen.outputs import CompletionOutput, RequestOutput
from batchgen.service import store as st
from batchgen.service.engine_loop import EngineLoop
from batchgen.service.jobs import JobWorker


def _line(custom_id: str, prompt: str = "hi", url: str = "/v1/completions", **body) -> str:
    return json.dumps(
        {"custom_id": custom_id, "url": url, "body": {"prompt": prompt, "max_tokens": 2, **body}}
    )


def _batch(store: st.Store, text: str, endpoint: str = "/v1/completions") -> dict:
    file = store.create_file([text.encode()], "in.jsonl", "batch")
    return store.create_batch(
        input_file_id=file["id"],
        endpoint=endpoint,
        completion_window="24h",
        metadata=None,
        window_s=86400,
    )


def _validate(store: st.Store, batch_id: str) -> None:
    ready = threading.Event()
    worker = JobWorker(store, on_ready=lambda _: ready.set(), on_change=lambda _: ready.set())
    worker.start()
    worker.validate(batch_id)
    assert ready.wait(10)
    worker.stop()


# ---------------------------------------------------------------------------------------------
# Store


def test_files_are_atomic_blobs_with_opaque_ids(tmp_path):
    store = st.Store(tmp_path)
    row = store.create_file([b"a\n", b"b\n"], "x.jsonl", "batch")
    assert st.FILE_ID_RE.match(row["id"]) and row["bytes"] == 4
    assert store.blob_path(row["id"]).read_bytes() == b"a\nb\n"
    for bad in ("../batchgen.sqlite3", "file-../../x", "/etc/passwd", "file-ABC"):
        with pytest.raises(ValueError):
            store.blob_path(bad)
    # A crash can leave a temporary file or a blob without its row: both go on reopen.
    (tmp_path / "files" / ".tmp-123").write_bytes(b"partial")
    orphan = st.new_file_id()
    (tmp_path / "files" / orphan).write_bytes(b"orphan")
    store.close()
    store = st.Store(tmp_path)
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == [row["id"]]
    assert store.delete_file(row["id"]) and not store.delete_file(row["id"])
    assert store.get_file(row["id"]) is None and not any((tmp_path / "files").iterdir())


def test_results_are_committed_once_in_storing_order(tmp_path):
    store = st.Store(tmp_path)
    batch = _batch(store, "".join(_line(f"r{i}") + "\n" for i in range(3)))
    _validate(store, batch["id"])
    pending = store.pending_requests(batch["id"], -1, 10)
    assert [p.idx for p in pending] == [0, 1, 2]
    store.commit_progress([(batch["id"], 2), (batch["id"], 0)], [])
    store.commit_progress([], [st.FinishedRequest(batch["id"], 2, True, '{"n": 2}', 3, 4)])
    store.commit_progress([], [st.FinishedRequest(batch["id"], 2, False, '{"late": 1}')])
    store.commit_progress([], [st.FinishedRequest(batch["id"], 0, False, '{"n": 0}')])
    results = store.results_after(batch["id"], 0, 10)
    assert [(r.done_seq, r.idx, r.result) for r in results] == [
        (1, 2, '{"n": 2}'),
        (2, 0, '{"n": 0}'),
    ]
    assert [r.idx for r in store.results_after(batch["id"], 1, 10)] == [0]
    assert [p.idx for p in store.pending_requests(batch["id"], -1, 10)] == [1]
    assert store.request_attempts(batch["id"]) == {0: 1, 1: 0, 2: 1}
    row = store.get_batch(batch["id"])
    assert (row["total"], row["completed"], row["failed"]) == (3, 1, 1)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (3, 4)


def test_finish_batch_writes_files_in_input_order(tmp_path):
    store = st.Store(tmp_path)
    batch = _batch(store, "".join(_line(f"r{i}") + "\n" for i in range(4)))
    _validate(store, batch["id"])
    b = batch["id"]
    store.commit_progress(
        [],
        [
            st.FinishedRequest(b, 3, True, '{"custom_id": "r3"}'),
            st.FinishedRequest(b, 1, True, '{"custom_id": "r1"}'),
            st.FinishedRequest(b, 0, False, '{"custom_id": "r0"}'),
        ],
    )
    assert store.transition(b, st.CANCELLING, expect=[st.IN_PROGRESS])
    assert store.fail_pending(b, lambda cid, line: json.dumps({"custom_id": cid})) == 1
    assert not store.finish_batch(b, st.CANCELLED, expect=[st.FINALIZING])
    assert len(list((tmp_path / "files").iterdir())) == 1  # only the input: nothing leaked
    assert store.finish_batch(b, st.CANCELLED, expect=[st.CANCELLING])
    row = store.get_batch(b)
    assert row["status"] == st.CANCELLED and row["cancelled_at"] is not None
    out = store.blob_path(row["output_file_id"]).read_text().splitlines()
    err = store.blob_path(row["error_file_id"]).read_text().splitlines()
    assert [json.loads(x)["custom_id"] for x in out] == ["r1", "r3"]
    assert [json.loads(x)["custom_id"] for x in err] == ["r0", "r2"]


def test_validation_rows_and_batch_level_failures(tmp_path):
    store = st.Store(tmp_path)
    text = "\n".join(
        [
            _line("a"),
            _line("a"),
            json.dumps({"custom_id": "b", "url": "/v1/chat/completions", "body": {"messages": []}}),
            "[1]",
            "",
            _line("c", stream=True),
        ]
    )
    batch = _batch(store, text + "\n")
    _validate(store, batch["id"])
    row = store.get_batch(batch["id"])
    assert row["status"] == st.IN_PROGRESS and (row["total"], row["failed"]) == (5, 4)
    errors = [json.loads(r.result)["error"] for r in store.results_after(row["id"], 0, 9)]
    assert errors[0]["message"] == 'line 2: custom_id "a" already used on line 1'
    assert [e["code"] for e in errors] == [
        "duplicate_custom_id",
        "invalid_request",  # chat line: its body is checked first (empty messages)
        "invalid_json_line",
        "unsupported_parameter",
    ]
    assert [p.line for p in store.pending_requests(row["id"], -1, 9)] == [1]

    deleted = _batch(store, _line("x") + "\n")
    store.delete_file(deleted["input_file_id"])
    _validate(store, deleted["id"])
    failed = store.get_batch(deleted["id"])
    assert failed["status"] == st.FAILED
    assert json.loads(failed["errors"])["data"][0]["code"] == "invalid_input_file"


def test_validation_warns_about_blank_lines_between_requests(tmp_path, caplog):
    store = st.Store(tmp_path)
    text = "\n".join(["", _line("a"), " ", "", _line("b"), "", ""])
    batch = _batch(store, text)
    with caplog.at_level(logging.WARNING, logger="batchgen.service.jobs"):
        _validate(store, batch["id"])
    row = store.get_batch(batch["id"])
    assert (row["total"], row["failed"]) == (2, 0)
    assert [p.line for p in store.pending_requests(row["id"], -1, 9)] == [2, 5]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and batch["id"] in warnings[0]
    assert "skipped 3 blank lines (lines 1, 3, 4) between requests" in warnings[0]

    caplog.clear()
    trailing = _batch(store, _line("c") + "\n\n")  # an empty last line: no warning
    with caplog.at_level(logging.WARNING, logger="batchgen.service.jobs"):
        _validate(store, trailing["id"])
    assert store.get_batch(trailing["id"])["total"] == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# ---------------------------------------------------------------------------------------------
# Engine loop with a fake engine


@dataclass
class _Stats:
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0


@dataclass
class _KV:
    usage: float = 0.0


@dataclass
class FakeEngine:
    """Finishes each request ``steps`` steps after it was added; records the add order."""

    steps: int = 3
    model_name: str = "fake"
    tokenizer: object = None
    stats: _Stats = field(default_factory=_Stats)
    kv_cache: _KV = field(default_factory=_KV)
    added: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    live: dict[str, int] = field(default_factory=dict)
    prompts: dict[str, str] = field(default_factory=dict)
    budget: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    fail_steps: int = 0  # the next steps that raise (an engine bug, not a bad request)
    slow_gate: threading.Event = field(default_factory=threading.Event)
    input_threads: set[str] = field(default_factory=set)
    steps_done: int = 0

    def allow(self, steps: int) -> None:
        """Let ``steps`` more steps advance the requests (other steps do nothing, after a short
        wait, so that the loop keeps taking in requests whose input its workers processed)."""
        for _ in range(steps):
            self.budget.release()

    @property
    def input_processor(self):
        return self  # the fake processes its inputs itself (on the loop's worker threads)

    def apply_chat_template(self, messages):
        return [1, 2]

    def process(self, prompt, params, *, max_tokens_must_fit=False):
        self.input_threads.add(threading.current_thread().name)
        if prompt == "slow":  # a prompt that takes long to tokenize
            assert self.slow_gate.wait(10)
        if prompt == "bad":
            raise ValueError("bad prompt")
        return ProcessedPrompt(prompt, [1])

    def add_processed_request(self, request_id, processed, params):
        self.added.append(processed.prompt)
        self.live[request_id] = self.steps
        self.prompts[request_id] = processed.prompt

    def abort_request(self, request_id):
        self.aborted.append(self.prompts[request_id])
        self.live.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        if not self.budget.acquire(timeout=0.01):
            return []
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("engine bug")
        self.steps_done += 1
        done = []
        for request_id in list(self.live):
            self.live[request_id] -= 1
            self.stats.num_generated_tokens += 1
            if self.live[request_id] == 0:
                del self.live[request_id]
                sample = CompletionOutput(0, "out", [7], finish_reason="length")
                done.append(RequestOutput(request_id, self.prompts[request_id], [1], [sample]))
        return done


def _wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _loop(store, engine, max_in_flight=2):
    finalized: list[tuple[str, str]] = []
    done = threading.Event()

    def finalize(batch_id, status):
        finalized.append((batch_id, status))
        done.set()

    loop = EngineLoop(
        engine, store, max_in_flight=max_in_flight, on_results=lambda _: None, finalize=finalize
    )
    return loop, finalized, done


def test_round_robin_admission_lets_a_small_batch_through(tmp_path):
    store = st.Store(tmp_path)
    large = _batch(store, "".join(_line(f"L{i}", f"L{i}") + "\n" for i in range(6)))
    small = _batch(store, _line("S0", "S0") + "\n" + _line("S1", "bad") + "\n")
    for b in (large, small):
        _validate(store, b["id"])
    engine = FakeEngine()
    engine.allow(1000)
    loop, finalized, done = _loop(store, engine)
    loop.start()  # both batches are in progress: resumed from the store
    try:
        deadline = threading.Event()
        while len(finalized) < 2 and not deadline.wait(0.05):
            pass
    finally:
        loop.stop()
    assert sorted(s for _, s in finalized) == [st.COMPLETED, st.COMPLETED]
    # Alternating admission; the bad prompt fails in input processing, before the engine.
    assert engine.added[:3] == ["L0", "S0", "L1"]
    assert store.get_batch(small["id"])["status"] == st.FINALIZING
    counts = store.get_batch(small["id"])
    assert (counts["completed"], counts["failed"]) == (1, 1)
    assert all(n == 1 for n in store.request_attempts(large["id"]).values())
    assert loop.stats.generated_tokens_total == engine.stats.num_generated_tokens


def test_cancel_aborts_in_flight_requests_and_keeps_finished_ones(tmp_path):
    store = st.Store(tmp_path)
    batch = _batch(store, "".join(_line(f"r{i}", f"r{i}") + "\n" for i in range(6)))
    _validate(store, batch["id"])
    engine = FakeEngine(steps=2)
    loop, finalized, done = _loop(store, engine)
    loop.start()
    try:
        _wait_for(lambda: len(engine.added) == 2)  # admitted, input processed, in the engine
        engine.allow(2)  # the first two requests finish, two more are admitted
        _wait_for(lambda: store.get_batch(batch["id"])["completed"] == 2 and len(engine.added) == 4)
        assert store.transition(batch["id"], st.CANCELLING, expect=[st.IN_PROGRESS])
        loop.cancel_batch(batch["id"])
        engine.allow(1000)
        assert done.wait(10)
    finally:
        loop.stop()
    assert finalized == [(batch["id"], st.CANCELLED)]
    assert engine.aborted == ["r2", "r3"]  # in flight at the cancel
    assert store.get_batch(batch["id"])["completed"] == 2
    assert store.count_pending(batch["id"]) == 4  # the job worker fails these at finalize
    assert store.request_attempts(batch["id"]) == {0: 1, 1: 1, 2: 1, 3: 1, 4: 0, 5: 0}


def test_a_failed_engine_step_gives_error_lines_with_their_line_numbers(tmp_path):
    store = st.Store(tmp_path)
    # Line 2 is blank: the numbers in the error lines are input line numbers, not indexes.
    batch = _batch(
        store, _line("a", "a") + "\n\n" + _line("b", "b") + "\n" + _line("c", "c") + "\n"
    )
    _validate(store, batch["id"])
    engine = FakeEngine(steps=1, fail_steps=1)
    loop, finalized, done = _loop(store, engine)
    loop.start()
    try:
        _wait_for(lambda: len(engine.added) == 2)  # a and b in the engine: the failing step's
        engine.allow(1000)
        assert done.wait(10)
    finally:
        loop.stop()
    results = {r.custom_id: json.loads(r.result) for r in store.results_after(batch["id"], 0, 10)}
    # a and b were in the failed step; c ran after it.
    assert [results[c]["error"] for c in ("a", "b")] == [
        {
            "code": "request_failed",
            "message": f"line {n}: the engine failed while running this request (RuntimeError)",
            "param": None,
            "line": n,
        }
        for n in (1, 3)
    ]
    assert results["c"]["error"] is None


def test_input_processing_runs_off_the_engine_thread(tmp_path):
    """A prompt that takes long to tokenize holds up no other request: the engine thread
    keeps stepping, and an online request arriving meanwhile finishes."""
    from batchgen.entrypoints.openai_protocol import parse_request_body
    from batchgen.service.engine_loop import OnlineRequest

    store = st.Store(tmp_path)
    batch = _batch(store, _line("slow", "slow") + "\n" + _line("next", "next") + "\n")
    _validate(store, batch["id"])
    engine = FakeEngine(steps=2)
    engine.allow(1000)
    loop, finalized, done = _loop(store, engine, max_in_flight=4)
    events = []
    online_done = threading.Event()

    def emit(event):
        events.append(event)
        online_done.set()

    loop.start()
    try:
        api = parse_request_body("/v1/completions", {"prompt": "fast", "max_tokens": 2})
        loop.submit_online(OnlineRequest(api, emit))
        assert online_done.wait(10)
        assert [e.kind for e in events] == ["done"]
        assert engine.added == ["fast"]  # the batch line is still being tokenized
        assert engine.steps_done >= 2
        engine.slow_gate.set()
        assert done.wait(10)
    finally:
        loop.stop()
    assert finalized == [(batch["id"], st.COMPLETED)]
    assert engine.added == ["fast", "slow", "next"]
    assert engine.input_threads == {"batchgen-input-online_0", "batchgen-input-batch_0"}
