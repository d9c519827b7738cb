"""Helpers of the service tests: a real ``batchgen serve`` subprocess on 127.0.0.1, a tiny
checkpoint, batch-line builders."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

BATCHGEN = [sys.executable, "-m", "batchgen.entrypoints.cli"]
API_KEY = "sk-test-key"
START_TIMEOUT_S = 120.0


def make_tiny_model(root: Path) -> Path:
    from batchgen.models.make_model import make_model

    return make_model(
        "mixtral",
        root / "tiny-mixtral",
        seed=0,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
    )


def env(tmp: Path) -> dict:
    e = dict(os.environ, HF_HUB_OFFLINE="1", BATCHGEN_CACHE_DIR=str(tmp / "cache"))
    e.pop("VIRTUAL_ENV", None)
    e.pop("BATCHGEN_API_KEY", None)
    return e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``batchgen serve`` subprocess. ``url`` is its base URL; `kill` sends SIGKILL."""

    def __init__(self, model: Path, state_dir: Path, log: Path, *extra: str, port: int = 0):
        self.model, self.state_dir, self.log_path = model, state_dir, log
        self.extra = extra
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Server:
        args = [
            *BATCHGEN,
            "serve",
            "--model",
            str(self.model),
            "--port",
            str(self.port),
            "--state-dir",
            str(self.state_dir),
            "--device",
            "cpu",
            *self.extra,
        ]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=env(self.state_dir.parent)
        )
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server did not start: {self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def completion_line(custom_id: str, prompt: str, **body) -> str:
    body = {"prompt": prompt, **body}
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}
    )


def slow_lines(n: int, max_tokens: int, prefix: str = "r") -> str:
    """``n`` greedy completion lines that each generate exactly ``max_tokens`` tokens."""
    return "".join(
        completion_line(
            f"{prefix}-{i}",
            f"prompt number {i}",
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
        )
        + "\n"
        for i in range(n)
    )


def jsonl(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def is_error_object(response: httpx.Response) -> bool:
    """True for an OpenAI error object without any trace of a stack trace."""
    body = response.json()
    error = body.get("error") if isinstance(body, dict) else None
    return (
        isinstance(error, dict)
        and set(error) == {"message", "type", "param", "code"}
        and "Traceback" not in response.text
        and 'File "' not in response.text
    )
