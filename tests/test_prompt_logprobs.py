"""`prompt_logprobs` against the `transformers` oracle (``log_softmax`` of the teacher-forced
fp32 logits) on a tiny Mixtral: whole prefill, chunked prefill, preemption, samples that would
share the prompt's K/V, a moved request; the scheduler rule; batch output lines."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers as tf

from batchgen import LLM, SamplingParams
from batchgen.engine.block_manager import KVCacheManager
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.sequence import Request, SequenceCoroutine, SequenceStatus
from batchgen.entrypoints.batch_runner import run_batch_file
from batchgen.entrypoints.openai_protocol import COMPLETIONS_URL, parse_request_body

PROMPTS = [
    "Hello world, this is a prompt",
    [1] + list(range(30, 62)),  # 33 tokens: three blocks of 16 (one partly filled)
    [1, 77],  # two tokens: one entry after the None
]
K = 3
ATOL = 1e-4  # as the model oracle tests compare logits


@pytest.fixture(scope="module")
def path(checkpoint_dir):
    return str(checkpoint_dir("mixtral"))


@pytest.fixture(scope="module")
def oracle(path):
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:  # [P, V]: row i predicts token i + 1
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


def check(out, oracle, k: int = K) -> None:
    """Every entry of ``out.prompt_logprobs`` equals the oracle's: top-k ids and logprobs by
    rank, and the actual token's logprob and rank (rank within the tolerance's window)."""
    assert out.error is None, out.error
    ids = out.prompt_token_ids
    want = oracle(ids)
    got = out.prompt_logprobs
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        row, step = want[i - 1], got[i]
        values, top = row.topk(k)
        ranked = sorted((lp.rank, t, lp.logprob) for t, lp in step.items() if lp.rank <= k)
        assert [t for _, t, _ in ranked] == top.tolist(), i
        assert [r for r, _, _ in ranked] == list(range(1, k + 1))
        torch.testing.assert_close(
            torch.tensor([lp for _, _, lp in ranked]), values, rtol=0, atol=ATOL
        )
        actual = ids[i]
        assert actual in step and len(step) == k + (actual not in top.tolist())
        assert step[actual].logprob == pytest.approx(row[actual].item(), abs=ATOL)
        lo = int((row > row[actual] + ATOL).sum()) + 1
        hi = int((row > row[actual] - ATOL).sum()) + 1
        assert lo <= step[actual].rank <= hi


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 3, "ignore_eos": True, **kw})


@pytest.mark.parametrize(
    "kw",
    [
        dict(kv_cache_memory_gb=0.05),
        dict(kv_cache_memory_gb=0.05, max_num_batched_tokens=5),  # chunked prefill
        dict(kv_cache_memory_gb=0.05, max_num_batched_tokens=5, scheduler_policy="lockstep"),
        dict(num_gpu_blocks_override=5, max_num_batched_tokens=16),  # forces preemption
    ],
    ids=["whole", "chunked", "chunked-lockstep", "preempting"],
)
def test_prompt_logprobs_equal_the_oracle(path, oracle, kw):
    llm = LLM(path, device="cpu", block_size=16, max_model_len=128, **kw)
    params = [greedy(prompt_logprobs=K, max_tokens=20), greedy(prompt_logprobs=K, n=2), greedy()]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    check(outs[0], oracle)
    check(outs[1], oracle)
    assert outs[2].prompt_logprobs is None
    # Asking for them changes no generated token.
    plain = llm.generate(PROMPTS, [greedy(max_tokens=20), greedy(n=2), greedy()], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    if "num_gpu_blocks_override" in kw:
        assert llm.llm_engine.scheduler.num_preemptions > 0


def test_samples_that_would_share_the_prompt_and_zero_top(path, oracle):
    """n = 4 with prefix sharing: the samples after the first would take the prompt's K/V from
    it; the entries come from the sample that computed them, and sharing still happens."""
    llm = LLM(path, device="cpu", block_size=16, kv_cache_memory_gb=0.05, max_model_len=128)
    sp = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True)
    prompt = {"prompt_token_ids": PROMPTS[1]}
    base = llm.generate(prompt, sp, use_tqdm=False)[0]
    llm.llm_engine.reset_metrics()
    out = llm.generate(prompt, dataclasses.replace(sp, prompt_logprobs=0), use_tqdm=False)[0]
    check(out, oracle, k=0)
    assert all(len(step) == 1 for step in out.prompt_logprobs[1:])  # only the actual token
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in base.outputs]
    assert llm.get_metrics()["shared_prefix_tokens"] >= 3 * (len(PROMPTS[1]) - 1)


def test_no_shared_prompt_while_entries_are_missing():
    """The scheduler rule: a running sibling holds the prompt's K/V, but the request's
    entries are incomplete, so the waiting sample prefills the prompt itself."""
    params = SamplingParams(n=2, prompt_logprobs=1)
    request = Request("r", None, [1, 2, 3, 4, 5], params, 0)
    first, second = (SequenceCoroutine(i, request, i) for i in range(2))
    request.seqs = [first, second]
    kv = KVCacheManager(8, 4)
    scheduler = Scheduler(kv, 8, 64, enable_prefix_sharing=True)
    first.status, first.num_computed_tokens = SequenceStatus.RUNNING, 5
    kv.allocate_slots(first, 0)
    first.num_computed_tokens = 0
    kv.allocate_slots(first, 5)
    first.num_computed_tokens = 5
    assert request.needs_prompt_logits
    assert scheduler._prefix_source(second, set()) is None
    request.prompt_logprobs.extend([{}] * 4)  # every entry known
    assert not request.needs_prompt_logits
    assert scheduler._prefix_source(second, set()) is first


def test_a_moved_request_keeps_its_entries(path, oracle):
    """A request released mid-prompt with its K/V and resumed: the shipped positions are not
    recomputed, so their entries travel with the state."""
    llm = LLM(
        path, device="cpu", kv_cache_memory_gb=0.05, max_model_len=128, max_num_batched_tokens=8
    )
    engine = llm.llm_engine
    params = greedy(prompt_logprobs=2)
    engine.add_request("moved", {"prompt_token_ids": PROMPTS[1]}, params)
    engine.step()
    engine.step()  # 16 of 33 positions computed
    state = engine.release_request("moved", ship_kv=True)
    assert state.num_shipped_tokens == 16 and len(state.prompt_logprobs) == 17
    processed = engine.input_processor.process({"prompt_token_ids": PROMPTS[1]}, params)
    engine.add_processed_request("moved", processed, params, resume=state)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    check(outs[0], oracle, k=2)


def test_bodies_and_batch_output_lines(path, tmp_path):
    sp = parse_request_body(COMPLETIONS_URL, {"prompt": "hi", "prompt_logprobs": 2})
    assert sp.sampling_params.prompt_logprobs == 2
    with pytest.raises(ValueError) as err:
        SamplingParams(prompt_logprobs=21)
    assert str(err.value) == "prompt_logprobs must be an integer in [0, 20] or None, got 21"

    llm = LLM(path, device="cpu", kv_cache_memory_gb=0.05, max_model_len=128)
    lines = [
        {"custom_id": "c", "url": COMPLETIONS_URL, "method": "POST",
         "body": {"prompt": "Hello", "max_tokens": 2, "n": 2, "prompt_logprobs": 1}},
        {"custom_id": "chat", "url": "/v1/chat/completions", "method": "POST",
         "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                  "prompt_logprobs": 0}},
        {"custom_id": "bad", "url": COMPLETIONS_URL, "method": "POST",
         "body": {"prompt": "Hello", "prompt_logprobs": 25}},
        {"custom_id": "none", "url": COMPLETIONS_URL, "method": "POST",
         "body": {"prompt": "Hello", "max_tokens": 2}},
    ]  # fmt: skip
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in lines))
    run_batch_file(llm.llm_engine, src, dst, progress=False)
    out = {o["custom_id"]: o for o in map(json.loads, dst.read_text().splitlines())}

    ref = llm.generate("Hello", greedy(prompt_logprobs=1), use_tqdm=False)[0]
    want = [None] + [
        {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
         for t, lp in step.items()}
        for step in ref.prompt_logprobs[1:]
    ]  # fmt: skip
    choices = out["c"]["response"]["body"]["choices"]
    assert [c["prompt_logprobs"] for c in choices] == [want, want]
    chat = out["chat"]["response"]["body"]
    assert chat["prompt_logprobs"][0] is None
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(step) == 1 for step in chat["prompt_logprobs"][1:])
    assert out["bad"]["error"]["param"] == "prompt_logprobs"
    assert "prompt_logprobs must be an integer in [0, 20]" in out["bad"]["error"]["message"]
    assert "prompt_logprobs" not in out["none"]["response"]["body"]["choices"][0]


def test_prompt_logprobs_after_the_prompt_is_in_the_prefix_cache(path, oracle):
    """With prefix caching on (the default), a prompt cached by an earlier `generate` is
    computed again for a request asking for its prompt log-probabilities (a cached block has
    no logits): the entries still equal the oracle's, the request takes no cache hit, and a
    request without them does hit."""
    llm = LLM(path, kv_cache_memory_gb=0.05)
    prompt = [1] + list(range(30, 62))  # two full blocks of 16 cached, one partly filled
    llm.generate([prompt], greedy(), use_tqdm=False)
    hits = llm.get_metrics()["prefix_cache_hits"]
    (out,) = llm.generate([prompt], greedy(prompt_logprobs=K), use_tqdm=False)
    check(out, oracle)
    assert llm.get_metrics()["prefix_cache_hits"] == hits
    llm.generate([prompt], greedy(), use_tqdm=False)
    assert llm.get_metrics()["prefix_cache_hits"] > hits
