"""`batchgen` CLI end to end with the real engine, in subprocesses: the main job on the examples
with the embedded default model, a mixed good/bad file, SIGKILL then --resume, make-model."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchgen.models.default_model import DEFAULT_MODEL_NAME

REPO = Path(__file__).resolve().parents[1]
BATCHGEN = [sys.executable, "-m", "batchgen.entrypoints.cli"]


def _env(tmp_path: Path) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", BATCHGEN_CACHE_DIR=str(tmp_path / "cache"))
    for name in ("VIRTUAL_ENV", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"):
        env.pop(name, None)
    return env


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _completion(cid: str, prompt: str, **body) -> str:
    return json.dumps(
        {
            "custom_id": cid,
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": prompt, **body},
        }
    )


def test_run_examples_with_default_model(tmp_path):
    out = tmp_path / "results.jsonl"
    proc = subprocess.run(
        [
            *BATCHGEN,
            "run",
            "-i",
            str(REPO / "examples/requests.jsonl"),
            "-o",
            str(out),
            "--no-progress",
        ],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    inputs = _lines(REPO / "examples/requests.jsonl")
    results = _lines(out)
    assert sorted(r["custom_id"] for r in results) == sorted(
        i.get("custom_id", f"line-{n}") for n, i in enumerate(inputs, 1)
    )
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in results)
    by_id = {r["custom_id"]: r for r in results}
    for n, line in enumerate(inputs, 1):
        body = by_id[line.get("custom_id", f"line-{n}")]["response"]["body"]
        req = line.get("body", line)
        assert len(body["choices"]) == req.get("n", 1)
        assert body["model"] == f"batchgen/{DEFAULT_MODEL_NAME}"  # a name, not a cache path
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        limit = req.get("max_tokens", 16 if "prompt" in req else None)
        if limit is not None:
            assert usage["completion_tokens"] <= limit * req.get("n", 1)
    assert "49 ok, 0 failed" in proc.stderr
    # The first use builds the default model, and says so; the example names the served model.
    built = tmp_path / "cache" / DEFAULT_MODEL_NAME
    assert f"building the default model into {built} (first use, random weights)" in proc.stderr
    assert "lines name model" not in proc.stderr and "line names model" not in proc.stderr
    # The first run says why its text is gibberish, at start and in the summary.
    assert proc.stderr.count("has random weights, so its text is gibberish") == 2
    assert "batchgen run: note: the default model batchgen/default-mixtral-v1" in proc.stderr
    assert "--model allenai/OLMoE-1B-7B-0924" in proc.stderr and "28 GB" in proc.stderr
    # Threads chosen and logged; the wait policy was set before torch loaded OpenMP.
    assert "CPU threads: " in proc.stderr
    policy = re.search(r"OpenMP wait policy: (\S+)", proc.stderr).group(1)
    assert policy in ("OMP_WAIT_POLICY=PASSIVE", "GOMP_SPINCOUNT=10000")  # busy / idle machine


def test_run_takes_the_default_models_name_as_its_model(tmp_path):
    """``--model batchgen/default-mixtral-v1``, the name results carry, is the default model."""
    name = f"batchgen/{DEFAULT_MODEL_NAME}"
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(_completion("a", "hello", max_tokens=3, model=name) + "\n")
    proc = subprocess.run(
        [*BATCHGEN, "run", "-i", str(inp), "-o", str(out), "--no-progress", "--model", name],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    [result] = _lines(out)
    assert result["error"] is None and result["response"]["body"]["model"] == name
    built = tmp_path / "cache" / DEFAULT_MODEL_NAME
    assert f"building the default model into {built} (first use, random weights)" in proc.stderr
    assert "line names model" not in proc.stderr  # the line names the model that ran


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from batchgen.models.make_model import make_model

    return str(
        make_model(
            "mixtral",
            tmp_path_factory.mktemp("m") / "mixtral",
            seed=5,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
        )
    )


def test_mixed_good_and_bad_lines(tmp_path, tiny_model):
    inp = tmp_path / "in.jsonl"
    lines = [
        _completion("ok-1", "hello", max_tokens=5, temperature=0),
        "{not json",
        json.dumps(["an", "array"]),
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
        _completion("ok-1", "duplicate id", max_tokens=3),
        json.dumps(
            {
                "custom_id": "bad-url",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"input": "x"},
            }
        ),
        _completion("bad-temp", "x", temperature="hot"),
        _completion("bad-range", "x", top_p=7),
        _completion("too-long", "word " * 5000, max_tokens=2),
        _completion("too-many-tokens", "hello", max_tokens=100000),
        json.dumps(
            {
                "custom_id": "chat-ok",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4,
                    "n": 2,
                    "seed": 1,
                },
            }
        ),
        "",
        _completion("ok-2", "world", max_tokens=4, logprobs=2, temperature=0),
    ]
    inp.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [
            *BATCHGEN,
            "run",
            "-i",
            str(inp),
            "-o",
            str(out),
            "--model",
            tiny_model,
            "--no-progress",
            "--max-model-len",
            "512",
        ],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    results = _lines(out)
    ok = {r["custom_id"] for r in results if r["error"] is None}
    assert ok == {"ok-1", "chat-ok", "ok-2"}
    errors = [r for r in results if r["error"] is not None]
    messages = " | ".join(r["error"]["message"] for r in errors)
    for needle in [
        "line 2",
        "line 3",
        "custom_id",
        'line 5: custom_id "ok-1" already used on line 1',
        "/v1/embeddings",
        "temperature",
        "top_p",
        "max_model_len",
    ]:
        assert needle in messages, needle
    assert len(errors) == 9
    params = {r["custom_id"]: r["error"]["param"] for r in errors}
    assert params["too-long"] == "prompt" and params["too-many-tokens"] == "max_tokens"
    chat = next(r for r in results if r["custom_id"] == "chat-ok")["response"]["body"]
    assert chat["object"] == "chat.completion" and len(chat["choices"]) == 2
    lp = next(r for r in results if r["custom_id"] == "ok-2")["response"]["body"]["choices"][0]
    assert len(lp["logprobs"]["tokens"]) == 4
    assert "random weights" not in proc.stderr  # said of the default model only


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM", "SIGHUP"])
def test_kill_then_resume_gives_each_custom_id_once(tmp_path, tiny_model, sig):
    """Killed mid-run (SIGKILL: nothing runs after it; SIGTERM, or SIGHUP from a closed
    terminal: an orderly stop, exit 143 / 129 and a line that says how to go on), --resume
    finishes each custom_id once, as a clean run."""
    inp = tmp_path / "in.jsonl"
    ids = [f"req-{i:03d}" for i in range(40)]
    inp.write_text(
        "".join(
            _completion(
                c,
                f"prompt number {i} " * (1 + i % 7),
                max_tokens=48,
                temperature=0,
                ignore_eos=True,
            )
            + "\n"
            for i, c in enumerate(ids)
        )
    )
    ref_out = tmp_path / "ref.jsonl"
    args = ["--model", tiny_model, "--no-progress", "--max-in-flight", "4"]
    subprocess.run(
        [*BATCHGEN, "run", "-i", str(inp), "-o", str(ref_out), *args],
        env=_env(tmp_path),
        check=True,
        capture_output=True,
        timeout=300,
    )
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(
        [*BATCHGEN, "run", "-i", str(inp), "-o", str(out), *args],
        env=_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        if out.exists() and out.read_text().count("\n") >= 6:
            break
        time.sleep(0.05)
    proc.send_signal(getattr(signal, sig))
    _, stderr = proc.communicate(timeout=120)
    if sig != "SIGKILL":
        assert proc.returncode == 128 + getattr(signal, sig), stderr
        kept = out.read_text().count("\n")
        noun = "result" if kept == 1 else "results"
        assert (
            f"batchgen run: terminated by {sig}; {kept} {noun} written by this run in {out} "
            "(rerun with --resume to continue)"
        ) in stderr
        assert [json.loads(line)["custom_id"] for line in out.read_text().splitlines()]
    else:
        assert proc.returncode == -signal.SIGKILL
    done_before = out.read_text().count("\n")
    assert 6 <= done_before < 40, "the kill should land mid-run"
    subprocess.run(
        [*BATCHGEN, "run", "-i", str(inp), "-o", str(out), "--resume", *args],
        env=_env(tmp_path),
        check=True,
        capture_output=True,
        timeout=300,
    )
    results = _lines(out)
    assert sorted(r["custom_id"] for r in results) == ids
    text = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in results}
    ref = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in _lines(ref_out)}
    assert text == ref


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory) -> Path:
    """A cache dir the tests below share: the kernels compile into it once."""
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("delay", [0.01, 0.2])
def test_a_second_signal_while_stopping_prints_no_traceback(
    tmp_path, tiny_model, kernel_cache, delay
):
    """SIGTERM, then SIGINT ``delay`` s later (a supervisor and a Ctrl-C to the process group):
    it lands in the orderly stop, in torch's exit handlers or in the interpreter's teardown,
    and changes nothing: exit 143, one line on stderr, no traceback, every result kept."""
    inp = tmp_path / "in.jsonl"
    ids = [f"req-{i:03d}" for i in range(40)]
    inp.write_text(
        "".join(
            _completion(c, f"prompt number {i} " * (1 + i % 7), max_tokens=48, ignore_eos=True)
            + "\n"
            for i, c in enumerate(ids)
        )
    )
    out = tmp_path / "out.jsonl"
    args = ["--model", tiny_model, "--no-progress", "--max-in-flight", "4"]
    proc = subprocess.Popen(
        [*BATCHGEN, "run", "-i", str(inp), "-o", str(out), *args],
        env=dict(_env(tmp_path), BATCHGEN_CACHE_DIR=str(kernel_cache)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            if out.exists() and out.read_text().count("\n") >= 6:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    results = _lines(out)  # every line whole
    kept = len(results)
    assert 6 <= kept < 40, "the signals should land mid-run"
    assert len({r["custom_id"] for r in results}) == kept
    assert all(r["error"] is None for r in results)
    noun = "result" if kept == 1 else "results"
    assert stderr.count("batchgen run: ") == 1 and (
        f"batchgen run: terminated by SIGTERM; {kept} {noun} written by this run in {out} "
        "(rerun with --resume to continue)"
    ) in stderr


def test_make_model_writes_a_checkpoint_transformers_loads(tmp_path):
    out = tmp_path / "llama"
    proc = subprocess.run(
        [*BATCHGEN, "make-model", "--arch", "llama", "--out", str(out)],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    for name in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ]:
        assert (out / name).is_file(), name
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(out)
    assert (
        tok.chat_template
        and tok.decode(tok.encode("héllo 🚀"), skip_special_tokens=True) == "héllo 🚀"
    )
    model = tf.AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM"
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 4]


def test_cli_errors_are_one_line(tmp_path):
    proc = subprocess.run(
        [*BATCHGEN, "run", "-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o.jsonl")],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "missing.jsonl" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "arch",
    [
        "mixtral",
        "qwen2_moe",
        "qwen3_moe",
        "olmoe",
        "deepseek_v2",
        "deepseek_v3",
        "llama",
        "mistral",
        "qwen2",
    ],
)
def test_every_make_model_arch_runs_a_batch_file(tmp_path, arch):
    """Each architecture end to end through the `batchgen run` path (in process)."""
    from batchgen import LLM
    from batchgen.entrypoints.batch_runner import run_batch_file
    from batchgen.models.make_model import make_model

    path = make_model(
        arch, tmp_path / arch, seed=1, hidden_size=64, intermediate_size=96, num_hidden_layers=2
    )
    inp = tmp_path / "in.jsonl"
    inp.write_text(
        _completion(
            "c", "Extract the total: invoice 42 EUR", max_tokens=6, temperature=0, ignore_eos=True
        )
        + "\n"
        + json.dumps(
            {
                "custom_id": "m",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 5,
                    "n": 2,
                    "seed": 3,
                    "ignore_eos": True,
                },
            }
        )
        + "\n"
    )
    llm = LLM(str(path), device="cpu", kv_cache_memory_gb=0.05)
    summary = run_batch_file(llm.llm_engine, inp, tmp_path / "out.jsonl", progress=False)
    assert (summary.succeeded, summary.failed) == (2, 0)
    results = {r["custom_id"]: r for r in _lines(tmp_path / "out.jsonl")}
    assert results["c"]["response"]["body"]["usage"]["completion_tokens"] == 6
    assert results["m"]["response"]["body"]["usage"]["completion_tokens"] == 10


def test_run_reads_its_input_from_a_pipe(tmp_path, tiny_model):
    """`-i <(zcat big.jsonl.gz)` or a named FIFO: read once, streamed (no total), every line
    run; was refused as 'does not exist' (only a regular file passed the path check)."""
    import threading

    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    ids = [f"p{i}" for i in range(3)]
    text = "".join(_completion(c, f"pipe {c}", max_tokens=4, temperature=0) + "\n" for c in ids)

    def feed():
        with open(fifo, "w") as f:  # blocks until the run opens the FIFO
            f.write(text)

    threading.Thread(target=feed, daemon=True).start()
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [*BATCHGEN, "run", "-i", str(fifo), "-o", str(out), "--model", tiny_model],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(r["custom_id"] for r in _lines(out)) == ids
    assert all(r["error"] is None for r in _lines(out))
