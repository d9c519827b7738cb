"""Engine behaviour end to end on a tiny Mixtral: per-request failures, seeds, n, stops,
logprobs, chat, length limits."""

from __future__ import annotations

import logging
import math
import re
from types import SimpleNamespace

import pytest

from batchgen import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(checkpoint_dir):
    return LLM(
        str(checkpoint_dir("mixtral")), device="cpu", kv_cache_memory_gb=0.05, max_model_len=256
    )


def test_bad_prompts_fail_alone(llm):
    good = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = llm.generate(["hello", "", "x" * 400, [1, 99999], "world"], good, use_tqdm=False)
    assert [o.error is None for o in outs] == [True, False, False, False, True]
    assert "empty" in outs[1].error
    assert "max_model_len=256" in outs[2].error
    assert "[0, 512)" in outs[3].error
    assert len(outs[0].outputs[0].token_ids) == 5 and len(outs[4].outputs[0].token_ids) == 5
    assert not llm.llm_engine.has_unfinished_requests()


def test_failed_prompts_are_logged_by_their_index_in_the_callers_list(llm, caplog):
    llm.generate("warm up the request counter", SamplingParams(max_tokens=1), use_tqdm=False)
    sp = SamplingParams(temperature=0.0, max_tokens=2)
    with caplog.at_level(logging.WARNING, logger="batchgen.entrypoints.llm"):
        outs = llm.generate(["hello", "", "world", "x" * 400], sp, use_tqdm=False)
    assert [o.error is None for o in outs] == [True, False, True, False]
    assert [r.getMessage() for r in caplog.records] == [
        f"prompt at index 1 (of 4; request_id {outs[1].request_id!r}) failed: {outs[1].error}",
        f"prompt at index 3 (of 4; request_id {outs[3].request_id!r}) failed: {outs[3].error}",
    ]
    assert outs[1].request_id != "1"  # the engine's running number differs from the index

    caplog.clear()
    good = [{"role": "user", "content": "hi"}]
    with caplog.at_level(logging.WARNING, logger="batchgen.entrypoints.llm"):
        outs = llm.chat([good, [{"role": "user"}]], sp, use_tqdm=False)
    assert outs[0].error is None and "messages[0]" in outs[1].error
    # the chat's own error, not the empty prompt that stands in for the conversation
    assert [r.getMessage() for r in caplog.records] == [
        f"conversation at index 1 (of 2; request_id {outs[1].request_id!r}) failed: {outs[1].error}"
    ]


def test_seeded_request_is_independent_of_batch_mates(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=20, ignore_eos=True)
    alone = llm.generate("Once upon a time", seeded, use_tqdm=False)[0].outputs[0].token_ids
    mates = [
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.7, max_tokens=30, ignore_eos=True),
        seeded,
        SamplingParams(
            temperature=1.3, top_k=5, seed=7, max_tokens=3, ignore_eos=True, repetition_penalty=1.3
        ),
    ]
    outs = llm.generate(["abc", "def ghi", "Once upon a time", "zzz"], mates, use_tqdm=False)
    assert outs[2].outputs[0].token_ids == alone


def test_n_samples_differ_and_reproduce(llm):
    sp = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    first = [o.token_ids for o in llm.generate("Tell me", sp, use_tqdm=False)[0].outputs]
    second = [o.token_ids for o in llm.generate("Tell me", sp, use_tqdm=False)[0].outputs]
    assert first == second
    assert len({tuple(t) for t in first}) == 4
    out = llm.generate("Tell me", sp, use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]


