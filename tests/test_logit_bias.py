"""`logit_bias`: validation, the sampler step, and end to end on a tiny Mixtral (greedy, n > 1,
batch mates without a bias, per-request and per-line errors)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.engine.logits_processors import apply_logit_bias
from batchgen.engine.sampler import Sampler, SamplingRow
from batchgen.entrypoints.batch_runner import run_batch_file
from batchgen.entrypoints.openai_protocol import COMPLETIONS_URL, parse_request_body

VOCAB = 512  # the tiny checkpoints' vocabulary


@pytest.fixture(scope="module")
def llm(checkpoint_dir):
    return LLM(
        str(checkpoint_dir("mixtral")), device="cpu", kv_cache_memory_gb=0.05, max_model_len=256
    )


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 8, "ignore_eos": True, **kw})


def tokens(llm, prompt, params) -> list[int]:
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert out.error is None, out.error
    return out.outputs[0].token_ids


# ---- validation -------------------------------------------------------------------------------


def test_keys_may_be_strings_of_integers_and_are_normalised():
    sp = SamplingParams(logit_bias={"17": -100, 3: 2.5, "0": 100})
    assert sp.logit_bias == {17: -100.0, 3: 2.5, 0: 100.0}
    assert SamplingParams(logit_bias={}).logit_bias == {}
    assert SamplingParams().logit_bias is None


@pytest.mark.parametrize(
    ("bias", "words"),
    [
        ({"abc": 1}, "logit_bias keys must be token ids: integers >= 0 or strings of decimal"),
        ({"1.5": 1}, "logit_bias keys must be token ids"),
        ({" 7": 1}, "logit_bias keys must be token ids"),
        ({-1: 1}, "logit_bias keys must be token ids"),
        ({True: 1}, "logit_bias keys must be token ids"),
        ({"9" * 30: 1}, "logit_bias keys must be token ids"),
        ({5: 100.5}, "logit_bias values must be numbers in [-100, 100], got 100.5 for token 5"),
        ({5: -101}, "logit_bias values must be numbers in [-100, 100], got -101"),
        ({5: float("nan")}, "logit_bias values must be numbers in [-100, 100], got nan"),
        ({5: "1"}, "logit_bias values must be numbers in [-100, 100], got '1'"),
        ([[5, 1]], "logit_bias must be an object (dict) of token id -> bias in [-100, 100]"),
    ],
)
def test_bad_maps_name_the_field_and_the_allowed_values(bias, words):
    with pytest.raises(ValueError) as err:
        SamplingParams(logit_bias=bias)
    assert words in str(err.value), str(err.value)


def test_ids_outside_the_vocabulary_are_refused_with_the_field():
    sp = SamplingParams(logit_bias={511: 1, 512: 1, 9000: -5})
    with pytest.raises(ValueError) as err:
        sp.update_from_tokenizer(None, VOCAB)
    assert str(err.value) == (
        "logit_bias keys must be token ids in [0, 512) (the model's vocabulary), got 512, 9000"
    )
    assert (err.value.code, err.value.param) == ("invalid_request", "logit_bias")
    SamplingParams(logit_bias={511: 1}).update_from_tokenizer(None, VOCAB)  # in range: fine


def test_request_bodies_take_string_keys_and_name_the_field():
    body = {"prompt": "hi", "logit_bias": {"50": -100, "7": 3}}
    sp = parse_request_body(COMPLETIONS_URL, body).sampling_params
    assert sp.logit_bias == {50: -100.0, 7: 3.0}
    chat = {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"1": 1}}
    assert parse_request_body("/v1/chat/completions", chat).sampling_params.logit_bias == {1: 1}
    for bad, words in [
        ({"x": 1}, "logit_bias keys must be token ids"),
        ({"5": 150}, "logit_bias values must be numbers in [-100, 100], got 150"),
        ([1, 2], "'logit_bias' must be an object"),
    ]:
        with pytest.raises(ValueError) as err:
            parse_request_body(COMPLETIONS_URL, {"prompt": "hi", "logit_bias": bad})
        assert words in str(err.value) and err.value.param == "logit_bias", str(err.value)


# ---- the sampler ------------------------------------------------------------------------------


def test_apply_logit_bias_adds_per_row():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    apply_logit_bias(logits, [{0: 5.0, 2: -100.0}, None])
    assert logits.tolist() == [[6.0, 2.0, -97.0], [0.0, 0.0, 0.0]]


def test_sampler_biases_only_its_row_and_reports_raw_logprobs():
    logits = torch.tensor([[3.0, 1.0, 0.0, 2.0]] * 2)
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, logprobs=1), [0], []),
        SamplingRow(SamplingParams(temperature=0.0, logprobs=1, logit_bias={0: -100}), [0], []),
    ]
    out = Sampler()(logits, rows)
    assert out.sampled_token_ids == [0, 3]
    raw = torch.log_softmax(logits[0], dim=-1)
    # the biased row's logprobs are the raw model's: token 3 keeps its rank 2 and logprob
    assert out.sampled_logprobs[1] == pytest.approx(raw[3].item(), abs=1e-6)
    assert out.top_logprobs[1][0][0] == 0 and out.top_logprobs[1][1] == (
        3,
        pytest.approx(raw[3].item(), abs=1e-6),
        2,
    )


# ---- end to end -------------------------------------------------------------------------------


def test_minus_100_bans_and_plus_100_forces_a_token(llm):
    ref = tokens(llm, "The", greedy())
    banned = ref[0]
    out = tokens(llm, "The", greedy(logit_bias={banned: -100}))
    assert out[0] != banned and banned not in out
    forced = (ref[0] + 1) % VOCAB
    assert tokens(llm, "The", greedy(logit_bias={str(forced): 100})) == [forced] * 8


def test_an_empty_map_is_token_identical_to_no_bias(llm):
    plain = llm.generate("Once upon", greedy(logprobs=2), use_tqdm=False)[0].outputs[0]
    empty = llm.generate("Once upon", greedy(logprobs=2, logit_bias={}), use_tqdm=False)
    empty = empty[0].outputs[0]
    assert empty.token_ids == plain.token_ids
    assert empty.logprobs == plain.logprobs


def test_logprobs_stay_those_of_the_raw_model(llm):
    plain = llm.generate("Logprobs", greedy(logprobs=1), use_tqdm=False)[0].outputs[0]
    first = plain.token_ids[0]
    biased = llm.generate(
        "Logprobs", greedy(logprobs=1, max_tokens=1, logit_bias={first: -100}), use_tqdm=False
    )[0].outputs[0]
    step = biased.logprobs[0]
    assert biased.token_ids[0] != first
    # the banned token is still the raw model's most likely one, with the same logprob
    assert step[first].rank == 1
    assert step[first].logprob == pytest.approx(plain.logprobs[0][first].logprob, abs=1e-6)


def test_n_samples_and_batch_mates_without_a_bias(llm):
    mates = ["abc", "Once upon a time", "zzz"]
    alone = [tokens(llm, p, greedy()) for p in (mates[0], mates[2])]
    forced = 42
    sampled = SamplingParams(
        n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True, logit_bias={forced: 100}
    )
    outs = llm.generate(mates, [greedy(), sampled, greedy()], use_tqdm=False)
    assert [o.token_ids for o in outs[1].outputs] == [[forced] * 6] * 3
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == alone

    # n > 1 sampled at temperature 1 with a set of banned tokens: none is ever drawn
    free = SamplingParams(n=4, temperature=1.0, seed=9, max_tokens=12, ignore_eos=True)
    seen = {t for o in llm.generate("zzz", free, use_tqdm=False)[0].outputs for t in o.token_ids}
    banned = dataclasses.replace(free, logit_bias={t: -100.0 for t in seen})
    outs = llm.generate("zzz", banned, use_tqdm=False)[0].outputs
    assert len(outs) == 4 and all(not set(o.token_ids) & seen for o in outs)


def test_out_of_vocabulary_ids_fail_only_their_request(llm):
    outs = llm.generate(
        ["hello", "world"], [greedy(logit_bias={VOCAB: 1}), greedy()], use_tqdm=False
    )
    assert "logit_bias keys must be token ids in [0, 512)" in outs[0].error
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 8


def test_batch_lines_with_bad_maps_fail_alone(llm, tmp_path):
    def line(custom_id, bias):
        body = {"prompt": "The", "max_tokens": 4, "temperature": 0, "logit_bias": bias}
        return {"custom_id": custom_id, "method": "POST", "url": COMPLETIONS_URL, "body": body}

    forced = 7
    rows = [
        line("ok", {str(forced): 100}),
        line("vocab", {"600": 1}),
        line("range", {"3": -150}),
        line("key", {"x": 1}),
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = run_batch_file(llm.llm_engine, src, dst, progress=False)
    assert (summary.succeeded, summary.failed) == (1, 3)
    out = {o["custom_id"]: o for o in map(json.loads, dst.read_text().splitlines())}
    text = llm.get_tokenizer().decode([forced] * 4)
    assert out["ok"]["response"]["body"]["choices"][0]["text"] == text
    for custom_id, words in [
        ("vocab", "logit_bias keys must be token ids in [0, 512)"),
        ("range", "logit_bias values must be numbers in [-100, 100], got -150"),
        ("key", "logit_bias keys must be token ids"),
    ]:
        error = out[custom_id]["error"]
        assert error["param"] == "logit_bias" and error["code"] == "invalid_request"
        assert words in error["message"], error["message"]
