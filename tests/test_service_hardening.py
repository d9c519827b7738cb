"""The service against an adversarial client: values no engine tensor holds, lone surrogates,
deeply nested JSON, oversized prompts and bodies, and local users other than the server's.
One real ``batchgen serve`` (tiny Mixtral, key from --api-key-file, 40 MB bodies)."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import threading
import time

import httpx
import pytest
from service_helpers import Server, completion_line, is_error_object, make_tiny_model

from batchgen.engine.engine_setup import served_model_name

KEY = "sk-from-a-file"
BODY_LIMIT_MB = 40


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("hardening")
    key_file = root / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    srv = Server(
        tiny_model,
        root / "state",  # not there yet: the server creates it
        root / "server.log",
        "--api-key-file",
        str(key_file),
        "--max-upload-mb",
        str(BODY_LIMIT_MB),
        "--max-in-flight",
        "4",
    ).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120
    ) as client:
        yield client


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))


def _upload(http, text: str) -> str:
    files = {"file": ("in.jsonl", text.encode())}
    r = http.post("/v1/files", files=files, data={"purpose": "batch"})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def _run_batch(http, text: str, timeout: float = 180.0) -> dict:
    r = http.post(
        "/v1/batches",
        json={
            "input_file_id": _upload(http, text),
            "endpoint": "/v1/completions",
            "completion_window": "24h",
        },
    )
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + timeout
    while True:
        batch = http.get(f"/v1/batches/{r.json()['id']}").json()
        if batch["status"] in ("completed", "failed", "cancelled", "expired"):
            return batch
        assert time.monotonic() < deadline, batch["status"]
        time.sleep(0.2)


def _jsonl(http, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in http.get(f"/v1/files/{file_id}/content").text.splitlines()]


# ---------------------------------------------------------------------------------------------
# 1. one request never fails the others


def test_a_top_k_past_int64_fails_its_line_only(http):
    lines = [
        completion_line(f"k-{i}", f"prompt {i}", max_tokens=3, temperature=0.8)
        if i != 5
        else completion_line("k-5", "bad", max_tokens=3, temperature=0.8, top_k=2**63)
        for i in range(20)
    ]
    batch = _run_batch(http, "".join(line + "\n" for line in lines))
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 20, "completed": 19, "failed": 1}
    (bad,) = _jsonl(http, batch["error_file_id"])
    assert bad["custom_id"] == "k-5"
    assert bad["error"]["param"] == "top_k" and bad["error"]["line"] == 6
    assert "at most 9223372036854775807, got 9223372036854775808" in bad["error"]["message"]


# ---------------------------------------------------------------------------------------------
# 2. nothing stored poisons reads


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"metadata": {"k": "\ud800"}}, "metadata.k", "'metadata.k' is not valid Unicode text"),
        ({"metadata": {"\udfff": "v"}}, "metadata", "'metadata' has a key that is not valid"),
        ({"input_file_id": "\ud800"}, "input_file_id", "'input_file_id' is not valid Unicode"),
        ({"\ud800": 1}, None, "the request body has a key that is not valid Unicode text"),
    ],
)
def test_lone_surrogates_are_refused_before_anything_is_stored(http, body, param, words):
    before = http.get("/v1/batches", params={"limit": 100}).json()["data"]
    good = {
        "input_file_id": _upload(http, completion_line("s", "hi", max_tokens=1) + "\n"),
        "endpoint": "/v1/completions",
        "completion_window": "24h",
    }
    raw = json.dumps({**good, **body})  # ASCII JSON: the surrogates travel as \ud800 escapes
    r = http.post("/v1/batches", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and is_error_object(r)
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_unicode", param)
    assert error["message"].startswith(words)
    after = http.get("/v1/batches", params={"limit": 100})
    assert after.status_code == 200 and after.json()["data"] == before


def test_reads_survive_a_lone_surrogate_stored_by_an_older_version(server, http):
    batch = _run_batch(http, completion_line("old", "hi", max_tokens=1) + "\n")
    db = sqlite3.connect(server.state_dir / "batchgen.sqlite3", timeout=30)
    with db:
        db.execute(
            "UPDATE batches SET metadata = ? WHERE id = ?",
            ('{"k": "\\ud800", "\\udfff": "v", "ok": "caf\\u00e9"}', batch["id"]),
        )
    db.close()
    for path in (f"/v1/batches/{batch['id']}", "/v1/batches"):
        r = http.get(path)
        assert r.status_code == 200, (path, r.text)
    metadata = http.get(f"/v1/batches/{batch['id']}").json()["metadata"]
    assert metadata == {"k": "\\ud800", "\\udfff": "v", "ok": "café"}


# ---------------------------------------------------------------------------------------------
# 3. deeply nested JSON


def _exchange(sock: socket.socket, request: bytes) -> tuple[int, dict, bytes]:
    """Send one HTTP/1.1 request on ``sock``; read the status, headers and body."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    headers = {k.lower(): v for k, v in headers.items()}
    length = int(headers["content-length"])
    while len(body) < length:
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


