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
    ("BATCHGEN_HUGE_PAGES", "maybe", ["1/true/yes/on (on)", "0/false/no/off (off)"]),
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


def test_the_engine_chooses_moe_paths_and_norm_kernels_once(checkpoint_dir, monkeypatch):
    """The engine pins every MoE block's path and every RMSNorm's kernel answer at start: the
    steps then neither re-decide the path (`expert_path`) nor ask `rms_norm_available`, and
    the tokens are those of unpinned per-call decisions."""
    import batchgen.models.layers.moe as moe
    import batchgen.models.layers.norm as norm
    from batchgen.models.layers.moe import SparseMoeBlock
    from batchgen.models.layers.norm import RMSNorm

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = ["a b c", "hello there " * 4, "x"]
    llm = LLM(str(checkpoint_dir("mixtral")), device="cpu", dtype="float32",
              kv_cache_memory_gb=0.05)  # fmt: skip
    model = llm.llm_engine.runner.model
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert blocks and norms
    assert all(b._pinned_path is not None for b in blocks)
    assert all(n._kernel_pin is not None for n in norms)
    asked = []
    real_path, real_available = moe.expert_path, norm.rms_norm_available
    monkeypatch.setattr(moe, "expert_path", lambda *a, **k: asked.append(1) or real_path(*a, **k))
    monkeypatch.setattr(
        norm, "rms_norm_available", lambda *a: asked.append(2) or real_available(*a)
    )
    pinned = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert asked == []
    for m in blocks:
        m.unpin_expert_path()
    for m in norms:
        m.unpin_kernel()
    per_call = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert 1 in asked and 2 in asked
    assert pinned == per_call


def test_a_pin_covers_only_the_calls_it_was_made_for(monkeypatch):
    """Pinned answers serve inference calls of the pinned dtype (and size, for the norm); a
    call with another dtype, under autograd or in another batch-invariant mode decides per
    call, and a switch changed after pinning reaches the layer once it is pinned again."""
    import torch

    from batchgen.kernels.rms_norm import rms_norm_available
    from batchgen.models.layers.expert_path import MOE_PATH_ENV
    from batchgen.models.layers.moe import SparseMoeBlock
    from batchgen.models.layers.norm import RMSNorm
    from batchgen.models.model_config import RouterConfig

    cpu = torch.device("cpu")
    block, rms = SparseMoeBlock(32, 16, 6, 2, RouterConfig()), RMSNorm(32)
    x = torch.randn(5, 32)
    monkeypatch.setenv(MOE_PATH_ENV, "reference")
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", "0")
    assert block.pin_expert_path(cpu, torch.float32) == "reference"
    assert rms.pin_kernel(cpu, torch.float32) is False
    monkeypatch.setenv(MOE_PATH_ENV, "grouped_mm")
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", "1")
    with torch.no_grad():
        assert block._path(x) == "reference"  # pinned: the later switch does not reach it
        assert rms.kernel_serves(x) is False
        assert block._path(x.bfloat16()) == "grouped_mm"  # another dtype: decided now
        assert rms.kernel_serves(torch.randn(5, 32).bfloat16()) is False  # weight is float32
        block.batch_invariant = True
        assert block._path(x) != "reference"  # another mode: decided now
        block.batch_invariant = False
    assert block._path(x) == "grouped_mm"  # autograd on: decided now
    assert rms.kernel_serves(x.requires_grad_()) is False
    with torch.no_grad():
        assert rms.kernel_serves(torch.randn(5, 32)) is False  # still pinned
        assert block.pin_expert_path(cpu, torch.float32) == "grouped_mm"  # pinned again
        assert block._path(x) == "grouped_mm"
        assert rms.pin_kernel(cpu, torch.float32) == rms_norm_available(x.detach(), rms.weight)
        rms.unpin_kernel()
        monkeypatch.setenv("BATCHGEN_CPU_KERNELS", "0")
        assert rms.kernel_serves(x.detach()) is False  # unpinned: per call again
    block.unpin_expert_path()
    with pytest.raises(ValueError, match=MOE_PATH_ENV):  # a path that cannot run fails here
        block.pin_expert_path(cpu, torch.float64)  # grouped_mm takes no float64
    assert block._pinned_path is None
