"""The error ``code`` of the Files and Batches routes, in process (the app over a fake engine,
its engine thread never started): a missing parameter is ``missing_required_parameter``, an
unknown one ``unsupported_parameter``, a bad value ``invalid_<param>``. Before, a batch without
``input_file_id`` was answered "'input_file_id' must be a file id" with ``code: null``, and so
was a wrong upload ``purpose``."""

from __future__ import annotations

import io

import pytest
from fastapi.testclient import TestClient
from test_batch_runner import FakeEngine

from batchgen.config import EngineConfig
from batchgen.service.app import ServiceConfig, create_app

WINDOW = {"completion_window": "24h"}
ENDPOINT = {"endpoint": "/v1/completions"}


@pytest.fixture
def app(tmp_path):
    engine = FakeEngine()
    engine.config = EngineConfig()
    return create_app(engine, ServiceConfig(state_dir=tmp_path / "state"))


@pytest.fixture
def http(app):
    client = TestClient(app)  # not entered: no lifespan, so no engine thread
    yield client
    app.state.service.store.close()


def _error(response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {**ENDPOINT, **WINDOW},
            "input_file_id",
            "missing required parameter 'input_file_id' (the id of a file uploaded with purpose "
            '"batch")',
        ),
        (
            {"input_file_id": None, **ENDPOINT, **WINDOW},
            "input_file_id",
            "missing required parameter 'input_file_id' (the id of a file uploaded with purpose "
            '"batch")',
        ),
        (
            {"input_file_id": "file-1", **WINDOW},
            "endpoint",
            "missing required parameter 'endpoint' (one of ['/v1/completions', "
            "'/v1/chat/completions'])",
        ),
        (
            {"input_file_id": "file-1", **ENDPOINT},
            "completion_window",
            "missing required parameter 'completion_window' (\"24h\")",
        ),
    ],
)
def test_a_missing_batch_parameter_is_named_with_its_code(http, body, param, message):
    assert _error(http.post("/v1/batches", json=body)) == {
        "message": message,
        "type": "invalid_request_error",
        "param": param,
        "code": "missing_required_parameter",
    }


@pytest.mark.parametrize(
    ("body", "param", "code", "message"),
    [
        (
            {"input_file": "file-1", **ENDPOINT, **WINDOW},
            "input_file",
            "unsupported_parameter",
            "unknown field 'input_file'; did you mean 'input_file_id'?",
        ),
        (
            {"input_file_id": "file-1", "zzz": 1, **ENDPOINT, **WINDOW},
            "zzz",
            "unsupported_parameter",
            "unknown field 'zzz'; the fields are ['input_file_id', 'endpoint', "
            "'completion_window', 'metadata']",
        ),
        (
            {"input_file_id": 12, **ENDPOINT, **WINDOW},
            "input_file_id",
            "invalid_input_file_id",
            "'input_file_id' must be a file id (a string), got 12",
        ),
        (
            {"input_file_id": "", **ENDPOINT, **WINDOW},
            "input_file_id",
            "invalid_input_file_id",
            "'input_file_id' must be a file id (a string), got \"\"",
        ),
        (
            {"input_file_id": "file-1", "endpoint": "/v1/embeddings", **WINDOW},
            "endpoint",
            "invalid_endpoint",
            "'endpoint' must be one of ['/v1/completions', '/v1/chat/completions'], got "
            "'/v1/embeddings'",
        ),
    ],
)
def test_a_bad_batch_parameter_gets_a_code(http, body, param, code, message):
    error = _error(http.post("/v1/batches", json=body))
    assert (error["param"], error["code"], error["message"]) == (param, code, message)


def test_a_batch_over_a_file_of_another_purpose_gets_a_code(app, http):
    store = app.state.service.store
    row = store.create_file(io.BytesIO(b"{}\n"), "out.jsonl", "batch_output")
    body = {"input_file_id": row["id"], **ENDPOINT, **WINDOW}
    assert _error(http.post("/v1/batches", json=body)) == {
        "message": f"file {row['id']!r} has purpose 'batch_output'; a batch input needs "
        'purpose "batch"',
        "type": "invalid_request_error",
        "param": "input_file_id",
        "code": "invalid_input_file_id",
    }
    missing = {"input_file_id": "file-00000000000000000000000000000000", **ENDPOINT, **WINDOW}
    error = _error(http.post("/v1/batches", json=missing), 404)
    assert (error["param"], error["code"]) == ("input_file_id", "not_found")


def test_upload_errors_get_codes(http):
    jsonl = {"file": ("in.jsonl", b"{}\n")}
    assert _error(http.post("/v1/files", files=jsonl, data={"purpose": "fine-tune"})) == {
        "message": "'purpose' must be \"batch\" (the only purpose BatchGen serves), got "
        "'fine-tune'",
        "type": "invalid_request_error",
        "param": "purpose",
        "code": "invalid_purpose",
    }
    assert _error(http.post("/v1/files", files=jsonl)) == {
        "message": "missing required parameter 'purpose' (\"batch\")",
        "type": "invalid_request_error",
        "param": "purpose",
        "code": "missing_required_parameter",
    }
    error = _error(http.post("/v1/files", data={"purpose": "batch"}))
    assert (error["param"], error["code"], error["message"]) == (
        "file",
        "missing_required_parameter",
        "missing required parameter 'file' (the batch input, a multipart/form-data file part)",
    )
    error = _error(http.get("/v1/files?order=sideways"))
    assert (error["param"], error["code"]) == ("order", "invalid_order")
    error = _error(http.get("/v1/batches?limit=0"))
    assert (error["param"], error["code"]) == ("limit", "invalid_limit")
    ok = http.post("/v1/files", files=jsonl, data={"purpose": "batch"})
    assert ok.status_code == 200 and ok.json()["purpose"] == "batch"
