"""Prefix sharing under adversarial inputs: samples that finish in the step that completes
their prefill must not leave their siblings to prefill the prompt again one after another."""

from __future__ import annotations

import pytest

from batchgen import LLM, SamplingParams
from batchgen.engine.block_manager import KVCacheManager
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.sequence import Request, SequenceCoroutine, SequenceStatus


def _request(prompt_len: int, n: int) -> list[SequenceCoroutine]:
    req = Request("r", None, list(range(1, prompt_len + 1)), SamplingParams(n=n, max_tokens=1), 0)
    req.seqs = [SequenceCoroutine(i, req, i) for i in range(n)]
    return req.seqs


def test_finished_leader_hands_its_prompt_blocks_to_a_waiting_sibling():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    sched = Scheduler(kv, 8, 64, enable_prefix_sharing=True)
    a, b, c = _request(prompt_len=10, n=3)
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    assert [e.seq for e in out.scheduled] == [a]  # b and c wait for a's prefill
    a.num_computed_tokens += 10
    a.output_token_ids.append(7)
    blocks = list(a.block_table)
    sched.finish(a)  # a finishes with its first token (max_tokens=1)
    sched.remove_finished()
    # b takes over a's blocks for positions 0..8 (the partial block too: a no longer reads it).
    assert b.status is SequenceStatus.RUNNING and b.block_table == blocks[:3]
    assert b.num_computed_tokens == 9 and list(sched.waiting) == [c]
    out = sched.schedule()
    # b computes its last prompt token; c shares b's prompt in the same step.
    assert {e.seq.index: e.num_new_tokens for e in out.scheduled} == {1: 1, 2: 1}
    assert out.num_shared_prefix_tokens == 2 * 9
    assert c.block_table[:2] == b.block_table[:2]
    for s in (b, c):
        sched.finish(s)
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("policy", ["coalesce", "lockstep"])
def test_samples_that_stop_at_their_first_token_do_not_serialize(checkpoint_dir, policy):
    path = str(checkpoint_dir("mixtral"))
    prompt = {"prompt_token_ids": list(range(5, 28))}  # 23 tokens: 5 blocks + 3 positions
    sampled = SamplingParams(n=8, temperature=1.0, seed=5, max_tokens=1)
    results = {}
    for sharing in (False, True):
        llm = LLM(
            path,
            device="cpu",
            block_size=4,
            num_gpu_blocks_override=40,
            max_num_seqs=4,
            scheduler_policy=policy,
            enable_prefix_sharing=sharing,
            enable_prefix_caching=False,  # the baseline prefills every sample
        )
        eng = llm.llm_engine
        greedy = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
        first = greedy[0].outputs[0].token_ids[0]
        # Greedy samples all stop at their first token: the stop token.
        stopping = SamplingParams(n=6, temperature=0.0, max_tokens=8, stop_token_ids=[first])
        steps = eng.stats.num_steps
        outs = llm.generate([prompt, prompt], [sampled, stopping], use_tqdm=False)
        results[sharing] = (
            [[o.token_ids for o in out.outputs] for out in outs],
            eng.stats.num_steps - steps,
            llm.get_metrics()["prefill_tokens"],
        )
        assert eng.kv_cache.num_free_blocks == eng.kv_cache.num_blocks
    (base, base_steps, base_prefill), (shared, steps, prefill) = results[False], results[True]
    assert shared == base
    assert shared[1] == [[first]] * 6
    # 14 samples, at most 4 running: each prompt is prefilled once, its siblings take over.
    assert steps <= base_steps + 1
    assert prefill < base_prefill / 4


def test_a_sample_forked_in_this_step_is_never_a_copy_source():
    """Samples 0 and 1 were preempted while sample 2 runs. Both are admitted again in one step:
    sample 0 forks from 2, and sample 1 must copy from 2 as well, not from 0 (lower index),
    whose copied block is filled only when the step's copies run."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(kv, 8, 64, enable_prefix_sharing=True)
    seqs = _request(prompt_len=10, n=3)
    for s in seqs:
        sched.add(s)
    for _ in range(2):  # leader prefill, then the two forks
        for e in sched.schedule().scheduled:
            e.seq.num_computed_tokens += e.num_new_tokens
            e.seq.output_token_ids.append(7)
    assert all(s.status is SequenceStatus.RUNNING for s in seqs)
    for s in (seqs[1], seqs[0]):
        sched.running.remove(s)
        sched._preempt(s)
    assert list(sched.waiting) == [seqs[0], seqs[1]]
    out = sched.schedule()
    partial = seqs[2].block_table[2]
    assert out.block_copies == [
        (partial, seqs[0].block_table[2]),
        (partial, seqs[1].block_table[2]),
    ]
