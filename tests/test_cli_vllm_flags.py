"""vLLM's flags without a BatchGen setting (`batchgen.entrypoints.vllm_flags`) on ``batchgen
run`` and ``batchgen serve``, in process with fake engines: a no-op runs and logs one INFO line
saying why, anything else is a usage error naming the flag and the way out. Before, each of
them stopped at argparse's bare "unrecognized arguments"."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_batch_runner import FakeEngine, completion_line, read_results, write_lines

from batchgen.entrypoints import cli, cli_flags
from batchgen.entrypoints.vllm_flags import VLLM_FLAGS


@pytest.fixture
def started(monkeypatch):
    """The engine kwargs of each `start_engine` call (a `FakeEngine` runs instead)."""
    calls: list[dict] = []

    def fake_start(kwargs):
        calls.append(kwargs)
        return FakeEngine()

    monkeypatch.setattr(cli_flags, "start_engine", fake_start)
    return calls


def _run_argv(tmp_path, *flags: str) -> list[str]:
    src = write_lines(tmp_path / "in.jsonl", [completion_line("a"), completion_line("b")])
    return ["run", "-i", str(src), "-o", str(tmp_path / "out.jsonl"), "--no-progress", *flags]


NOOPS = [
    (
        ["--trust-remote-code"],
        "--trust-remote-code: vLLM's flag, accepted with no effect: each supported "
        "architecture runs BatchGen's own implementation (docs/models.md), never Python code "
        "shipped with a checkpoint",
    ),
    (
        ["--enable-chunked-prefill"],
        "--enable-chunked-prefill: vLLM's flag, accepted with no effect: prefill is always "
        "chunked (a step takes at most --max-num-batched-tokens tokens)",
    ),
    (
        ["--disable-log-stats"],
        "--disable-log-stats: vLLM's flag, accepted with no effect: no periodic engine stats "
        "are logged (batchgen serve's counters are at /metrics)",
    ),
    (
        ["--disable-log-requests"],
        "--disable-log-requests: vLLM's flag, accepted with no effect: no line is logged per "
        "request",
    ),
    (
        ["--swap-space", "4"],
        "--swap-space 4: vLLM's flag, accepted with no effect: a preempted sequence is "
        "recomputed, as in vLLM V1: nothing is swapped to CPU memory",
    ),
    (
        ["--max-logprobs", "20"],
        "--max-logprobs 20: vLLM's flag, accepted with no effect: a request's logprobs and "
        "prompt_logprobs are capped at 20 (vLLM's default), a fixed limit",
    ),
    (
        ["--tokenizer-mode", "auto"],
        "--tokenizer-mode auto: vLLM's flag, accepted with no effect: the tokenizer loads as "
        "with vLLM's 'auto' (transformers' AutoTokenizer, the fast one where the checkpoint has "
        "tokenizer.json)",
    ),
    (
        ["--revision", "main"],
        "--revision main: vLLM's flag, accepted with no effect: a hub id is loaded at its main "
        "branch, through the Hugging Face cache",
    ),
    (
        ["-pp", "1"],
        "--pipeline-parallel-size 1: vLLM's flag, accepted with no effect: there is no "
        "pipeline parallelism",
    ),
]


@pytest.mark.parametrize(("flags", "line"), NOOPS)
def test_a_vllm_flag_batchgen_already_obeys_runs_and_says_so(
    flags, line, tmp_path, started, capsys
):
    assert cli.main(_run_argv(tmp_path, *flags)) == 0
    assert started == [{}]  # nothing reaches the engine's settings
    assert len(read_results(tmp_path / "out.jsonl")) == 2
    err = capsys.readouterr().err
    tag = " INFO batchgen.entrypoints.vllm_flags: "
    assert [x.split(tag, 1)[1] for x in err.splitlines() if "vllm_flags" in x] == [line]


def test_several_noops_each_log_once_and_the_real_flags_still_apply(tmp_path, started, capsys):
    argv = _run_argv(
        tmp_path, "--trust-remote-code", "--max-num-seqs", "3", "--enable-chunked-prefill"
    )
    assert cli.main(argv) == 0
    assert started == [{"max_num_seqs": 3}]
    err = capsys.readouterr().err
    assert err.count("--trust-remote-code: vLLM's flag, accepted with no effect") == 1
    assert err.count("--enable-chunked-prefill: vLLM's flag, accepted with no effect") == 1


REFUSED = [
    (
        ["--quantization", "awq"],
        "argument --quantization/-q: vLLM's --quantization awq is not taken by BatchGen: "
        "quantized weights are not supported yet (float32, bfloat16 or float16 weights: "
        "--dtype; a quantized checkpoint is refused as it loads); use an unquantized "
        "checkpoint; --kv-cache-dtype fp8 makes the KV cache smaller",
    ),
    (
        ["-q", "fp8"],
        "argument --quantization/-q: vLLM's --quantization fp8 is not taken by BatchGen: "
        "quantized weights are not supported yet (float32, bfloat16 or float16 weights: "
        "--dtype; a quantized checkpoint is refused as it loads); use an unquantized "
        "checkpoint; --kv-cache-dtype fp8 makes the KV cache smaller",
    ),
    (
        ["--revision", "v1.0"],
        "argument --revision: vLLM's --revision v1.0 is not taken by BatchGen: a hub id is "
        "loaded at its main branch, through the Hugging Face cache (accepted only as "
        "--revision main); download that revision (`hf download MODEL --revision REV "
        "--local-dir DIR`) and pass --model DIR",
    ),
    (
        ["--download-dir", "/data/hf"],
        "argument --download-dir: vLLM's --download-dir /data/hf is not taken by BatchGen: hub "
        "downloads go to the Hugging Face cache; set HF_HUB_CACHE=DIR (or HF_HOME) to choose "
        "where, or pass a checkpoint directory as --model",
    ),
    (
        ["--max-logprobs", "5"],
        "argument --max-logprobs: vLLM's --max-logprobs 5 is not taken by BatchGen: a "
        "request's logprobs and prompt_logprobs are capped at 20 (vLLM's default), a fixed "
        "limit (accepted only as --max-logprobs 20); drop the flag",
    ),
    (
        ["--tokenizer-mode", "mistral"],
        "argument --tokenizer-mode: vLLM's --tokenizer-mode mistral is not taken by BatchGen: "
        "the tokenizer loads as with vLLM's 'auto' (transformers' AutoTokenizer, the fast one "
        "where the checkpoint has tokenizer.json) (accepted only as --tokenizer-mode auto); "
        "drop the flag",
    ),
    (
        ["--no-enable-chunked-prefill"],
        "argument --no-enable-chunked-prefill: vLLM's --no-enable-chunked-prefill is not taken "
        "by BatchGen: prefill is always chunked; to prefill each prompt in one step, set "
        "--max-num-batched-tokens to at least the longest prompt",
    ),
    (
        ["--pipeline-parallel-size", "2"],
        "argument --pipeline-parallel-size/-pp: vLLM's --pipeline-parallel-size 2 is not taken "
        "by BatchGen: there is no pipeline parallelism (accepted only as "
        "--pipeline-parallel-size 1); several ranks are --data-parallel-size N "
        "--enable-expert-parallel (docs/distributed.md)",
    ),
]


@pytest.mark.parametrize("subcommand", ["run", "serve"])
@pytest.mark.parametrize(("flags", "message"), REFUSED)
def test_a_vllm_flag_batchgen_cannot_honour_is_a_usage_error_naming_it(
    subcommand, flags, message, tmp_path, started, capsys
):
    argv = _run_argv(tmp_path) if subcommand == "run" else ["serve", "--state-dir", str(tmp_path)]
    with pytest.raises(SystemExit) as info:
        cli.main([*argv, *flags])
    assert info.value.code == 2 and started == []
    err = capsys.readouterr().err
    assert err.startswith(f"usage: batchgen {subcommand} ")
    assert err.splitlines()[-1] == f"batchgen {subcommand}: error: {message}"
    assert not (tmp_path / "out.jsonl").exists()


def test_serve_takes_the_noops_too(tmp_path, monkeypatch, capsys):
    calls: dict = {}
    import batchgen.service.server as server

    monkeypatch.setattr(
        cli_flags, "start_engine", lambda kwargs: calls.setdefault("engine", kwargs)
    )
    monkeypatch.setattr(server, "run_server", lambda engine, config, host, port: None)
    argv = ["serve", "/models/m", "--state-dir", str(tmp_path), "--disable-log-requests"]
    assert cli.main([*argv, "--trust-remote-code"]) == 0
    assert calls["engine"] == {"model": "/models/m"}
    err = capsys.readouterr().err
    assert "--disable-log-requests: vLLM's flag, accepted with no effect" in err
    assert "--trust-remote-code: vLLM's flag, accepted with no effect" in err


def test_every_vllm_flag_is_in_run_help_and_the_docs_table(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps at hyphens
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    docs = (Path(__file__).resolve().parents[1] / "docs/batch-files.md").read_text()
    table = docs.split("| vLLM flag | here |", 1)[1].split("\n\n", 1)[0]
    for entry in VLLM_FLAGS:
        assert " ".join(entry.help().split()) in help_text, entry.flag
        assert all(f"`{name}`" in table for name in entry.names), entry.flag


def test_vllms_flags_that_batchgen_has_reach_the_engine(tmp_path, started, capsys):
    """Not in the table: `EngineConfig` fields of the same name and meaning."""
    flags = ["--enforce-eager", "--max-num-batched-tokens", "512"]
    assert cli.main(_run_argv(tmp_path, *flags, "--gpu-memory-utilization", "0.8")) == 0
    assert started == [
        {"enforce_eager": True, "max_num_batched_tokens": 512, "gpu_memory_utilization": 0.8}
    ]
    assert "vllm_flags" not in capsys.readouterr().err
    names = {name for entry in VLLM_FLAGS for name in entry.names}
    assert not names & {"--enforce-eager", "--max-num-batched-tokens", "--gpu-memory-utilization"}