def test_stop_token_ids_and_stop_strings(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ref = llm.generate("The", greedy, use_tqdm=False)[0].outputs[0]
    stop_id = ref.token_ids[3]
    first = ref.token_ids.index(stop_id)
    out = llm.generate(
        "The",
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0]
    o = out.outputs[0]
    assert o.token_ids == ref.token_ids[: first + 1]
    assert (o.finish_reason, o.stop_reason) == ("stop", stop_id)
    # A stop string taken from the reference text: the output is cut before it.
    text = ref.text
    stop = text[5:8]
    cut = text.index(stop)
    o = llm.generate(
        "The",
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert (o.text, o.finish_reason, o.stop_reason) == (text[:cut], "stop", stop)
    o = llm.generate(
        "The",
        SamplingParams(
            temperature=0.0,
            max_tokens=20,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert o.text == text[: cut + len(stop)]


def test_logprobs_include_sampled_token_and_sum(llm):
    sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True)
    o = llm.generate("Logprobs", sp, use_tqdm=False)[0].outputs[0]
    assert len(o.logprobs) == 6
    total = 0.0
    for tok, lp in zip(o.token_ids, o.logprobs):
        assert tok in lp and lp[tok].rank == 1  # greedy picks the most likely token
        assert len(lp) == 3
        assert all(math.isfinite(v.logprob) and v.logprob <= 0 for v in lp.values())
        total += lp[tok].logprob
    assert o.cumulative_logprob == pytest.approx(total, abs=1e-4)
    assert (
        llm.generate("x", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].logprobs
        is None
    )


def test_cumulative_logprob_beside_requests_without_logprobs(llm):
    # Steps whose rows ask for no logprobs skip the sampled logprobs; a request that asks
    # gets its full sum whatever it runs beside.
    sp = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
    params = [SamplingParams(**sp, logprobs=0), SamplingParams(**{**sp, "max_tokens": 2})]
    with_lp, without = llm.generate(["Mixed logprobs", "other"], params, use_tqdm=False)
    o = with_lp.outputs[0]
    total = sum(lp[tok].logprob for tok, lp in zip(o.token_ids, o.logprobs))
    assert len(o.logprobs) == 6 and o.cumulative_logprob == pytest.approx(total, abs=1e-4)
    assert without.outputs[0].cumulative_logprob is None


def test_detokenize_false_gives_the_same_tokens_without_text(llm):
    prompts = ["Detokenize", "def f(x):", "a b c"]
    sp = dict(temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=[3])
    with_text = llm.generate(prompts, SamplingParams(**sp), use_tqdm=False)
    ids_only = llm.generate(prompts, SamplingParams(**sp, detokenize=False), use_tqdm=False)
    for a, b in zip(with_text, ids_only, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].finish_reason == a.outputs[0].finish_reason
        assert a.outputs[0].text and b.outputs[0].text == ""


def test_max_model_len_ends_with_length(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("y" * 250)[:250]
    o = llm.generate(
        {"prompt_token_ids": ids},
        SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(o.token_ids) == 256 - 250 and o.finish_reason == "length"


def test_huge_max_tokens_runs_to_max_model_len_offline_and_fails_alone_on_the_openai_path(llm):
    """vLLM's offline `LLM.generate` caps prompt + completion at max_model_len (finish_reason
    "length") whatever max_tokens says; the OpenAI path refuses that request and no other."""
    params = SamplingParams(max_tokens=10**7, temperature=0.0, ignore_eos=True)
    outs = llm.generate(["hello", "world"], params, use_tqdm=False)
    for out in outs:
        assert out.error is None and out.outputs[0].finish_reason == "length"
        assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 256
    engine = llm.llm_engine
    engine.add_request("fits", "hello", SamplingParams(max_tokens=3), max_tokens_must_fit=True)
    with pytest.raises(ValueError, match="10000001 were requested") as info:
        engine.add_request("huge", [1], params, max_tokens_must_fit=True)
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "max_tokens")
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [(o.request_id, len(o.outputs[0].token_ids)) for o in done] == [("fits", 3)]


def test_chat_applies_template(llm):
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    out = llm.chat(
        conv, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )[0]
    tok = llm.get_tokenizer()
    text = tok.decode(out.prompt_token_ids)
    assert text.endswith("<|im_start|>assistant\n") and "Hi!" in text
    assert len(out.outputs[0].token_ids) == 4
    bad = llm.chat([[{"role": "user"}], conv], SamplingParams(max_tokens=2), use_tqdm=False)
    assert "messages[0]" in bad[0].error and bad[1].error is None


def test_sampling_params_list_length_mismatch(llm):
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        llm.generate(["a"], [SamplingParams(), SamplingParams()])


def test_undecodable_text_and_template_errors_fail_alone(llm, tmp_path):
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outs = llm.generate(["ok", "bad \ud800 surrogate", "fine"], sp, use_tqdm=False)
    assert [o.error is None for o in outs] == [True, False, True]
    assert "not valid Unicode" in outs[1].error
    outs = llm.chat(
        [
            [{"role": "user", "content": "x\udfff"}],
            [{"role": "user", "content": [{"type": "text", "text": "parts"}]}],
        ],
        sp,
        use_tqdm=False,
    )
    assert "not valid Unicode" in outs[0].error and outs[1].error is None
    tok = llm.get_tokenizer()
    saved = tok.chat_template
    tok.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    try:
        out = llm.chat([{"role": "user", "content": "hi"}], sp, use_tqdm=False)[0]
    finally:
        tok.chat_template = saved
    assert "chat template rejected" in out.error and "alternate" in out.error


def test_failed_generate_call_leaves_nothing_queued(llm):
    with pytest.raises(TypeError, match="sampling_params must be SamplingParams"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=2), {"max_tokens": 2}])
    assert llm.llm_engine.get_num_unfinished_requests() == 0
    engine = llm.llm_engine
    original = engine.step
    calls = []

    def failing_step():
        calls.append(1)
        raise KeyboardInterrupt

    engine.step = failing_step
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["a", "b", "c"], SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        engine.step = original
    assert calls and engine.get_num_unfinished_requests() == 0
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_token_bytes_keep_partial_utf8(llm):
    from batchgen.engine.detokenizer import token_bytes

    tok = llm.get_tokenizer()
    ids = tok.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1  # the emoji spans several byte-level tokens
    assert b"".join(token_bytes(tok, i) for i in ids) == "🚀".encode()
    assert token_bytes(tok, tok.convert_tokens_to_ids("<|im_end|>")) == b"<|im_end|>"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("kv_cache_memory_gb", float("inf"), "kv_cache_memory_gb must be a finite number > 0"),
        ("kv_cache_memory_gb", "1", "kv_cache_memory_gb must be a finite number > 0"),
        ("num_gpu_blocks_override", 2.5, "num_gpu_blocks_override must be an integer >= 1"),
        ("max_num_seqs", True, "max_num_seqs must be an integer >= 1"),
        ("block_size", 0, "block_size must be an integer >= 1"),
        ("gpu_memory_utilization", 1.5, "gpu_memory_utilization must be in (0, 1]"),
    ],
)
def test_engine_config_errors_name_the_field(field, value, message):
    from batchgen.config import EngineConfig

    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(**{field: value})


