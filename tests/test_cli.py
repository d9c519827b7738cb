"""The ``batchgen`` command line's vLLM habits, in process with fake engines (no model):
``serve MODEL``, ``--version``, ``python -m batchgen``, subcommand usage on errors, and the
defaults that follow the engine's running-sequence limit. Signals during ``batchgen run``
are in test_cli_signals.py."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
from test_batch_runner import FakeEngine, completion_line, write_lines

import batchgen
from batchgen.config import EngineConfig
from batchgen.entrypoints import cli, cli_flags


@pytest.fixture
def serve_calls(monkeypatch):
    """``batchgen serve`` without a model or a server: records the engine kwargs and config."""
    calls: dict = {}

    def fake_start(kwargs):
        calls["engine"] = kwargs
        return SimpleNamespace(config=EngineConfig(**kwargs))

    def fake_run_server(engine, config, host, port):
        calls["service"] = config

    import batchgen.service.server as server

    monkeypatch.setattr(cli_flags, "start_engine", fake_start)
    monkeypatch.setattr(server, "run_server", fake_run_server)
    return calls


def test_serve_takes_the_model_as_a_positional_argument(serve_calls, tmp_path):
    state = ["--state-dir", str(tmp_path / "state")]
    assert cli.main(["serve", "/models/mixtral", *state]) == 0
    assert serve_calls["engine"] == {"model": "/models/mixtral"}
    assert cli.main(["serve", "--model", "/models/m2", *state]) == 0  # --model still works
    assert serve_calls["engine"] == {"model": "/models/m2"}
    assert cli.main(["serve", "/models/m3", "--model", "/models/m3", *state]) == 0
    assert serve_calls["engine"] == {"model": "/models/m3"}


def test_serve_refuses_two_different_models(serve_calls, tmp_path, capsys):
    argv = ["serve", "/models/a", "--model", "/models/b", "--state-dir", str(tmp_path)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("batchgen serve: error: the model is given twice")
    assert "'/models/a'" in err and "'/models/b'" in err and "engine" not in serve_calls


def test_version_flag_and_python_dash_m():
    version = importlib.metadata.version("batchgen")
    assert batchgen.__version__ == version  # one version, in pyproject.toml and the package
    for argv in ([sys.executable, "-m", "batchgen", "--version"],):
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert (proc.returncode, proc.stdout.strip()) == (0, version)
    proc = subprocess.run(
        [sys.executable, "-m", "batchgen", "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and "usage: batchgen" in proc.stdout
    assert all(name in proc.stdout for name in ("run", "serve", "submit", "bench"))


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["run", "-i", "a", "-o", "b", "--bogus"], "usage: batchgen run "),
        (["serve", "m", "extra-word"], "usage: batchgen serve "),
        (["submit", "-i", "a", "-o", "b", "--max-num-seqs", "4"], "usage: batchgen submit "),
        (["run", "-i", "a"], "usage: batchgen run "),  # argparse's own errors did this already
    ],
)
def test_a_subcommand_error_prints_that_subcommands_usage(argv, usage, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage), err
    assert f"batchgen {argv[0]}: error: " in err


@pytest.mark.parametrize(
    ("flag", "value", "allowed"),
    [
        ("--dtype", "bf16", "'auto', 'float32', 'bfloat16', 'float16'"),
        ("--device", "gpu", "'auto', 'cpu', 'cuda'"),
        ("--scheduler-policy", "fifo", "'coalesce', 'lockstep'"),
        ("--prefill-strategy", "x", "'expert_parallel', 'data_parallel_offload'"),
        ("--decode-strategy", "x", "'dp_attention_ep_moe', 'data_parallel'"),
        ("--distributed-executor-backend", "slurm", "'mp', 'ray'"),
        ("--load-balance-method", "random", "'minimum_tokens', 'round_robin'"),
        ("--kv-cache-dtype", "fp4", "'auto', 'bfloat16', 'fp8', 'fp8_e4m3', 'fp8_e5m2'"),
    ],
)
@pytest.mark.parametrize("subcommand", ["run", "serve"])
def test_a_bad_enumerated_flag_is_a_usage_error_before_the_engine_starts(
    subcommand, flag, value, allowed, tmp_path, monkeypatch, capsys
):
    """Before: "cannot start the engine: dtype must be one of ..." from the engine config."""
    started = []
    monkeypatch.setattr(cli_flags, "start_engine", started.append)
    files = ["-i", "a", "-o", "b"] if subcommand == "run" else ["--state-dir", str(tmp_path)]
    with pytest.raises(SystemExit) as info:
        cli.main([subcommand, *files, flag, value])
    assert info.value.code == 2 and started == []
    err = capsys.readouterr().err
    assert err.startswith(f"usage: batchgen {subcommand} ")
    last = err.splitlines()[-1]
    assert last.startswith(f"batchgen {subcommand}: error: argument {flag}: invalid choice: ")
    # argparse quotes the choices or not depending on the Python version
    assert last.replace("'", "").endswith(f"(choose from {allowed.replace(chr(39), '')})")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--modes", "foo"], "--modes: unknown ['foo']"),
        (["--rollouts-requests", "0"], "--rollouts-requests: must be >= 1, got 0"),
        (["--config", "CONFIG"], "c.yaml:1: batchgen_cluster: missing `model`"),
    ],
)
def test_bench_usage_errors_exit_2_before_anything_loads(argv, message, tmp_path, capsys):
    """As argparse's own errors and `batchgen run`'s (they exited 1 with SystemExit(str))."""
    config = tmp_path / "c.yaml"
    config.write_text("batchgen_cluster:\n  engine:\n    dtype: float32\n")
    argv = [str(config) if a == "CONFIG" else a for a in argv]
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("batchgen bench: error: ") and message in err, err


def test_bench_kv_cache_dtype_an_mla_model_refuses_exits_2_before_any_mode(
    checkpoint_dir, monkeypatch, capsys, tmp_path
):
    """Before: the hf modes ran for minutes, then each BatchGen mode 'failed' with the engine's
    MLA error and the bench exited 0."""
    from batchgen.bench import runner

    class Ran(Exception):
        pass

    ran = []

    def fake_run(**kwargs):
        ran.append(kwargs)
        raise Ran

    monkeypatch.setattr(runner, "run", fake_run)
    model = str(checkpoint_dir("deepseek_v2"))
    argv = ["bench", "--model", model, "--kv-cache-dtype", "fp8", "--modes", "hf_generate,coalesce"]
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2 and ran == []
    err = capsys.readouterr().err
    assert err.startswith("batchgen bench: error: --kv-cache-dtype: kv_cache_dtype='fp8' is not "
                          "supported for MLA models"), err  # fmt: skip
    # the hf modes alone do not build a BatchGen engine; auto and a non-MLA model are fine
    for other in (["--modes", "hf_generate"], ["--kv-cache-dtype", "auto"]):
        with pytest.raises(Ran):
            cli.main([*argv, *other])
    with pytest.raises(Ran):
        cli.main(["bench", "--model", str(checkpoint_dir("mixtral")), "--kv-cache-dtype", "fp8"])
    assert len(ran) == 3
    # From a cluster file the error names the file's key, not a flag that was not given.
    config = tmp_path / "c.yaml"
    config.write_text(f"batchgen_cluster:\n  model: {model}\n  engine:\n    kv_cache_dtype: fp8\n")
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "--config", str(config), "--modes", "coalesce"])
    assert info.value.code == 2 and len(ran) == 3
    err = capsys.readouterr().err
    assert err.startswith(f"batchgen bench: error: batchgen_cluster.engine.kv_cache_dtype in "
                          f"{config}: "
                          "kv_cache_dtype='fp8' is not supported for MLA models"), err  # fmt: skip


def test_serve_help_states_the_real_max_in_flight_default(serve_calls, tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: the engine's running-sequence limit, --max-num-seqs: 1024 with the " in text
    assert "coalesce policy, 256 with lockstep)" in text
    from batchgen.service.runtime import _running_seqs

    # The service's default: what the help says, under both policies and both knob names.
    assert _running_seqs(EngineConfig()) == 1024
    assert _running_seqs(EngineConfig(scheduler_policy="lockstep")) == 256
    assert _running_seqs(EngineConfig(max_num_seqs=7)) == 7
    assert _running_seqs(EngineConfig(max_active_coroutines=9)) == 9
    cli.main(["serve", "m", "--max-num-seqs", "5", "--state-dir", str(tmp_path)])
    assert serve_calls["service"].max_in_flight is None  # resolved by the service


def test_run_keeps_at_most_max_num_seqs_requests_in_flight(tmp_path, monkeypatch):
    src = write_lines(tmp_path / "in.jsonl", [completion_line(f"r{i}") for i in range(20)])
    engine = FakeEngine(per_step=1, limit=3)
    engine.config = EngineConfig(max_num_seqs=3)

    monkeypatch.setattr(cli_flags, "start_engine", lambda kwargs: engine)
    argv = ["run", "-i", str(src), "-o", str(tmp_path / "o.jsonl"), "--no-progress"]
    assert cli.main([*argv, "--max-num-seqs", "3"]) == 0
    assert engine.max_unfinished == 3  # the engine's limit, not a fixed 1024


def test_resume_with_every_result_present_does_not_load_the_model(tmp_path, monkeypatch, capsys):
    lines = [completion_line("a"), "{not json", completion_line("a"), completion_line("b")]
    src = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "o.jsonl"
    argv = ["run", "-i", str(src), "-o", str(out), "--no-progress", "--resume"]
    started = []

    def start(kwargs):
        started.append(kwargs)
        return FakeEngine()

    monkeypatch.setattr(cli_flags, "start_engine", start)
    assert cli.main(argv) == 0 and len(started) == 1  # no output yet: runs
    full = out.read_text()
    assert len(full.splitlines()) == 4
    capsys.readouterr()
    assert cli.main(argv) == 0 and len(started) == 1  # nothing left: no engine
    assert out.read_text() == full
    assert capsys.readouterr().err == (
        f"batchgen run: nothing to do: all 4 requests of {src} already have a result in "
        f"{out} (--resume; 2 of them errors: add --retry-failed to run those again); the model "
        "was not loaded\n"
    )
    # One result missing (the duplicate's, keyed by its line): the engine starts again.
    kept = [r for r in full.splitlines() if (json.loads(r)["error"] or {}).get("line") != 3]
    assert len(kept) == 3
    out.write_text("\n".join(kept) + "\n")
    assert cli.main(argv) == 0 and len(started) == 2
    assert len(out.read_text().splitlines()) == 4


def test_the_cli_module_does_not_load_torch():
    """The OpenMP wait policy must be set before torch loads libgomp: the CLI imports torch
    only in the subcommands, after `set_openmp_wait_policy`."""
    code = "import sys, batchgen.entrypoints.cli; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.stdout.strip() == "False", proc.stderr


def test_a_bad_log_level_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """Before: a ValueError traceback from logging (exit 1)."""
    monkeypatch.setenv("BATCHGEN_LOG_LEVEL", "quiet")
    argv = ["run", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err == (
        "batchgen run: error: BATCHGEN_LOG_LEVEL='quiet': expected one of DEBUG, INFO, WARNING, "
        "ERROR, CRITICAL (any case)\n"
    )


def test_main_leaves_the_batchgen_logger_as_it_found_it(tmp_path, monkeypatch):
    """Called in process (tests, notebooks), main used to leave its stderr handler (on a stream
    that may be closed later) and its INFO level on the "batchgen" logger: every later INFO
    record then reached the root handlers, and each call added one more handler."""
    import logging

    logger = logging.getLogger("batchgen")
    before = (list(logger.handlers), logger.level)
    write_lines(tmp_path / "in.jsonl", [completion_line("a")])
    monkeypatch.setattr(cli_flags, "start_engine", lambda kwargs: FakeEngine())
    argv = ["run", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")]
    assert cli.main([*argv, "--no-progress"]) == 0
    assert cli.main(["run", "-i", str(tmp_path / "missing.jsonl"), "-o", "x"]) == 2
    assert (list(logger.handlers), logger.level) == before
