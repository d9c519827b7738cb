"""One request never fails the others: a request whose sampling or post-processing raises fails
alone, and a failed model forward fails only the requests of its step; the engine, `LLM` and
`batchgen run` carry on. On a tiny Mixtral."""

from __future__ import annotations

import json

import pytest

from batchgen import LLM, SamplingParams
from batchgen.engine.sampler import Sampler
from batchgen.entrypoints.batch_runner import run_batch_file


@pytest.fixture(scope="module")
def llm(checkpoint_dir):
    return LLM(
        str(checkpoint_dir("mixtral")), device="cpu", kv_cache_memory_gb=0.05, max_model_len=256
    )


# Innocent mates: greedy, seeded sampling (exact tokens reproducible alone), n=2 seeded.
MATES = [
    ("The capital of France", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)),
    (
        "Once upon",
        SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=8, ignore_eos=True),
    ),
    ("abc", SamplingParams(n=2, temperature=0.9, top_k=7, seed=5, max_tokens=6, ignore_eos=True)),
]


def _tokens(outs):
    return [[o.token_ids for o in out.outputs] for out in outs]


@pytest.fixture(scope="module")
def alone(llm):
    """Each mate's tokens when it runs by itself."""
    return [_tokens(llm.generate(p, sp, use_tqdm=False))[0] for p, sp in MATES]


def _unforeseen(**fields) -> SamplingParams:
    """Params with a value validation would refuse, set afterwards: what a future bug might let
    through to the engine."""
    sp = SamplingParams(temperature=0.8, max_tokens=6, seed=1, ignore_eos=True)
    for name, value in fields.items():
        setattr(sp, name, value)
    return sp


def test_a_value_the_sampler_cannot_hold_fails_its_request_alone(llm, alone):
    bad = _unforeseen(top_k=2**63)  # the adversarial batch's value, past the boundary check
    prompts = [p for p, _ in MATES] + ["bad one"]
    outs = llm.generate(prompts, [sp for _, sp in MATES] + [bad], use_tqdm=False)
    assert [o.error is None for o in outs] == [True, True, True, False]
    assert outs[3].error.startswith("the engine failed while processing this request (ValueError")
    assert outs[3].outputs == []
    assert _tokens(outs[:3]) == alone  # the same tokens as without the bad request
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.kv_cache.usage == 0.0  # its blocks were freed


def test_a_failure_after_the_draws_rewinds_seeded_generators(llm, alone, monkeypatch):
    """The batched sampler fails after every row drew its noise: the retry, request by
    request, must draw the seeded rows' noise again from the same generator state."""
    real = Sampler._make_output

    def fail_for_marked_rows(raw, sampled, rows):
        if any(row.params.logprobs == 7 for row in rows):
            raise RuntimeError("late failure")
        return real(raw, sampled, rows)

    monkeypatch.setattr(Sampler, "_make_output", staticmethod(fail_for_marked_rows))
    bad = SamplingParams(temperature=0.8, max_tokens=6, seed=1, ignore_eos=True, logprobs=7)
    outs = llm.generate(
        ["bad first"] + [p for p, _ in MATES], [bad] + [sp for _, sp in MATES], use_tqdm=False
    )
    assert outs[0].error == (
        "the engine failed while processing this request (RuntimeError: late failure)"
    )
    assert _tokens(outs[1:]) == alone


def test_a_failing_token_append_fails_its_request_alone(llm, alone):
    engine = llm.llm_engine
    for i, (prompt, sp) in enumerate(MATES):
        engine.add_request(f"mate-{i}", prompt, sp)
    engine.add_request("broken", "detokenizer breaks", SamplingParams(max_tokens=5))

    def broken(tokens):
        raise KeyError("no such token")

    engine.requests["broken"].seqs[0].detokenizer.add_tokens = broken
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step())
    assert "KeyError" in outs["broken"].error and outs["broken"].outputs == []
    assert [_tokens([outs[f"mate-{i}"]])[0] for i in range(len(MATES))] == alone


def test_a_failed_model_forward_fails_its_step_not_the_engine(llm, alone, monkeypatch):
    engine = llm.llm_engine
    real = engine.executor.execute
    calls = []

    def fail_first(scheduled):
        calls.append(len(scheduled))
        if len(calls) == 1:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(scheduled)

    monkeypatch.setattr(engine.executor, "execute", fail_first)
    engine.add_request("in-step-1", "first", SamplingParams(max_tokens=3))
    engine.add_request("in-step-2", "second", SamplingParams(max_tokens=3, n=2))
    failed = engine.step()
    assert sorted(o.request_id for o in failed) == ["in-step-1", "in-step-2"]
    assert all(
        o.error.startswith("the model forward of this request's engine step failed (RuntimeError")
        for o in failed
    )
    assert not engine.has_unfinished_requests() and engine.kv_cache.usage == 0.0
    # The engine runs on: a later request gets the tokens it gets alone.
    outs = llm.generate(MATES[0][0], MATES[0][1], use_tqdm=False)
    assert outs[0].error is None and _tokens(outs)[0] == alone[0]


def test_batchgen_run_writes_one_error_line_and_runs_the_rest(llm, tmp_path):
    lines = []
    for i in range(6):
        body = {"prompt": f"line {i}", "max_tokens": 4, "temperature": 0.7 if i == 3 else 0.0}
        lines.append({"custom_id": f"r{i}", "url": "/v1/completions", "body": body})
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    engine = llm.llm_engine
    real_add = engine.add_request

    def add_with_bad_line_3(request_id, prompt, params, **kwargs):
        if prompt == "line 3":  # a value that slipped past validation
            params.top_k = 2**63
        return real_add(request_id, prompt, params, **kwargs)

    engine.add_request = add_with_bad_line_3
    try:
        summary = run_batch_file(engine, src, tmp_path / "out.jsonl", progress=False)
    finally:
        del engine.add_request
    results = {r["custom_id"]: r for r in map(json.loads, open(tmp_path / "out.jsonl"))}
    assert (summary.succeeded, summary.failed) == (5, 1)
    error = results["r3"]["error"]
    assert error["code"] == "request_failed" and error["line"] == 4
    assert error["message"].startswith("line 4: the engine failed while processing this request")
    assert all(results[f"r{i}"]["error"] is None for i in (0, 1, 2, 4, 5))