@pytest.mark.parametrize("path", ["/v1/batches", "/v1/completions", "/v1/chat/completions"])
def test_deeply_nested_json_is_a_400_and_the_connection_stays_open(server, path):
    deep = b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    host, port = "127.0.0.1", server.port
    auth = f"Authorization: Bearer {KEY}\r\nHost: {host}\r\n".encode()
    with socket.create_connection((host, port), timeout=60) as sock:
        post = (
            f"POST {path} HTTP/1.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(deep)}\r\n".encode()
            + auth
            + b"\r\n"
            + deep
        )
        status, headers, body = _exchange(sock, post)
        assert status == 400 and headers.get("connection") != "close"
        assert json.loads(body)["error"] == {
            "message": "the request body is nested more than 64 levels deep",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_json",
        }
        status, _, body = _exchange(sock, b"GET /health HTTP/1.1\r\n" + auth + b"\r\n")
        assert (status, json.loads(body)) == (200, {"status": "ok"})  # the same connection


# ---------------------------------------------------------------------------------------------
# 4. oversized input does not stall the engine, the event loop or the memory


def _health_latencies_during(url: str, action) -> tuple[object, float, list[float]]:
    latencies: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                t0 = time.perf_counter()
                assert client.get(url + "/health").status_code == 200
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        t0 = time.perf_counter()
        result = action()
        elapsed = time.perf_counter() - t0
    finally:
        stop.set()
        poller.join()
    return result, elapsed, latencies


def test_a_large_body_is_parsed_off_the_event_loop(server, http):
    ids = list(range(100, 5000)) * 1300  # 6.37 million ids, 37 MB of JSON
    raw = json.dumps({"prompt": ids, "max_tokens": 1}).encode()
    assert len(raw) < BODY_LIMIT_MB * 1e6

    def post():
        return http.post(
            "/v1/completions", content=raw, headers={"Content-Type": "application/json"}
        )

    r, elapsed, latencies = _health_latencies_during(server.url, post)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["message"].startswith("prompt has 6370000 tokens")
    # Parsed on the event loop, /health would wait for the whole parse (over a second here).
    assert len(latencies) >= 5 and max(latencies) < max(0.5 * elapsed, 0.5), (elapsed, latencies)


