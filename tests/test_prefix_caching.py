"""Automatic prefix caching across requests (`batchgen.engine.prefix_cache`): the block
bookkeeping alone (pure Python), then whole engines whose outputs with caching on must be
token-identical to caching off (shared documents, multi-turn continuations, n > 1, memory
pressure with evictions, preemption and chunked prefill; Mixtral, DeepSeek MLA, sliding window),
with exact counts of the prompt tokens computed, and the reset after a weight update."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from batchgen import LLM, SamplingParams
from batchgen.engine.block_manager import KVCacheManager
from batchgen.engine.prefix_cache import block_hashes, hash_block
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.sequence import Request, SequenceCoroutine, SequenceStatus

BS = 4  # block size of the pure-Python tests


def make_seq(tokens: list[int], seq_id: int = 0, params=None) -> SequenceCoroutine:
    params = params or SamplingParams(max_tokens=100)
    req = Request(f"r{seq_id}", None, list(tokens), params, seq_id)
    seq = SequenceCoroutine(seq_id, req, 0)
    req.seqs.append(seq)
    return seq


def compute(kv: KVCacheManager, seq: SequenceCoroutine) -> None:
    """Allocate and 'compute' the whole of ``seq`` as the engine would, registering blocks."""
    start = seq.num_computed_tokens
    assert kv.allocate_slots(seq, seq.num_tokens - start)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq, start)


def run_step(sched: Scheduler) -> None:
    """One step as the engine runs it: advance, register full blocks, sample a token."""
    out = sched.schedule()
    for e in out.scheduled:
        samples = e.samples_next_token
        start = e.seq.num_computed_tokens
        e.seq.num_computed_tokens += e.num_new_tokens
        sched.kv_cache.cache_full_blocks(e.seq, start)
        if samples:
            e.seq.output_token_ids.append(7)


# ---- the block bookkeeping ---------------------------------------------------------------


def test_hash_chain_names_the_whole_prefix():
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = make_seq([9, 2, 3, 4, 5, 6, 7, 8, 9])  # differs in block 0 only
    ha, hb = block_hashes(a, 2, BS), block_hashes(b, 2, BS)
    assert ha[0] != hb[0] and ha[1] != hb[1]  # block 1's tokens are equal, its chain is not
    assert ha[1] == hash_block(ha[0], [5, 6, 7, 8])
    assert a.block_hashes == ha  # memoized
    with pytest.raises(ValueError, match="full blocks"):
        block_hashes(a, 3, BS)


def test_hit_takes_full_blocks_and_leaves_the_last_token():
    kv = KVCacheManager(16, BS, enable_caching=True)
    first = make_seq(list(range(1, 11)))  # 10 tokens: 2 full blocks
    compute(kv, first)
    table = first.block_table
    kv.free(first)
    assert kv.num_free_blocks == 16 and kv.prefix_cache.num_evictable == 2
    same = make_seq(list(range(1, 11)), 1)
    blocks, missing = kv.find_cached_prefix(same)
    assert blocks == table[:2] and missing == []
    kv.take_cached_prefix(same, blocks)
    assert same.num_computed_tokens == 8 and kv.num_free_blocks == 14
    assert kv.prefix_cache.num_evictable == 0
    # A prompt of exactly 2 blocks that are both cached recomputes its last block.
    exact = make_seq(list(range(1, 9)), 2)
    blocks, missing = kv.find_cached_prefix(exact)
    assert len(blocks) == 1 and len(missing) == 0
    # A diverging prompt takes only the common full blocks.
    other = make_seq([1, 2, 3, 4, 0, 0, 0, 0, 0, 0], 3)
    blocks, missing = kv.find_cached_prefix(other)
    assert blocks == table[:1] and len(missing) == 1


def test_eviction_is_least_recently_freed_and_tail_first():
    kv = KVCacheManager(4, BS, enable_caching=True)
    a = make_seq(list(range(1, 10)))  # 9 tokens: 3 blocks, 2 full
    compute(kv, a)
    table = a.block_table
    kv.free(a)
    b = make_seq(list(range(50, 54)) + [0], 1)  # 1 full block
    compute(kv, b)
    kv.free(b)
    cache = kv.prefix_cache
    assert cache.num_cached_blocks == 3 and kv.num_free_blocks == 4
    # One plain free block is left (a's partial one), then a's tail, a's head, then b's block.
    got = kv.allocator.allocate(2)
    assert got == [table[2], table[1]] and cache.stats.evictions == 1
    again = make_seq(list(range(1, 10)), 2)
    blocks, _ = kv.find_cached_prefix(again)
    assert blocks == table[:1]  # block 1 was evicted: the chain stops there
    kv.allocator.free(got)


def test_shared_blocks_stay_counted_and_go_back_to_the_pool():
    kv = KVCacheManager(8, BS, enable_caching=True)
    a = make_seq(list(range(1, 10)))
    compute(kv, a)
    b = make_seq(list(range(1, 10)), 1)
    blocks, _ = kv.find_cached_prefix(b)
    kv.take_cached_prefix(b, blocks)
    assert [kv.allocator.ref_count(x) for x in blocks] == [2, 2]
    kv.free(a)
    assert kv.prefix_cache.num_evictable == 0  # b still holds them
    kv.free(b)
    assert kv.prefix_cache.num_evictable == 2 and kv.num_free_blocks == 8


def test_reset_drops_every_hash_only_when_nothing_is_held():
    kv = KVCacheManager(8, BS, enable_caching=True)
    a = make_seq(list(range(1, 10)))
    compute(kv, a)
    assert not kv.reset_prefix_cache()
    assert kv.prefix_cache.num_cached_blocks == 2
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.prefix_cache.num_cached_blocks == 0 and kv.num_free_blocks == 8
    assert kv.find_cached_prefix(make_seq(list(range(1, 10)), 1))[0] == []


def test_hand_over_forgets_a_cached_block_the_heir_overwrites():
    kv = KVCacheManager(8, BS, enable_caching=True)
    seq = make_seq(list(range(1, 7)))  # 6 prompt tokens
    seq.output_token_ids += [9, 9]  # 8 tokens: block 1 = prompt 5, 6 + outputs: full
    compute(kv, seq)
    assert kv.prefix_cache.num_cached_blocks == 2
    heir = make_seq(list(range(1, 7)), 1)
    assert kv.hand_over(seq, heir, 5)  # heir writes its own tokens after position 5
    assert not kv.prefix_cache.is_cached(heir.block_table[1])
    assert kv.prefix_cache.is_cached(heir.block_table[0])


def test_scheduler_followers_wait_for_a_running_prefill_then_hit():
    kv = KVCacheManager(64, BS, enable_caching=True)
    sched = Scheduler(kv, 8, 64)
    doc = list(range(1, 17))  # 4 blocks
    seqs = [make_seq(doc + [100 + i], i) for i in range(3)]
    loner = make_seq(list(range(200, 210)), 3)
    for s in seqs + [loner]:
        sched.add(s)
    out = sched.schedule()
    assert [e.seq for e in out.scheduled] == [seqs[0], loner]  # followers wait
    assert list(sched.waiting) == seqs[1:]
    for e in out.scheduled:
        start = e.seq.num_computed_tokens
        e.seq.num_computed_tokens += e.num_new_tokens
        kv.cache_full_blocks(e.seq, start)
        e.seq.output_token_ids.append(7)
    out = sched.schedule()
    admitted = {e.seq.seq_id: e.num_new_tokens for e in out.scheduled}
    assert admitted == {0: 1, 3: 1, 1: 1, 2: 1}  # the document came from the cache
    assert kv.prefix_cache.stats.hits == 2 * 16
    assert kv.prefix_cache.stats.queries == 17 + 10 + 2 * 17


def test_a_short_shared_prefix_is_not_worth_waiting_for():
    """A waiting prompt sharing only its first block (a system prompt) with a running prefill
    is admitted at once: it would wait to save less than half its work."""
    kv = KVCacheManager(64, BS, enable_caching=True)
    sched = Scheduler(kv, 8, 64)
    system = [1, 2, 3, 4]
    a = make_seq(system + list(range(10, 22)))  # 4 blocks
    b = make_seq(system + list(range(30, 42)), 1)  # same first block only
    c = make_seq(system + list(range(10, 18)) + [99, 98, 97, 96], 2)  # 3 of a's 4 blocks
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    assert [e.seq for e in out.scheduled] == [a, b]  # c waits for a's blocks, b does not
    assert list(sched.waiting) == [c]


def test_prompt_logprobs_requests_take_no_hit():
    kv = KVCacheManager(64, BS, enable_caching=True)
    sched = Scheduler(kv, 8, 64)
    first = make_seq(list(range(1, 18)))
    sched.add(first)
    run_step(sched)
    params = SimpleNamespace(n=1, prompt_logprobs=0)  # another branch adds the field
    wants = make_seq(list(range(1, 18)), 1, params=params)
    plain = make_seq(list(range(1, 18)), 2)
    sched.add(wants)
    sched.add(plain)
    out = sched.schedule()
    new = {e.seq.seq_id: e.num_new_tokens for e in out.scheduled}
    assert new[1] == 17 and new[2] == 1


def test_preempted_sequence_hits_its_own_freed_blocks():
    kv = KVCacheManager(8, BS, enable_caching=True)
    sched = Scheduler(kv, 8, 64)
    a, b = make_seq(list(range(1, 10))), make_seq(list(range(20, 29)), 1)
    sched.add(a)
    sched.add(b)
    while not b.num_preemptions:  # both grow until the younger one is preempted
        run_step(sched)
    assert b.status is SequenceStatus.WAITING and not b.block_table
    own = b.block_hashes[:2]
    sched.finish(a)  # room again: b comes back and finds its own first blocks
    sched.remove_finished()
    hits = kv.prefix_cache.stats.hits
    run_step(sched)
    assert b.status is SequenceStatus.RUNNING
    assert kv.prefix_cache.stats.hits - hits >= 2 * BS
    assert [kv.prefix_cache.lookup(h) for h in own] == b.block_table[:2]


# ---- engines: caching on == caching off --------------------------------------------------

DOCS = [list(range(2, 130)), list(range(140, 268))]  # 128 tokens = 8 blocks of 16 each
QUESTIONS = [[300 + 7 * q + j for j in range(5)] for q in range(8)]


def _prompts(num_questions: int) -> list[list[int]]:
    return [d + q for d in DOCS for q in QUESTIONS[:num_questions]]


def _workload(llm: LLM) -> list:
    """Shared documents (greedy, then seeded with n=2), then a second turn over each first
    turn (prompt + its output + a new question)."""
    prompts = _prompts(4)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    seeded = [
        SamplingParams(temperature=1.0, seed=50 + i, n=2, max_tokens=6, ignore_eos=True)
        for i in range(len(prompts))
    ]
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    sampled = llm.generate([{"prompt_token_ids": p} for p in prompts], seeded, use_tqdm=False)
    turn2 = [
        p + list(o.outputs[0].token_ids) + [400 + i]
        for i, (p, o) in enumerate(zip(prompts, first))
    ]
    second = llm.generate([{"prompt_token_ids": p} for p in turn2], seeded, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in [*first, *sampled, *second]]


def _run(path, caching: bool, **kw) -> tuple[list, LLM]:
    llm = LLM(str(path), device="cpu", block_size=16, enable_prefix_caching=caching, **kw)
    return _workload(llm), llm


SETTINGS = {
    "roomy": dict(kv_cache_memory_gb=0.05),
    # 20 blocks hold two 150-token sequences: preemption, eviction, 32-token prefill chunks.
    "pressure": dict(num_gpu_blocks_override=20, max_num_batched_tokens=32),
    # The n samples of a request find their prompt through the cache alone.
    "no_sharing": dict(kv_cache_memory_gb=0.05, enable_prefix_sharing=False),
}


@pytest.mark.parametrize(
    "model,setting,policy",
    [
        ("mixtral", "roomy", "coalesce"),
        ("mixtral", "pressure", "coalesce"),
        ("mixtral", "pressure", "lockstep"),
        ("mixtral", "no_sharing", "coalesce"),
        ("deepseek_v3", "roomy", "coalesce"),
        ("deepseek_v3", "pressure", "lockstep"),
        ("mistral_sliding", "pressure", "coalesce"),
    ],
)
def test_outputs_with_caching_equal_without(checkpoint_dir, model, setting, policy):
    path = checkpoint_dir(model)
    kw = dict(SETTINGS[setting], scheduler_policy=policy)
    base, base_llm = _run(path, False, **kw)
    cached, llm = _run(path, True, **kw)
    assert cached == base
    m, base_m = llm.get_metrics(), base_llm.get_metrics()
    assert base_m["prefix_cache_hits"] == 0 and not base_m["prefix_cache_enabled"]
    assert m["prefix_cache_hits"] > 0
    assert m["prefill_tokens"] < base_m["prefill_tokens"]
    assert 0 < m["prefix_cache_hit_rate"] < 1
    engine = llm.llm_engine
    if setting == "pressure":
        assert engine.scheduler.num_preemptions > 0
        assert m["prefix_cache_evictions"] > 0
    kv = engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks  # cached blocks count as free


def test_shared_documents_compute_each_document_once(checkpoint_dir):
    """16 questions over 2 documents of 8 blocks: the first question of each document
    computes it, the 14 others wait for it and take it from the cache; a second identical
    `generate` recomputes only each prompt's last block."""
    llm = LLM(str(checkpoint_dir("mixtral")), device="cpu", block_size=16, kv_cache_memory_gb=0.05)
    prompts = [{"prompt_token_ids": p} for p in _prompts(8)]  # 16 prompts of 133 tokens
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine = llm.llm_engine
    first = llm.generate(prompts, params, use_tqdm=False)
    assert engine.stats.num_prompt_tokens == 2 * 133 + 14 * 5
    m = llm.get_metrics()
    assert m["prefix_cache_queries"] == 16 * 133
    assert m["prefix_cache_hits"] == 14 * 128
    again = llm.generate(prompts, params, use_tqdm=False)
    # 133 tokens: 8 full blocks cached, the 5 question tokens (partial block 8) computed.
    assert engine.stats.num_prompt_tokens == 2 * 133 + 14 * 5 + 16 * 5
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    assert llm.get_metrics()["prefix_cache_hits"] == 14 * 128 + 16 * 128


