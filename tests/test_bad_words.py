"""vLLM's `bad_words`: how words become token-id forms, the ban itself, and greedy generation
on a tiny Mixtral whose byte-level BPE tokenizer has ``" block"`` = 410 and ``"block"`` = 326.
The tiny model's greedy continuation of ``"def fib(n):"`` is ``" block"`` sixteen times."""

from __future__ import annotations

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.engine.logits_processors import apply_bad_words
from batchgen.entrypoints.openai_protocol import COMPLETIONS_URL, parse_request_body

PROMPT = "def fib(n):"
BLOCK, SPACE_BLOCK = 326, 410  # "block", " block"


@pytest.fixture(scope="module")
def llm(checkpoint_dir):
    return LLM(
        str(checkpoint_dir("mixtral")), device="cpu", kv_cache_memory_gb=0.05, max_model_len=256
    )


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 16, "ignore_eos": True, **kw})


def contains(tokens: list[int], form: list[int]) -> bool:
    return any(tokens[i : i + len(form)] == form for i in range(len(tokens) - len(form) + 1))


def test_words_become_vllm_forms(llm):
    tok = llm.get_tokenizer()
    sp = SamplingParams(bad_words=["block", "  block block", "runs"])
    sp.update_from_tokenizer(tok, 512)
    runs = tok.encode("runs", add_special_tokens=False)
    assert len(runs) == 3 and len(tok.encode(" runs", add_special_tokens=False)) == 1
    assert sp.bad_words_token_ids == [
        [BLOCK],
        [SPACE_BLOCK],  # with a space: another first token, as many tokens -> kept
        [BLOCK, SPACE_BLOCK],
        [SPACE_BLOCK, SPACE_BLOCK],
        runs,  # " runs" is one token where "runs" is three: not kept (vLLM's rule)
    ]
    assert SamplingParams().bad_words == [] and SamplingParams().bad_words_token_ids == []
    with pytest.raises(RuntimeError, match="update_from_tokenizer"):
        _ = SamplingParams(bad_words=["x"]).bad_words_token_ids


@pytest.mark.parametrize(
    ("words", "message"),
    [
        ("block", "bad_words must be a list of strings or None, got 'block'"),
        (["ok", 3], "bad_words must be a list of strings or None"),
        (["ok", "  "], "bad_words entries must contain a non-space character"),
    ],
)
def test_bad_values_name_the_field(words, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        SamplingParams(bad_words=words)


def test_apply_bad_words_bans_last_tokens_after_matching_prefixes():
    logits = torch.zeros(3, 10)
    forms = [[[7], [3, 4]], [[7], [3, 4]], []]
    apply_bad_words(logits, forms, [[9, 3], [9], [3]])
    banned = [torch.isinf(row).nonzero().flatten().tolist() for row in logits]
    assert banned == [[4, 7], [7], []]


def test_request_bodies_take_bad_words():
    body = {"prompt": "hi", "bad_words": ["foo", " bar"]}
    assert parse_request_body(COMPLETIONS_URL, body).sampling_params.bad_words == ["foo", " bar"]
    with pytest.raises(ValueError) as err:
        parse_request_body(COMPLETIONS_URL, {"prompt": "hi", "bad_words": "foo"})
    assert err.value.param == "bad_words" and "'bad_words' must be a list of strings" in str(
        err.value
    )


def test_a_banned_word_never_appears_where_greedy_would_write_it(llm):
    ref = llm.generate(PROMPT, greedy(), use_tqdm=False)[0].outputs[0]
    assert ref.token_ids == [SPACE_BLOCK] * 16 and "block" in ref.text
    outs = llm.generate(
        [PROMPT, PROMPT], [greedy(bad_words=["block"]), greedy()], use_tqdm=False
    )
    banned = outs[0].outputs[0]
    assert not {BLOCK, SPACE_BLOCK} & set(banned.token_ids)
    assert "block" not in banned.text and len(banned.token_ids) == 16
    assert outs[1].outputs[0].token_ids == ref.token_ids  # the batch mate is unaffected


def test_a_two_token_word_bans_only_its_completion(llm):
    out = llm.generate(PROMPT, greedy(bad_words=["block block"]), use_tqdm=False)[0]
    tokens = out.outputs[0].token_ids
    assert tokens[0] == SPACE_BLOCK  # one " block" is fine: only the second one is banned
    assert tokens[1] != SPACE_BLOCK
    assert not contains(tokens, [SPACE_BLOCK, SPACE_BLOCK]) and not contains(
        tokens, [BLOCK, SPACE_BLOCK]
    )
    assert out.outputs[0].text.count("block block") == 0


def test_n_samples_each_avoid_the_word(llm):
    sp = SamplingParams(
        n=3, temperature=0.2, seed=1, max_tokens=12, ignore_eos=True, bad_words=["block"]
    )
    free = SamplingParams(n=3, temperature=0.2, seed=1, max_tokens=12, ignore_eos=True)
    before = llm.generate(PROMPT, free, use_tqdm=False)[0].outputs
    assert any(SPACE_BLOCK in o.token_ids for o in before)  # sampling would write it
    after = llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs
    assert all(not {BLOCK, SPACE_BLOCK} & set(o.token_ids) for o in after)
