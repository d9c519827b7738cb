"""The kernel and path switches (BATCHGEN_*) are read strictly, and all of them at engine start:
a bad value stops the engine with an error naming the variable and the allowed values, instead
of failing every request of the first step (BATCHGEN_MOE_PATH, BATCHGEN_PAGED_ATTENTION_ISA in
bf16) or being taken for "on" (the on/off switches)."""

from __future__ import annotations

import json

import pytest

from batchgen import LLM, SamplingParams
from batchgen.entrypoints import cli
from batchgen.kernels.switches import env_flag

# (variable, bad value, words the error must contain: the variable, the value, allowed values)
BAD_SWITCHES = [
    ("BATCHGEN_CPU_KERNELS", "fused_mo", ["fused_moe", "paged_decode_attention", "0/off"]),
    ("BATCHGEN_CPU_AMX", "maybe", ["1/true/yes/on (on)", "0/false/no/off (off)"]),
    ("BATCHGEN_PACKED_LINEAR", "maybe", ["1/true/yes/on (on)", "0/false/no/off (off)"]),
    ("BATCHGEN_ONEDNN_LINEAR", "2", ["1/true/yes/on (on)", "0/false/no/off (off)"]),
    ("BATCHGEN_PAGED_ATTENTION_ISA", "avx9", ["'amx'", "'avx512f'", "'auto'"]),
    ("BATCHGEN_MOE_PATH", "fast", ["'auto'", "'grouped_mm'", "'reference'", "'triton'"]),
    ("BATCHGEN_ATTENTION_BACKEND", "flash", ["'cpu_kernel'", "'torch'", "'triton'"]),
    ("BATCHGEN_PREFILL_ATTENTION", "flash", ["'auto'", "'kernel'", "'sdpa'"]),
]


@pytest.mark.parametrize(
    ("value", "expected"),
    [("", True), ("1", True), (" ON ", True), ("yes", True), ("0", False), ("Off", False),
     ("false", False), ("no", False)],
)
def test_env_flag_reads_on_and_off_words(monkeypatch, value, expected):
    monkeypatch.setenv("BATCHGEN_TEST_FLAG", value)
    assert env_flag("BATCHGEN_TEST_FLAG") is expected
    monkeypatch.delenv("BATCHGEN_TEST_FLAG")
    assert env_flag("BATCHGEN_TEST_FLAG", default=False) is False


@pytest.mark.parametrize(("name", "value", "words"), BAD_SWITCHES)
def test_a_bad_switch_fails_the_engine_at_start(checkpoint_dir, monkeypatch, name, value, words):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as err:
        LLM(str(checkpoint_dir("mixtral")), device="cpu", dtype="float32", kv_cache_memory_gb=0.05)
    message = str(err.value)
    assert message.startswith(f"{name}={value!r}")
    for word in words:
        assert word in message, (word, message)


def test_cli_run_exits_2_on_a_bad_moe_path_before_any_request(
    checkpoint_dir, tmp_path, monkeypatch, capsys
):
    """Before: every request of the first step failed with the ValueError (exit 0)."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    body = {"prompt": "hi", "max_tokens": 2}
    src.write_text(json.dumps({"custom_id": "a", "url": "/v1/completions", "body": body}) + "\n")
    monkeypatch.setenv("BATCHGEN_MOE_PATH", "fast")
    argv = ["run", "-i", str(src), "-o", str(out), "--model", str(checkpoint_dir("mixtral"))]
    assert cli.main([*argv, "--no-progress", "--kv-cache-memory-gb", "0.05"]) == 2
    err = capsys.readouterr().err
    assert "batchgen run: error: cannot start the engine: BATCHGEN_MOE_PATH='fast'" in err
    assert not out.exists() or out.read_text() == ""


def test_good_switch_values_still_run(checkpoint_dir, monkeypatch):
    for name, value in [
        ("BATCHGEN_CPU_AMX", "0"),
        ("BATCHGEN_PACKED_LINEAR", "off"),
        ("BATCHGEN_PAGED_ATTENTION_ISA", "AVX512F"),
        ("BATCHGEN_MOE_PATH", "reference"),
        ("BATCHGEN_ATTENTION_BACKEND", "torch"),
    ]:
        monkeypatch.setenv(name, value)
    model = str(checkpoint_dir("mixtral"))
    llm = LLM(model, device="cpu", dtype="float32", kv_cache_memory_gb=0.05)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = llm.generate([[1, 7, 8, 9]], sp, use_tqdm=False)[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 4


def test_a_forced_moe_path_that_cannot_run_fails_the_engine_at_start(checkpoint_dir, monkeypatch):
    """Triton on CPU without TRITON_INTERPRET: before, every request of the first step failed."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("BATCHGEN_MOE_PATH", "triton")
    model = str(checkpoint_dir("mixtral"))
    with pytest.raises(ValueError, match="BATCHGEN_MOE_PATH=triton: device cpu: Triton kernels"):
        LLM(model, device="cpu", dtype="float32", kv_cache_memory_gb=0.05)