def test_reset_after_update_weights_leaves_no_hit(checkpoint_dir, tmp_path, monkeypatch):
    """After `update_weights`, prompts cached under the old weights are computed again (hits
    0) and generate what a fresh engine on the new weights does; without the reset they
    would hit the stale blocks and generate something else."""
    from batchgen.models.make_model import make_model
    from tests.conftest import CHECKPOINTS

    arch, overrides = CHECKPOINTS["mixtral"]
    b = make_model(arch, tmp_path / "mixtral_b", seed=4321, **overrides)
    prompts = [{"prompt_token_ids": p} for p in _prompts(2)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def tokens(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    kw = dict(device="cpu", block_size=16, kv_cache_memory_gb=0.05)
    fresh_b = tokens(LLM(str(b), **kw))
    llm = LLM(str(checkpoint_dir("mixtral")), **kw)
    tokens(llm)
    kv = llm.llm_engine.kv_cache
    assert kv.prefix_cache.num_cached_blocks > 0
    llm.update_weights(b)
    assert kv.prefix_cache.num_cached_blocks == 0
    llm.llm_engine.reset_metrics()
    assert tokens(llm) == fresh_b
    assert llm.get_metrics()["prefix_cache_hits"] == 2 * 128  # only the new K/V, as fresh_b

    stale = LLM(str(checkpoint_dir("mixtral")), **kw)  # the same without the reset
    tokens(stale)
    monkeypatch.setattr(stale.llm_engine.kv_cache, "reset_prefix_cache", lambda: True)
    stale.update_weights(b)
    stale.llm_engine.reset_metrics()
    assert tokens(stale) != fresh_b
    assert stale.get_metrics()["prefix_cache_hits"] == 4 * 128


def test_running_sequences_are_marked_running():
    """A follower admitted with a hit is RUNNING and holds the shared blocks by reference."""
    kv = KVCacheManager(64, BS, enable_caching=True)
    sched = Scheduler(kv, 8, 64)
    a = make_seq(list(range(1, 18)))
    sched.add(a)
    run_step(sched)
    b = make_seq(list(range(1, 18)), 1)
    sched.add(b)
    run_step(sched)
    assert b.status is SequenceStatus.RUNNING
    assert b.block_table[:4] == a.block_table[:4]
    assert all(kv.allocator.ref_count(x) == 2 for x in a.block_table[:4])


def test_shipped_kv_composes_with_the_cache(checkpoint_dir):
    """A request moved with its K/V (straggler rebalancing) to an engine that has its prompt
    cached: the shipped K/V goes into fresh blocks, the output is the unmoved one, and the
    receiver's cache still serves the prompt correctly afterwards."""
    path = str(checkpoint_dir("mixtral"))
    kw = dict(device="cpu", block_size=16, kv_cache_memory_gb=0.05)
    prompt = {"prompt_token_ids": DOCS[0] + QUESTIONS[0]}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = LLM(path, enable_prefix_caching=False, **kw).generate(prompt, params, use_tqdm=False)
    want = want[0].outputs[0].token_ids
    a, b = LLM(path, **kw), LLM(path, **kw)
    assert b.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == want
    src = a.llm_engine
    src.add_request("r", prompt, params)
    for _ in range(3):  # the prefill and two decodes
        assert not src.step()
    state = src.release_request("r", ship_kv=True)
    assert state.num_shipped_tokens == 133 + 2
    dst = b.llm_engine
    hits = dst.get_metrics()["prefix_cache_hits"]
    processed = dst.input_processor.process(prompt, params)
    dst.add_processed_request("r", processed, params, resume=state)
    done = []
    while dst.has_unfinished_requests():
        done += dst.step()
    assert done[0].outputs[0].token_ids == want
    assert dst.get_metrics()["kv_imported_tokens"] == 135
    assert dst.get_metrics()["prefix_cache_hits"] == hits  # shipped K/V takes no hit
    again = b.generate(prompt, params, use_tqdm=False)
    assert again[0].outputs[0].token_ids == want
    assert dst.get_metrics()["prefix_cache_hits"] == hits + 128
    assert dst.kv_cache.num_free_blocks == dst.kv_cache.num_blocks