def test_max_tokens_must_fit_on_the_openai_path(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="maximum context length is 256 tokens") as info:
        engine.add_request(
            "too-big", "hello", SamplingParams(max_tokens=1000), max_tokens_must_fit=True
        )
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "max_tokens")
    assert not engine.has_unfinished_requests()
    # Offline default: runs and stops at max_model_len.
    out = llm.generate(
        "hello", SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True), use_tqdm=False
    )[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 256


def test_batch_file_errors_for_prompts_that_do_not_fit(llm, tmp_path):
    """The engine's refusals become error lines with OpenAI's codes and the field to change."""
    import json

    from batchgen.entrypoints.batch_runner import run_batch_file

    def line(custom_id, url, **body):
        return json.dumps({"custom_id": custom_id, "url": url, "body": body})

    chat = [{"role": "user", "content": "word " * 300}]
    lines = [
        line("long-prompt", "/v1/completions", prompt="word " * 300, max_tokens=2),
        line("long-chat", "/v1/chat/completions", messages=chat, max_tokens=2),
        line("big-max-tokens", "/v1/completions", prompt="hello", max_tokens=1000),
        line("ok", "/v1/completions", prompt="hello", max_tokens=2),
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    run_batch_file(llm.llm_engine, src, out, progress=False)
    results = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    errors = {
        custom_id: (r["error"]["code"], r["error"]["param"])
        for custom_id, r in results.items()
        if r["error"] is not None
    }
    assert errors == {
        "long-prompt": ("context_length_exceeded", "prompt"),
        "long-chat": ("context_length_exceeded", "messages"),
        "big-max-tokens": ("context_length_exceeded", "max_tokens"),
    }
    body = results["big-max-tokens"]["response"]["body"]["error"]
    assert (body["type"], body["code"]) == ("invalid_request_error", "context_length_exceeded")


def test_chat_without_a_chat_template_names_the_model(llm, tmp_path):
    import json

    from batchgen.entrypoints.batch_runner import run_batch_file

    tok = llm.get_tokenizer()
    saved = tok.chat_template
    tok.chat_template = None
    messages = [{"role": "user", "content": "hi"}]
    try:
        out = llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False)[0]
        src = tmp_path / "in.jsonl"
        body = {"messages": messages, "max_tokens": 2}
        src.write_text(json.dumps({"custom_id": "c", "url": "/v1/chat/completions", "body": body}))
        run_batch_file(llm.llm_engine, src, tmp_path / "out.jsonl", progress=False)
    finally:
        tok.chat_template = saved
    assert "tokenizer has no chat template" in out.error and "/v1/completions" in out.error
    error = json.loads((tmp_path / "out.jsonl").read_text())["error"]
    assert (error["code"], error["param"]) == ("invalid_request", "model")
    assert error["message"] == (
        "line 1: this model's tokenizer has no chat template, so it cannot take chat messages; "
        "send the text as a 'prompt' to /v1/completions (LLM.generate) instead, or give the "
        "engine a tokenizer that has one (--tokenizer / LLM(tokenizer=...), or a "
        "'chat_template' in the model's tokenizer_config.json)"
    )


def test_unknown_cpu_kernel_name_fails_the_engine_at_start(checkpoint_dir, monkeypatch):
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", "fused_moe,flashinfer")
    with pytest.raises(ValueError, match="unknown kernel name 'flashinfer'"):
        LLM(str(checkpoint_dir("mixtral")), device="cpu", kv_cache_memory_gb=0.05)


def test_greedy_tokens_do_not_depend_on_which_cpu_kernels_run(checkpoint_dir, monkeypatch):
    prompts = [[1, 7, 8, 9, 10], [1, 42] * 20]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for value in ("1", "0", "fused_moe", "paged_decode_attention"):
        monkeypatch.setenv("BATCHGEN_CPU_KERNELS", value)
        llm = LLM(str(checkpoint_dir("mixtral")), device="cpu", kv_cache_memory_gb=0.05)
        tokens[value] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert all(len(t) == 12 for t in tokens["1"])
    assert tokens["0"] == tokens["1"]
    assert tokens["fused_moe"] == tokens["1"]
    assert tokens["paged_decode_attention"] == tokens["1"]


def test_max_num_seqs_and_max_active_coroutines_are_one_limit():
    from batchgen.config import EngineConfig

    assert EngineConfig().max_running_seqs == 1024  # coalesce's default
    assert EngineConfig(scheduler_policy="lockstep").max_running_seqs == 256  # vLLM's
    for policy in ("coalesce", "lockstep"):
        assert EngineConfig(scheduler_policy=policy, max_num_seqs=64).max_running_seqs == 64
        cfg = EngineConfig(scheduler_policy=policy, max_active_coroutines=48)
        assert cfg.max_running_seqs == 48
    assert EngineConfig(max_num_seqs=64, max_active_coroutines=64).max_running_seqs == 64
    with pytest.raises(ValueError, match="max_num_seqs=64 and max_active_coroutines=128 name"):
        EngineConfig(max_num_seqs=64, max_active_coroutines=128)
    with pytest.raises(ValueError, match="max_active_coroutines must be an integer >= 1"):
        EngineConfig(max_active_coroutines=0)


@pytest.mark.parametrize("policy", ["coalesce", "lockstep"])
@pytest.mark.parametrize("knob", ["max_num_seqs", "max_active_coroutines"])
def test_max_num_seqs_bounds_running_sequences_under_every_policy(checkpoint_dir, policy, knob):
    llm = LLM(
        str(checkpoint_dir("mixtral")),
        device="cpu",
        kv_cache_memory_gb=0.05,
        scheduler_policy=policy,
        **{knob: 3},
    )
    engine = llm.llm_engine
    running: list[int] = []
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        running.append(len(engine.scheduler.running))
        return out

    engine.scheduler.schedule = spy
    outs = llm.generate(
        ["one two three"] * 10, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    assert max(running) == 3  # reached, never exceeded (the step held 10 before the fix)
    assert engine.config.max_running_seqs == 3


def test_chat_returns_the_rendered_prompt(llm):
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    out = llm.chat(conv, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    expected = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert out.prompt == expected  # was None
    assert out.prompt.endswith("<|im_start|>assistant\n") and "Be brief." in out.prompt
    assert tok.encode(out.prompt, add_special_tokens=False) == out.prompt_token_ids


def test_request_metrics_follow_a_request_through_the_engine(checkpoint_dir):
    import time

    llm = LLM(str(checkpoint_dir("mixtral")), device="cpu", kv_cache_memory_gb=0.05, max_num_seqs=1)
    t0 = time.time()
    outs = llm.generate(
        ["a b", "c d", "e f"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False
    )
    t1 = time.time()
    for out in outs:
        m = out.metrics
        assert t0 <= m.arrival_time <= m.first_scheduled_time <= m.first_token_time
        assert m.first_token_time <= m.last_token_time <= m.finished_time <= t1
        assert m.time_in_queue == pytest.approx(m.first_scheduled_time - m.arrival_time)
    # One sequence at a time: each request is first scheduled after the previous one ended,
    # so the later ones waited in the queue for at least the earlier ones' run time.
    for before, after in zip(outs, outs[1:]):
        assert after.metrics.first_scheduled_time >= before.metrics.finished_time
        assert after.metrics.time_in_queue >= before.metrics.finished_time - (
            before.metrics.first_scheduled_time
        )
    bad = llm.generate([[]], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert bad.error is not None and bad.metrics is None  # never entered the engine


def _force_bf16_isa(monkeypatch, isa):
    """Make the fused MoE kernel's bf16 probe (`kernel_isa`) answer ``isa`` for this test."""
    import torch

    from batchgen.kernels import fused_moe

    real = fused_moe.kernel_isa
    monkeypatch.setattr(
        fused_moe, "kernel_isa", lambda dtype: isa if dtype == torch.bfloat16 else real(dtype)
    )


def test_half_precision_on_an_avx2_cpu_is_warned_with_its_reason(
    checkpoint_dir, caplog, monkeypatch
):
    """On a CPU whose fused MoE kernel has no bf16 path (AVX2 only, forced here): half
    precision is honoured with a warning that names what is slow, and auto is float32
    whatever the checkpoint."""
    import torch
    from transformers import AutoConfig

    from batchgen.models.loader import cpu_has_fast_bf16, resolve_dtype
    from batchgen.models.model_config import ModelConfig

    _force_bf16_isa(monkeypatch, None)
    assert not cpu_has_fast_bf16()
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(checkpoint_dir("mixtral")))
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    with caplog.at_level(logging.WARNING, logger="batchgen.models.loader"):
        assert resolve_dtype("bfloat16", cpu, cfg) == torch.bfloat16  # honoured, with a word
        warned = [r.getMessage() for r in caplog.records]
        assert len(warned) == 1
        assert warned[0].startswith("dtype bfloat16 on CPU is no faster than float32 here: ")
        assert "runs bf16 only where the CPU has avx512_bf16 (vdpbf16ps) or AMX-BF16" in warned[0]
        caplog.clear()
        assert resolve_dtype("float16", cpu, cfg) == torch.float16
        assert len(caplog.records) == 1
        assert "dtype float16 on CPU" in caplog.text
        assert "no CPU kernel serves float16" in caplog.text
        caplog.clear()
        bf16 = SimpleNamespace(torch_dtype="bfloat16")
        assert resolve_dtype("auto", cpu, cfg) == torch.float32
        assert resolve_dtype("auto", cpu, bf16) == torch.float32
        assert resolve_dtype("float32", cpu, cfg) == torch.float32
        assert resolve_dtype("bfloat16", cuda, cfg) == torch.bfloat16
        assert resolve_dtype("auto", cuda, bf16) == torch.bfloat16
        assert not caplog.records


@pytest.mark.parametrize("isa", ["amx_bf16", "avx512_bf16"])
def test_auto_dtype_on_a_native_bf16_cpu_follows_a_bf16_checkpoint(isa, caplog, monkeypatch):
    """Where the fused MoE kernel runs bf16 natively (AMX-BF16 tiles, or vdpbf16ps on a CPU
    with avx512_bf16 and no AMX such as AMD Zen 4; forced here): auto is bfloat16 for a
    bfloat16 checkpoint, except in the batch-invariant mode (float32 only); float32
    checkpoints stay float32; an explicit bfloat16 is not warned about, float16 still is."""
    import torch

    from batchgen.models.loader import cpu_has_fast_bf16, resolve_dtype

    _force_bf16_isa(monkeypatch, isa)
    assert cpu_has_fast_bf16()
    cpu = torch.device("cpu")
    bf16, fp32 = SimpleNamespace(torch_dtype="bfloat16"), SimpleNamespace(torch_dtype="float32")
    with caplog.at_level(logging.WARNING, logger="batchgen.models.loader"):
        assert resolve_dtype("auto", cpu, bf16) == torch.bfloat16
        assert resolve_dtype("auto", cpu, bf16, batch_invariant=True) == torch.float32
        assert resolve_dtype("auto", cpu, fp32) == torch.float32
        assert resolve_dtype("auto", cpu, SimpleNamespace(torch_dtype="float16")) == torch.float32
        assert resolve_dtype("bfloat16", cpu, fp32) == torch.bfloat16
        assert not caplog.records
        assert resolve_dtype("float16", cpu, fp32) == torch.float16
        assert len(caplog.records) == 1 and "dtype float16 on CPU" in caplog.text


def test_min_tokens_blocks_a_stop_token_in_the_engine(llm):
    # The engine builds a row's min_tokens block list (stop ids, EOS) only while min_tokens
    # can hold: a stop token that greedy decoding picks first is blocked for min_tokens tokens.
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = llm.generate("min tokens", free, use_tqdm=False)[0].outputs[0].token_ids[0]
    stop_now = SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[first])
    out = llm.generate("min tokens", stop_now, use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == [first] and out.stop_reason == first
    held = SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[first], min_tokens=3,
                          ignore_eos=True)  # fmt: skip
    out = llm.generate("min tokens", held, use_tqdm=False)[0].outputs[0]
    assert first not in out.token_ids[:3] and len(out.token_ids) >= 3
