"""The service end to end: one real ``batchgen serve`` on 127.0.0.1 (tiny Mixtral, API key,
64 kB upload limit, at most 2 requests in the engine so that batches take a while), driven by
the official ``openai`` SDK, ``httpx`` and `BatchGenClient`."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from service_helpers import (
    API_KEY,
    BATCHGEN,
    Server,
    completion_line,
    env,
    is_error_object,
    jsonl,
    make_tiny_model,
    slow_lines,
)

from batchgen.service.client import BatchGenClient, BatchGenError, split_by_endpoint

UPLOAD_LIMIT = 64_000


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("svc")
    srv = Server(
        tiny_model,
        root / "state",
        root / "server.log",
        "--api-key",
        API_KEY,
        "--max-upload-mb",
        str(UPLOAD_LIMIT / 1e6),
        "--max-in-flight",
        "2",
    ).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    ) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    with BatchGenClient(server.url, api_key=API_KEY, timeout=30) as c:
        yield c


def _wait(sdk, batch_id, timeout=120.0):
    deadline = time.monotonic() + timeout
    while True:
        batch = sdk.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.2)


def _files(sdk, batch) -> tuple[list[dict], list[dict]]:
    out = jsonl(sdk.files.content(batch.output_file_id).text) if batch.output_file_id else []
    err = jsonl(sdk.files.content(batch.error_file_id).text) if batch.error_file_id else []
    return out, err


def _upload(sdk, tmp_path, text: str, name="in.jsonl"):
    path = tmp_path / name
    path.write_text(text)
    with open(path, "rb") as f:
        return sdk.files.create(file=f, purpose="batch")


# ---------------------------------------------------------------------------------------------
# OpenAI SDK round trip == `batchgen run`


ROUND_TRIP = "".join(
    line + "\n"
    for line in [
        completion_line("c-0", "The capital of France is", max_tokens=12, temperature=0.0),
        completion_line("c-1", "def fib(n):", max_tokens=16, temperature=0.0),
        completion_line("c-2", "Once upon a time", max_tokens=8, temperature=0.0, n=2),
        completion_line("c-3", "1, 2, 3,", max_tokens=10, temperature=0.0, logprobs=2),
        completion_line("c-4", "hello", max_tokens=6, temperature=0.0, stop=["e"]),
        json.dumps({"custom_id": "c-5", "prompt": "plain line", "max_tokens": 5}),
    ]
)


def test_openai_sdk_round_trip_matches_batchgen_run(server, sdk, tmp_path, tiny_model):
    file = _upload(sdk, tmp_path, ROUND_TRIP)
    assert file.id.startswith("file-") and file.purpose == "batch"
    assert file.bytes == len(ROUND_TRIP.encode())
    assert sdk.files.retrieve(file.id).filename == "in.jsonl"
    assert sdk.files.content(file.id).text == ROUND_TRIP
    assert file.id in [f.id for f in sdk.files.list()]
    batch = sdk.batches.create(
        input_file_id=file.id,
        endpoint="/v1/completions",
        completion_window="24h",
        metadata={"job": "round-trip"},
    )
    assert batch.status == "validating" and batch.metadata == {"job": "round-trip"}
    batch = _wait(sdk, batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts.total == 6
    assert batch.request_counts.completed == 6 and batch.request_counts.failed == 0
    assert batch.error_file_id is None
    assert batch.created_at <= batch.in_progress_at <= batch.finalizing_at <= batch.completed_at
    assert batch.id in [b.id for b in sdk.batches.list(limit=100)]
    served, _ = _files(sdk, batch)

    expected = tmp_path / "run.jsonl"
    (tmp_path / "in.jsonl").write_text(ROUND_TRIP)
    proc = subprocess.run(
        [*BATCHGEN, "run", "-i", str(tmp_path / "in.jsonl"), "-o", str(expected)]
        + ["--model", str(tiny_model), "--device", "cpu", "--no-progress"],
        env=env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    ran = {r["custom_id"]: r for r in jsonl(expected.read_text())}
    assert [r["custom_id"] for r in served] == [f"c-{i}" for i in range(6)]  # input order
    for result in served:
        mine = result["response"]["body"]
        theirs = ran[result["custom_id"]]["response"]["body"]
        assert result["response"]["status_code"] == 200 and result["error"] is None
        for key in ("object", "model", "usage"):
            assert mine[key] == theirs[key], (result["custom_id"], key)
        _assert_same_choices(mine["choices"], theirs["choices"])


def _assert_same_choices(mine: list[dict], theirs: list[dict]) -> None:
    """Equal choices; log-probabilities to 1e-4 (the two runs batch requests differently, so
    float sums may differ in the last bits), everything else exactly."""
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs):
        assert {k: v for k, v in a.items() if k != "logprobs"} == {
            k: v for k, v in b.items() if k != "logprobs"
        }
        if a["logprobs"] is None or b["logprobs"] is None:
            assert a["logprobs"] == b["logprobs"]
            continue
        assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
        assert a["logprobs"]["text_offset"] == b["logprobs"]["text_offset"]
        assert a["logprobs"]["token_logprobs"] == pytest.approx(
            b["logprobs"]["token_logprobs"], abs=1e-4
        )
        for top_a, top_b in zip(a["logprobs"]["top_logprobs"], b["logprobs"]["top_logprobs"]):
            assert top_a == pytest.approx(top_b, abs=1e-4)


def test_output_file_is_downloadable_and_deletable(server, sdk, tmp_path):
    file = _upload(sdk, tmp_path, completion_line("x", "hi", max_tokens=2) + "\n")
    batch = _wait(
        sdk,
        sdk.batches.create(
            input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
        ).id,
    )
    assert sdk.files.retrieve(batch.output_file_id).purpose == "batch_output"
    deleted = sdk.files.delete(batch.output_file_id)
    assert deleted.deleted and deleted.id == batch.output_file_id
    with pytest.raises(openai.NotFoundError):
        sdk.files.content(batch.output_file_id)


# ---------------------------------------------------------------------------------------------
# Per-line errors


def test_malformed_duplicate_mismatched_and_streaming_lines_fail_alone(server, sdk, tmp_path):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    lines = [
        completion_line("ok-1", "hello", max_tokens=4, temperature=0.0),
        "{not json",
        completion_line("ok-1", "duplicate id", max_tokens=4),
        json.dumps(
            {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": chat}
        ),
        completion_line("streamed", "x", stream=True),
        completion_line("typo", "x", max_token=3),
        json.dumps({"custom_id": "no-prompt", "url": "/v1/completions", "body": {}}),
        completion_line("too-long", "word " * 5000, max_tokens=2),
        "",
        completion_line("ok-2", "world", max_tokens=4, temperature=0.0),
        completion_line("too-many-tokens", "hello", max_tokens=100000),
    ]
    file = _upload(sdk, tmp_path, "\n".join(lines) + "\n")
    batch = _wait(
        sdk,
        sdk.batches.create(
            input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
        ).id,
    )
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed) == (10, 2)
    assert batch.request_counts.failed == 8
    out, err = _files(sdk, batch)
    assert [r["custom_id"] for r in out] == ["ok-1", "ok-2"]
    codes = {(r["custom_id"], r["error"]["line"]): r["error"]["code"] for r in err}
    assert codes == {
        (None, 2): "invalid_json_line",
        ("ok-1", 3): "duplicate_custom_id",
        ("chat", 4): "invalid_url",
        ("streamed", 5): "unsupported_parameter",
        ("typo", 6): "unsupported_parameter",
        ("no-prompt", 7): "missing_required_parameter",
        ("too-long", 8): "context_length_exceeded",
        ("too-many-tokens", 11): "context_length_exceeded",
    }
    assert all(r["response"] is None or r["response"]["status_code"] >= 400 for r in err)
    by_id = {r["custom_id"]: r["error"] for r in err}
    assert "does not match the batch's endpoint '/v1/completions'" in by_id["chat"]["message"]
    assert "did you mean 'max_tokens'" in by_id["typo"]["message"]
    assert by_id["too-long"]["param"] == "prompt"
    # prompt + max_tokens beyond the context is refused, as the OpenAI API does
    assert by_id["too-many-tokens"]["param"] == "max_tokens"


def test_empty_input_file_fails_the_batch(server, sdk, tmp_path):
    file = _upload(sdk, tmp_path, "\n\n")
    batch = _wait(
        sdk,
        sdk.batches.create(
            input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
        ).id,
    )
    assert batch.status == "failed" and batch.failed_at is not None
    assert batch.errors.data[0].code == "empty_file"


# ---------------------------------------------------------------------------------------------
# Security, limits, error objects


def test_auth_is_required_on_v1_routes(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path in [
            ("GET", "/v1/models"),
            ("GET", "/v1/batches"),
            ("POST", "/v1/files"),
            ("GET", "/v1/files/file-x/content"),
        ]:
            r = httpx.request(method, server.url + path, headers=headers, timeout=10)
            assert r.status_code == 401, (headers, path)
            assert is_error_object(r) and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    assert httpx.get(server.url + "/health", timeout=10).json() == {"status": "ok"}


def test_unknown_ids_are_404_error_objects(server, sdk, http):
    for method, path in [
        ("GET", "/v1/files/file-00000000000000000000000000000000"),
        ("GET", "/v1/files/file-00000000000000000000000000000000/content"),
        ("DELETE", "/v1/files/file-00000000000000000000000000000000"),
        ("GET", "/v1/files/..%2Fbatchgen.sqlite3/content"),
        ("GET", "/v1/files/%2Fetc%2Fpasswd/content"),
        ("GET", "/v1/batches/batch_nope"),
        ("POST", "/v1/batches/batch_nope/cancel"),
        ("GET", "/v1/batches/batch_nope/results"),
        ("GET", "/v1/models/other-model"),
        ("GET", "/v1/no-such-route"),
    ]:
        r = http.request(method, path)
        assert r.status_code == 404, path
        assert is_error_object(r), path
    with pytest.raises(openai.NotFoundError):
        sdk.batches.retrieve("batch_0123")
    with pytest.raises(openai.NotFoundError):
        sdk.batches.create(
            input_file_id="file-00000000000000000000000000000000",
            endpoint="/v1/completions",
            completion_window="24h",
        )


def test_oversized_uploads_get_413(server, sdk, http, tmp_path):
    big = tmp_path / "big.jsonl"
    big.write_text((completion_line("x", "a" * 100) + "\n") * (UPLOAD_LIMIT // 100 + 10))
    with pytest.raises(openai.APIStatusError) as info, open(big, "rb") as f:
        sdk.files.create(file=f, purpose="batch")
    assert info.value.status_code == 413

    def chunked():  # no Content-Length: the server counts the bytes as they stream
        yield b'--xx\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\n'
        for _ in range(UPLOAD_LIMIT // 1000 + 100):
            yield b"a" * 1000
        yield b"\r\n--xx--\r\n"

    r = http.post(
        "/v1/files", content=chunked(), headers={"Content-Type": "multipart/form-data; boundary=xx"}
    )
    assert r.status_code == 413 and is_error_object(r)
    before = [f.id for f in sdk.files.list()]
    assert len(before) == len(set(before))


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "param"),
    [
        ("POST", "/v1/batches", {"content": b"{oops"}, None),
        ("POST", "/v1/batches", {"json": [1, 2]}, None),
        (
            "POST",
            "/v1/batches",
            {"json": {"endpoint": "/v1/completions", "completion_window": "24h"}},
            "input_file_id",
        ),
        (
            "POST",
            "/v1/batches",
            {
                "json": {
                    "input_file_id": "f",
                    "endpoint": "/v1/embeddings",
                    "completion_window": "24h",
                }
            },
            "endpoint",
        ),
        (
            "POST",
            "/v1/batches",
            {
                "json": {
                    "input_file_id": "f",
                    "endpoint": "/v1/completions",
                    "completion_window": "soon",
                }
            },
            "completion_window",
        ),
        (
            "POST",
            "/v1/batches",
            {
                "json": {
                    "input_file_id": "f",
                    "endpoint": "/v1/completions",
                    "completion_window": "24h",
                    "metadata": [1],
                }
            },
            "metadata",
        ),
        (
            "POST",
            "/v1/batches",
            {
                "json": {
                    "input_file_id": "f",
                    "endpoint": "/v1/completions",
                    "completion_window": "24h",
                    "extra": 1,
                }
            },
            "extra",
        ),
        ("POST", "/v1/files", {"data": {"purpose": "batch"}}, "file"),
        (
            "POST",
            "/v1/files",
            {"files": {"file": ("a.jsonl", b"{}\n")}, "data": {"purpose": "fine-tune"}},
            "purpose",
        ),
        (
            "POST",
            "/v1/files",
            {"content": b"garbage", "headers": {"Content-Type": "multipart/form-data"}},
            None,
        ),
        ("GET", "/v1/batches?limit=abc", {}, "limit"),
        ("GET", "/v1/batches?limit=0", {}, "limit"),
        ("GET", "/v1/files?order=sideways", {}, "order"),
        ("POST", "/v1/completions", {"json": {"prompt": "x", "max_tokens": "many"}}, "max_tokens"),
        ("POST", "/v1/completions", {"json": {"max_tokens": 3}}, "prompt"),
        ("POST", "/v1/chat/completions", {"json": {"messages": "hi"}}, "messages"),
        ("POST", "/v1/completions", {"json": {"prompt": "x", "stream": "yes"}}, "stream"),
        # token ids outside the vocabulary: the engine refuses the prompt
        ("POST", "/v1/completions", {"json": {"prompt": [999999]}}, "prompt"),
    ],
)
def test_malformed_requests_get_400_error_objects(http, method, path, kwargs, param):
    r = http.request(method, path, **kwargs)
    assert r.status_code == 400, r.text
    assert is_error_object(r)
    assert r.json()["error"]["param"] == param


def test_listing_pages_with_after_and_limit(server, http, sdk, tmp_path):
    file = _upload(sdk, tmp_path, completion_line("p", "hi", max_tokens=1) + "\n")
    ids = [
        sdk.batches.create(
            input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
        ).id
        for _ in range(3)
    ]
    first = http.get("/v1/batches", params={"limit": 2}).json()
    assert first["object"] == "list" and first["has_more"] is True
    assert [b["id"] for b in first["data"]] == ids[::-1][:2]  # newest first
    second = http.get("/v1/batches", params={"limit": 2, "after": first["last_id"]}).json()
    assert second["data"][0]["id"] == ids[0]
    files = http.get("/v1/files", params={"limit": 1, "order": "asc"}).json()
    assert files["has_more"] is True and len(files["data"]) == 1
    for batch_id in ids:
        _wait(sdk, batch_id)


def test_uploaded_file_names_never_become_paths(server, http):
    r = http.post(
        "/v1/files",
        files={"file": ("../../../etc/evil.jsonl", b"{}\n")},
        data={"purpose": "batch"},
    )
    assert r.status_code == 200, r.text
    file = r.json()
    assert file["filename"] == "evil.jsonl"
    assert file["id"].startswith("file-") and "/" not in file["id"]
    assert http.get(f"/v1/files/{file['id']}/content").content == b"{}\n"
    assert not (server.state_dir.parent / "etc").exists()


def test_cancelling_a_finished_batch_is_409(server, sdk, tmp_path):
    file = _upload(sdk, tmp_path, completion_line("x", "hi", max_tokens=1) + "\n")
    batch = _wait(
        sdk,
        sdk.batches.create(
            input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
        ).id,
    )
    with pytest.raises(openai.ConflictError):
        sdk.batches.cancel(batch.id)


# ---------------------------------------------------------------------------------------------
# Scheduling, streaming results, cancel, expiry


def test_iter_results_streams_before_the_batch_completes(client, sdk, tmp_path):
    """Eleven 2-token requests and one of 300 tokens: the short ones' results are readable
    while the long one still runs (with equal lengths every request ends in the same step, and
    on a loaded machine the batch could complete before the first poll)."""
    greedy = {"temperature": 0.0, "ignore_eos": True}
    lines = [
        completion_line(f"prompt-{i}", f"stream test {i}", max_tokens=2, **greedy)
        for i in range(11)
    ]
    lines.append(completion_line("prompt-11", "stream test long", max_tokens=300, **greedy))
    file = _upload(sdk, tmp_path, "".join(line + "\n" for line in lines))
    created = sdk.batches.create(
        input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
    )
    job = client.batch(created.id)
    seen, first_status = [], None
    for result in job.iter_results():
        if first_status is None:
            first_status = job.refresh()
        seen.append(result)
    assert first_status["status"] == "in_progress"
    assert first_status["request_counts"]["completed"] < len(lines)
    assert sorted(r.index for r in seen) == list(range(len(lines)))
    assert all(r.custom_id == f"prompt-{r.index}" and r.ok for r in seen)
    tokens = {r.index: r.body["usage"]["completion_tokens"] for r in seen}
    assert tokens == {**{i: 2 for i in range(11)}, 11: 300}
    assert job.status() == "completed"
    assert [r.index for r in job.results()] == list(range(len(lines)))


def _finish_times(state_dir, batch_id) -> list[float]:
    db = sqlite3.connect(f"file:{state_dir / 'batchgen.sqlite3'}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT finished_at FROM requests WHERE batch_id = ?", (batch_id,))
        return sorted(t for (t,) in rows.fetchall())
    finally:
        db.close()


def test_small_batch_behind_a_large_one_progresses(server, client):
    large = client.submit_batch(
        [f"large {i}" for i in range(12)], max_tokens=24, temperature=0.0, ignore_eos=True
    )
    while large.status() == "validating":
        time.sleep(0.02)
    small = client.submit_batch(["small"], max_tokens=4, temperature=0.0, ignore_eos=True)
    assert small.wait(poll_interval=0.1, timeout=120)["status"] == "completed"
    assert large.wait(poll_interval=0.1, timeout=120)["status"] == "completed"
    (small_done,) = _finish_times(server.state_dir, small.id)
    large_done = _finish_times(server.state_dir, large.id)
    # Round-robin admission: the small batch got one of the next free slots instead of
    # queueing behind all twelve requests of the large one (FIFO would finish it last).
    assert sum(t > small_done for t in large_done) >= 6, (small_done, large_done)


def test_cancel_mid_run_lists_every_custom_id_once(server, sdk, tmp_path):
    # 12 lines x 256 tokens, 2 in flight: the cancel arrives long before the last line finishes.
    file = _upload(sdk, tmp_path, slow_lines(12, 256, prefix="cancel"))
    batch = sdk.batches.create(
        input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
    )
    while sdk.batches.retrieve(batch.id).request_counts.completed < 1:
        time.sleep(0.05)
    cancelling = sdk.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch = _wait(sdk, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at >= batch.cancelling_at
    out, err = _files(sdk, batch)
    ids = [r["custom_id"] for r in out + err]
    assert sorted(ids) == sorted(f"cancel-{i}" for i in range(12))
    assert out and all(r["response"]["status_code"] == 200 for r in out)
    assert err and all(r["error"]["code"] == "batch_cancelled" for r in err)
    counts = batch.request_counts
    assert (counts.completed, counts.failed, counts.total) == (len(out), len(err), 12)
    assert sdk.batches.cancel(batch.id).status == "cancelled"  # idempotent


def test_expired_batch_lists_every_custom_id_once(server, http, sdk, tmp_path):
    # Far more work than a 1 s window holds (40 lines x 512 tokens, 2 in flight: 10,240 steps),
    # so the batch expires however fast the engine becomes.
    n = 40
    file = _upload(sdk, tmp_path, slow_lines(n, 512, prefix="exp"))
    r = http.post(
        "/v1/batches",
        json={"input_file_id": file.id, "endpoint": "/v1/completions", "completion_window": "1s"},
    )
    assert r.status_code == 200, r.text
    batch = _wait(sdk, r.json()["id"])
    assert batch.status == "expired" and batch.expired_at is not None
    out, err = _files(sdk, batch)
    assert sorted(r["custom_id"] for r in out + err) == sorted(f"exp-{i}" for i in range(n))
    assert err and {r["error"]["code"] for r in err} == {"batch_expired"}


# ---------------------------------------------------------------------------------------------
# Online endpoints, models, metrics


def test_online_completions_and_sse_streaming(server, sdk):
    kwargs = dict(model="any", prompt="The quick brown fox", max_tokens=12, temperature=0.0)
    full = sdk.completions.create(**kwargs)
    assert full.object == "text_completion" and full.usage.completion_tokens <= 12
    chunks = list(sdk.completions.create(**kwargs, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) > 1  # streamed in pieces

    messages = [{"role": "user", "content": "hello there"}]
    chat = sdk.chat.completions.create(
        model="any", messages=messages, max_tokens=10, temperature=0.0
    )
    stream = sdk.chat.completions.create(
        model="any",
        messages=messages,
        max_tokens=10,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    assert "".join(pieces) == chat.choices[0].message.content
    assert usage.completion_tokens == chat.usage.completion_tokens


def test_online_request_errors(server, sdk):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model="any", prompt="word " * 5000, max_tokens=2)
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "prompt")
    with pytest.raises(openai.BadRequestError) as info:
        messages = [{"role": "user", "content": "word " * 5000}]
        sdk.chat.completions.create(model="any", messages=messages, max_tokens=2)
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "messages")
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model="any", prompt="hello", max_tokens=100000)
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "max_tokens")
    assert info.value.type == "invalid_request_error"
    assert "maximum context length" in info.value.message
    with pytest.raises(openai.BadRequestError):
        sdk.completions.create(model="any", prompt="x", stream=True, logprobs=2)


def test_models_health_and_metrics(server, sdk, tiny_model, tmp_path):
    # Its own completed batch, so that the counters below are not left to earlier tests.
    # One long prompt twice: the second finds the first one's full KV blocks cached.
    prompt = "Metrics " * 40
    lines = [completion_line(f"m-{i}", prompt, max_tokens=4, temperature=0.0) for i in range(2)]
    file = _upload(sdk, tmp_path, "".join(line + "\n" for line in lines))
    batch = _wait(
        sdk,
        sdk.batches.create(
            input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
        ).id,
    )
    assert batch.status == "completed" and batch.request_counts.completed == 2
    # Served under the directory's name (--served-model-name's default), not its path.
    assert [m.id for m in sdk.models.list()] == ["tiny-mixtral"] == [tiny_model.name]
    assert sdk.models.retrieve("tiny-mixtral").owned_by == "batchgen"
    finished_ok = (
        "batchgen_requests_finished_total",
        (("outcome", "succeeded"), ("source", "batch")),
    )
    # The engine thread refreshes the gauges every iteration and tile density every second, so
    # the batch's work may show up a moment after the batch reads completed.
    deadline = time.monotonic() + 30
    while True:
        r = httpx.get(server.url + "/metrics", timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text)
            for s in family.samples
        }
        seen = [
            samples.get(("batchgen_generation_tokens_total", ()), 0),
            samples.get(finished_ok, 0),
            samples.get(("batchgen_tile_density", ()), 0),
            samples.get(("batchgen_prefix_cache_hits_total", ()), 0),
        ]
        if all(value > 0 for value in seen) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert samples[("batchgen_generation_tokens_total", ())] > 0
    assert samples[finished_ok] > 0
    assert samples[("batchgen_batches", (("status", "completed"),))] >= 1
    assert samples[("batchgen_engine_up", ())] == 1
    for name in (
        "batchgen_queue_depth",
        "batchgen_active_coroutines",
        "batchgen_kv_cache_usage_ratio",
        "batchgen_generation_tokens_per_second",
        "batchgen_tile_density",
    ):
        assert (name, ()) in samples, name
    assert 0.0 <= samples[("batchgen_kv_cache_usage_ratio", ())] <= 1.0
    assert 0.0 < samples[("batchgen_tile_density", ())] <= 1.0  # a Mixtral ran expert GEMMs
    hits = samples[("batchgen_prefix_cache_hits_total", ())]
    assert 0 < hits < samples[("batchgen_prefix_cache_queries_total", ())]
    assert samples[("batchgen_prefix_cache_evictions_total", ())] >= 0
    # Per-request latency histograms (vLLM's, batchgen_ for vllm:), from RequestMetrics.
    batch = (("source", "batch"),)
    finished = samples[("batchgen_e2e_request_latency_seconds_count", batch)]
    assert finished >= samples[finished_ok] >= 2  # observed before the counter's snapshot
    for name in (
        "batchgen_request_queue_time_seconds",
        "batchgen_time_to_first_token_seconds",
        "batchgen_e2e_request_latency_seconds",
    ):
        assert samples[(name + "_count", batch)] == finished, name
        assert samples[(name + "_bucket", (("le", "+Inf"), *batch))] == finished, name
    e2e = samples[("batchgen_e2e_request_latency_seconds_sum", batch)]
    ttft = samples[("batchgen_time_to_first_token_seconds_sum", batch)]
    queue = samples[("batchgen_request_queue_time_seconds_sum", batch)]
    assert 0 <= queue <= ttft < e2e < 600 * finished


def _submit_cli(server, tmp_path, src):
    """Run ``batchgen submit`` on ``src``; returns the process and its result lines."""
    out = tmp_path / "results.jsonl"
    proc = subprocess.run(
        [*BATCHGEN, "submit", "-i", str(src), "-o", str(out), "--endpoint", server.url]
        + ["--api-key", API_KEY, "--no-progress"],
        env=env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return proc, jsonl(out.read_text())


def test_batchgen_submit_cli(server, tmp_path):
    src = tmp_path / "requests.jsonl"
    src.write_text(slow_lines(3, 4, prefix="cli") + "{bad\n")
    proc, results = _submit_cli(server, tmp_path, src)
    assert sorted(str(r["custom_id"]) for r in results) == ["None", "cli-0", "cli-1", "cli-2"]
    assert "completed: 3 ok, 1 failed" in proc.stderr


def test_batchgen_submit_cli_runs_a_mixed_file_as_one_batch_per_endpoint(server, tmp_path):
    src = tmp_path / "mixed.jsonl"
    _mixed_endpoint_file(src)
    proc, results = _submit_cli(server, tmp_path, src)
    assert sorted(str(r["custom_id"]) for r in results) == [
        "None",
        "chat-1",
        "chat-2",
        "mixed-a-0",
        "mixed-b-0",
    ]
    assert "(/v1/completions)" in proc.stderr and "(/v1/chat/completions)" in proc.stderr
    assert ": 4 ok, 1 failed" in proc.stderr


def test_batchgen_submit_writes_invalid_url_lines_like_run(server, tmp_path):
    """A file ``batchgen run`` takes runs whole under ``submit`` too: an endpoint BatchGen does
    not serve gets the same ``invalid_url`` error line, and the other lines run."""
    from batchgen.entrypoints.openai_protocol import BatchLineError, parse_batch_line

    embedding = {"custom_id": "emb", "url": "/v1/embeddings", "body": {"input": "hi"}}
    lines = [json.dumps(embedding), slow_lines(2, 3, prefix="urls").strip()]
    src = tmp_path / "embeddings.jsonl"
    src.write_text("\n".join(lines) + "\n")
    assert list(split_by_endpoint(src)) == ["/v1/completions"]
    proc, results = _submit_cli(server, tmp_path, src)
    assert ": 2 ok, 1 failed" in proc.stderr
    (bad,) = [r for r in results if r["error"] is not None]
    with pytest.raises(BatchLineError) as run_error:  # what `batchgen run` writes for it
        parse_batch_line(lines[0], 1)
    assert bad["custom_id"] == "emb"
    assert bad["error"] == {
        "code": "invalid_url",
        "message": str(run_error.value),
        "param": "url",
        "line": 1,
    }
    assert sorted(r["custom_id"] for r in results if r["error"] is None) == ["urls-0", "urls-1"]

    only_unserved = tmp_path / "only-embeddings.jsonl"
    only_unserved.write_text(json.dumps(embedding) + "\n")
    assert {u: g.num_lines for u, g in split_by_endpoint(only_unserved).items()} == {
        "/v1/completions": 1
    }


def _mixed_endpoint_file(path):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    lines = [
        slow_lines(1, 3, prefix="mixed-a").strip(),
        json.dumps({"custom_id": "chat-1", "url": "/v1/chat/completions", "body": chat}),
        "{bad",
        json.dumps({"custom_id": "chat-2", **chat}),  # a plain line: chat by its messages
        slow_lines(1, 3, prefix="mixed-b").strip(),
    ]
    path.write_text("\n".join(lines) + "\n")


def test_submit_file_refuses_mixed_endpoints_and_splits_them_on_request(client, tmp_path):
    src = tmp_path / "mixed.jsonl"
    _mixed_endpoint_file(src)
    groups = split_by_endpoint(src)
    assert {url: g.num_lines for url, g in groups.items()} == {
        "/v1/completions": 3,  # two completions and the bad line, which goes with the first
        "/v1/chat/completions": 2,
    }
    assert [len(g.data.splitlines()) for g in groups.values()] == [5, 5]  # numbering kept
    with pytest.raises(ValueError, match=r"mixes endpoints: /v1/completions \(3 lines\), "):
        client.submit_file(src)
    jobs = client.submit_file_by_endpoint(src)
    assert [j.batch["endpoint"] for j in jobs] == ["/v1/completions", "/v1/chat/completions"]
    results = [r for j in jobs for r in j.results()]
    assert sorted(str(r.custom_id) for r in results if r.ok) == [
        "chat-1",
        "chat-2",
        "mixed-a-0",
        "mixed-b-0",
    ]
    (bad,) = [r for r in results if not r.ok]
    assert bad.result["error"]["message"].startswith("line 3: not valid JSON")


def test_client_errors_are_typed(client):
    with pytest.raises(BatchGenError) as info:
        client.batch("batch_missing")
    assert info.value.status_code == 404 and info.value.code == "not_found"
    with pytest.raises(ValueError):
        client.submit_batch(["text", [{"role": "user", "content": "hi"}]])


# ---------------------------------------------------------------------------------------------
# Structured outputs on the routes and in a service batch

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_structured_outputs_online_in_a_batch_and_offline_agree(sdk, tmp_path, tiny_model):
    import jsonschema

    from batchgen import LLM, SamplingParams

    messages = [{"role": "user", "content": "Bob is 42."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    chat = sdk.chat.completions.create(
        model="any",
        messages=messages,
        max_tokens=80,
        temperature=0.0,
        response_format=response_format,
    )
    text = chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    regex = sdk.completions.create(
        model="any", prompt="year:", max_tokens=10, extra_body={"guided_regex": "[0-9]{4}"}
    )
    assert len(regex.choices[0].text) == 4 and regex.choices[0].text.isdigit()
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(
            model="any", prompt="x", max_tokens=5, extra_body={"guided_json": {"type": "foo"}}
        )
    assert (info.value.code, info.value.param) == ("invalid_request", "guided_json")

    line = {"messages": messages, "max_tokens": 80, "temperature": 0.0}
    lines = [
        json.dumps(
            {
                "custom_id": "ok",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": dict(line, response_format=response_format),
            }
        ),
        json.dumps(
            {
                "custom_id": "bad",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": dict(line, guided_regex="[a-"),
            }
        ),
    ]
    file = _upload(sdk, tmp_path, "\n".join(lines) + "\n")
    batch = sdk.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = _wait(sdk, batch.id)
    out, err = _files(sdk, batch)
    assert [r["custom_id"] for r in out] == ["ok"] and [r["custom_id"] for r in err] == ["bad"]
    assert err[0]["error"]["param"] == "guided_regex"
    assert out[0]["response"]["body"]["choices"][0]["message"]["content"] == text

    llm = LLM(str(tiny_model), device="cpu", kv_cache_memory_gb=0.05)
    params = SamplingParams(max_tokens=80, temperature=0.0, structured_outputs={"json": PERSON})
    assert llm.chat([messages], params, use_tqdm=False)[0].outputs[0].text == text