def test_rss_stays_flat_across_repeated_oversized_prompts(server, http):
    text = "hello world " * 900_000  # 10.8 MB
    online = json.dumps({"prompt": text, "max_tokens": 1}).encode()
    chat = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 1}).encode()
    batch_line = completion_line("big", text, max_tokens=1) + "\n"

    def one_round() -> None:
        for url, body in (("/v1/completions", online), ("/v1/chat/completions", chat)):
            r = http.post(url, content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        batch = _run_batch(http, batch_line)
        (err,) = _jsonl(http, batch["error_file_id"])
        assert err["error"]["code"] == "context_length_exceeded"

    one_round()  # warm-up: first-use allocations, body buffers
    before = _rss_mb(server.proc.pid)
    for _ in range(4):
        one_round()
    growth = _rss_mb(server.proc.pid) - before
    # Tokenizing one of these prompts would cost the server about 2 GB (measured 480 MB for
    # 2 MB of text); refused by their length, 12 of them leave the memory where it was. (Each
    # failed one also used to stay in a reference cycle until a full GC: +22 MB per request.)
    assert growth < 64, f"RSS grew {growth:.0f} MB over 12 oversized requests"


# ---------------------------------------------------------------------------------------------
# 5. local confidentiality


def test_state_is_readable_by_its_owner_only(server, http):
    _run_batch(http, completion_line("p", "private", max_tokens=2) + "\n")
    state = server.state_dir
    assert (state.stat().st_mode & 0o777) == 0o700
    assert ((state / "files").stat().st_mode & 0o777) == 0o700
    files = [p for p in (*state.iterdir(), *(state / "files").iterdir()) if p.is_file()]
    assert {p.name for p in files} >= {"batchgen.sqlite3", "batchgen.sqlite3-wal"}
    assert len([p for p in files if p.parent.name == "files"]) >= 2  # input and output
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {
        p.name: "0o600" for p in files
    }
    # The key came from a file: it is not on the command line other local users can read.
    with open(f"/proc/{server.proc.pid}/cmdline", "rb") as f:
        assert KEY.encode() not in f.read()


def test_openapi_schema_needs_the_key_and_docs_are_off(server, http):
    for path in ("/openapi.json", "/docs", "/redoc", "/no-such-route"):
        r = httpx.get(server.url + path, timeout=10)
        assert r.status_code == 401 and is_error_object(r), path
    schema = http.get("/openapi.json")
    assert schema.status_code == 200 and "/v1/batches" in schema.json()["paths"]
    assert http.get("/docs").status_code == 404
    for path in ("/health", "/metrics"):
        assert httpx.get(server.url + path, timeout=10).status_code == 200, path


def test_the_model_is_served_under_its_directory_name(server, http, tiny_model):
    assert tiny_model.name == "tiny-mixtral"
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny-mixtral"]
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.json()["model"] == "tiny-mixtral"
    batch = http.get("/v1/batches", params={"limit": 1}).json()["data"][0]
    assert batch["model"] == "tiny-mixtral"
    for text in (r.text, json.dumps(batch)):
        assert str(tiny_model.parent) not in text  # no server path in any response


def test_served_model_name_flag_and_default(tiny_model):
    assert served_model_name(str(tiny_model)) == "tiny-mixtral"
    assert served_model_name(str(tiny_model) + os.sep) == "tiny-mixtral"
    assert served_model_name("Qwen/Qwen3-30B-A3B") == "Qwen/Qwen3-30B-A3B"  # a hub id stays
    from batchgen import LLM

    llm = LLM(str(tiny_model), device="cpu", kv_cache_memory_gb=0.01, served_model_name="m-1")
    assert llm.llm_engine.model_name == "m-1"


# ---------------------------------------------------------------------------------------------
# Unit level: body parsing, key files, old state directories (no server)


@pytest.mark.parametrize(
    ("raw", "param", "message"),
    [
        (
            b'{"messages": [{"role": "user", "content": "ok"}, {"content": "\\udc00x"}]}',
            "messages[1].content",
            "'messages[1].content' is not valid Unicode text: it holds a lone surrogate at "
            'character 0 ("\\udc00x")',
        ),
        (
            b'{"a": {"b": {"\\ud83d": 1}}}',
            "a.b",
            "'a.b' has a key that is not valid Unicode text (a lone surrogate at character 0 "
            '("\\ud83d"))',
        ),
        (
            b'{"prompt": "' + b"x" * 100 + b'\\ud800yz"}',
            "prompt",
            "'prompt' is not valid Unicode text: it holds a lone surrogate at character 100 "
            '("...xxxxxxxxxx\\ud800yz")',
        ),
    ],
)
def test_lone_surrogates_are_named_by_their_path(raw, param, message):
    from batchgen.service.bodies import parse_json_object
    from batchgen.service.errors import APIError

    with pytest.raises(APIError) as info:
        parse_json_object(raw)
    assert (info.value.status_code, info.value.code, info.value.param) == (
        400,
        "invalid_unicode",
        param,
    )
    assert info.value.message.startswith(message)
    assert info.value.message.encode("utf-8")  # the message itself is sendable


def test_valid_surrogate_pairs_and_escaped_backslashes_pass():
    from batchgen.service.bodies import parse_json_object

    assert parse_json_object(b'{"p": "\\ud83d\\ude00", "q": "\\\\ud800"}') == {
        "p": "\U0001f600",
        "q": "\\ud800",
    }


@pytest.mark.parametrize("depth", [64, 65, 5000])
def test_nesting_limit(depth):
    from batchgen.service.bodies import MAX_JSON_DEPTH, parse_json_object
    from batchgen.service.errors import APIError

    raw = b'{"a": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"
    if depth <= MAX_JSON_DEPTH:
        assert parse_json_object(raw)["a"] is not None
        return
    with pytest.raises(APIError) as info:
        parse_json_object(raw)
    assert info.value.code == "invalid_json" and "more than 64 levels" in info.value.message


def test_api_key_sources(tmp_path, monkeypatch):
    from batchgen.entrypoints.cli import CliError, _api_key, build_parser

    def key(*argv):
        return _api_key(build_parser().parse_args(["serve", *argv]))

    monkeypatch.delenv("BATCHGEN_API_KEY", raising=False)
    assert key() is None
    monkeypatch.setenv("BATCHGEN_API_KEY", "from-env")
    assert key() == "from-env"
    path = tmp_path / "key"
    path.write_text("  from-file  \nignored\n")
    path.chmod(0o600)
    assert key("--api-key-file", str(path)) == "from-file"
    assert key("--api-key", "given") == "given"
    path.write_text("\n")
    with pytest.raises(CliError, match="is empty"):
        key("--api-key-file", str(path))
    with pytest.raises(CliError, match="cannot read --api-key-file"):
        key("--api-key-file", str(tmp_path / "missing"))
    with pytest.raises(SystemExit):  # one or the other
        key("--api-key", "a", "--api-key-file", str(path))
    assert "/proc/PID/cmdline" in build_parser()._subparsers._group_actions[0].choices[
        "serve"
    ].format_help().replace("\n", " ").replace("  ", " ")


def test_a_state_directory_of_an_older_version_is_tightened(tmp_path):
    from batchgen.service import store as st

    old = tmp_path / "state"
    (old / "files").mkdir(parents=True)
    first = st.Store(old)
    first.create_file([b"secret"], "in.jsonl", "batch")
    first.close()
    for path in (old, old / "files", *old.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)  # what older versions left
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)  # an existing folder that is not a store: only its insides
    st.Store(shared).close()
    st.Store(old).close()
    assert oct(old.stat().st_mode & 0o777) == "0o700"
    assert oct(shared.stat().st_mode & 0o777) == "0o755"
    for path in (*old.rglob("*"), *shared.rglob("*")):
        assert oct(path.stat().st_mode & 0o777) == ("0o700" if path.is_dir() else "0o600"), path
