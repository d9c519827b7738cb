"""Batch invariance: a greedy or seeded request gets the same tokens (and the same
log-probabilities, bit for bit) whatever it is batched with and in whatever order the batch
arrives (`EngineConfig.batch_invariant`, docs/batch-invariance.md).

The end-to-end check is the issue's: 16 requests (12 seeded at temperature 1.0, 4 greedy; plus
one seeded ``n=2`` request), each run alone, then mixed in shuffled order into 200 other
requests of other lengths and settings.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from batchgen import LLM, SamplingParams
from batchgen.config import EngineConfig
from batchgen.engine.block_manager import KVCacheManager
from batchgen.engine.scheduler import Scheduler
from batchgen.kernels import invariant_linear as il
from batchgen.models.batch_invariant import (
    BatchInvariantLinear,
    check_batch_invariant_support,
    enable_batch_invariant,
    invariant_silu,
)
from batchgen.models.make_model import make_model
from tests.conftest import CHECKPOINTS
from tests.test_scheduler import make_seqs

VOCAB = 512  # the tiny checkpoints' vocabulary


# ---- the ops ----------------------------------------------------------------------------------


@pytest.mark.parametrize("k, n", [(64, 4), (64, 192), (96, 100), (512, 48)])
@pytest.mark.parametrize("kernels", ["1", "0"])  # the AVX2 kernel, the per-row fallback
def test_invariant_linear_row_does_not_depend_on_its_call(monkeypatch, k, n, kernels):
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", kernels)
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(n, k, generator=gen), torch.randn(300, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    packed = il.pack_linear_weight(w)
    alone = il.invariant_linear(x[:1], w, bias, packed)  # [1, N]
    threads = torch.get_num_threads()
    try:
        for num_threads in {1, threads}:
            torch.set_num_threads(num_threads)
            for m in (2, 5, 6, 7, 97, 300):
                assert torch.equal(il.invariant_linear(x[:m], w, bias, packed)[:1], alone)
                last = torch.cat([x[1:m], x[:1]])  # the row at the end of the call
                assert torch.equal(il.invariant_linear(last, w, bias, packed)[-1:], alone)
    finally:
        torch.set_num_threads(threads)
    # float32 rounding of sums over K of products ~ 1: atol scaled by sqrt(K)
    expected = F.linear(x, w, bias)
    torch.testing.assert_close(il.invariant_linear(x, w, bias), expected, rtol=1e-5, atol=5e-6 * k)
    assert il.invariant_linear(x[:0], w).shape == (0, n)
    assert il.invariant_linear(x[:6].view(2, 3, k), w).shape == (2, 3, n)


def test_invariant_linear_module_repacks_when_its_weight_changes():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 20), torch.nn.Linear(20, 4, bias=False))
    assert enable_batch_invariant(model) == 2
    layer = model[0]
    assert isinstance(layer, BatchInvariantLinear)
    x = torch.randn(5, 32)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    with torch.no_grad():
        layer.weight.mul_(2)  # autograd-visible: the version counter moves
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    layer.weight.data.mul_(2)  # invisible to the version counter: needs the invalidation
    layer.invalidate_packed_weights()
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


def test_invariant_silu_does_not_depend_on_the_tensor_size():
    g = torch.randn(1001, 192, generator=torch.Generator().manual_seed(0)) * 4
    gate = g.chunk(2, dim=-1)[0]  # [1001, 96], a strided view as in the MLP
    whole = invariant_silu(gate)
    for rows in (slice(0, 1), slice(500, 501), slice(1000, 1001), slice(3, 10)):
        assert torch.equal(invariant_silu(gate[rows]), whole[rows])
        assert torch.equal(invariant_silu(gate[rows].contiguous()), whole[rows])
    torch.testing.assert_close(whole, F.silu(gate))


def test_the_mode_refuses_what_it_does_not_cover():
    check_batch_invariant_support(torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="device='cpu' and dtype='float32'.*'bfloat16'"):
        check_batch_invariant_support(torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="device='cuda'"):
        check_batch_invariant_support(torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="batch_invariant must be true or false"):
        EngineConfig(batch_invariant="yes")


# ---- the scheduler: a prompt is always cut at the same positions ------------------------------


def _chunks(prompt_len: int, mates: list[int], budget: int, aligned: bool) -> list[int]:
    """The chunk sizes the scheduler gives a prompt of ``prompt_len`` queued after ``mates``."""
    seqs = make_seqs([*mates, prompt_len])
    sched = Scheduler(KVCacheManager(256, 4), 16, budget, 8, aligned_chunks=aligned)
    for s in seqs:
        sched.add(s)
    target, chunks = seqs[-1], []
    while target.num_computed_tokens < prompt_len:
        for e in sched.schedule().scheduled:
            if e.seq is target:
                chunks.append(e.num_new_tokens)
            e.seq.num_computed_tokens += e.num_new_tokens
            if e.samples_next_token:
                e.seq.output_token_ids.append(7)
    return chunks


def test_aligned_chunks_cut_a_prompt_where_its_mates_do_not_matter():
    assert _chunks(21, [], 16, aligned=True) == [8, 8, 5]
    for mates in ([3], [5, 6], [13], [1, 1, 1]):
        assert _chunks(21, mates, 16, aligned=True) == [8, 8, 5]
    assert _chunks(21, [5, 6], 16, aligned=False)[0] == 5  # the default fills the budget
    # A step budget below the chunk size: chunks shrink to it, so an empty step fits one.
    assert _chunks(21, [2], 6, aligned=True) == [6, 6, 6, 3]


# ---- end to end -------------------------------------------------------------------------------


def _workload(seed: int = 0):
    """16 target requests (every 4th greedy, the rest seeded at temperature 1.0; prompts of
    5-119 tokens) plus one seeded request with ``n=2``, and 200 others (prompts of 3-199
    tokens; greedy, seeded and unseeded, top-p or not, 1-15 new tokens)."""
    rng = random.Random(seed)

    def prompt(n: int) -> dict:
        return {"prompt_token_ids": [rng.randrange(3, VOCAB) for _ in range(n)]}

    targets = []
    for i in range(16):
        greedy = i % 4 == 0
        sp = SamplingParams(
            temperature=0.0 if greedy else 1.0,
            seed=None if greedy else 1000 + i,
            max_tokens=16,
            ignore_eos=True,
            logprobs=0,
        )
        targets.append((prompt(rng.randrange(5, 120)), sp))
    # Parallel sampling: the samples share their prompt's K/V (prefix sharing).
    sp = SamplingParams(n=2, temperature=1.0, seed=77, max_tokens=16, ignore_eos=True, logprobs=0)
    targets.append((prompt(70), sp))
    others = []
    for i in range(200):
        sp = SamplingParams(
            temperature=rng.choice([0.0, 0.8, 1.0]),
            seed=rng.choice([None, i]),
            max_tokens=rng.randrange(1, 16),
            ignore_eos=True,
            top_p=rng.choice([1.0, 0.9]),
        )
        others.append((prompt(rng.randrange(3, 200)), sp))
    mixed = [("target", i, t) for i, t in enumerate(targets)]
    mixed += [("other", i, o) for i, o in enumerate(others)]
    rng.shuffle(mixed)
    return targets, mixed


def _tokens_and_logprobs(output) -> list[tuple[list[int], list[float]]]:
    """Per sample of a request: its token ids and their log-probabilities."""
    samples = []
    for sample in output.outputs:
        ids = list(sample.token_ids)
        logprobs = [lp[t].logprob for lp, t in zip(sample.logprobs, ids, strict=True)]
        samples.append((ids, logprobs))
    return samples


def _alone_and_mixed(llm: LLM):
    """Each target generated alone, and the same targets inside the shuffled mix."""
    targets, mixed = _workload()
    alone = [_tokens_and_logprobs(llm.generate(p, sp, use_tqdm=False)[0]) for p, sp in targets]
    outs = llm.generate([m[2][0] for m in mixed], [m[2][1] for m in mixed], use_tqdm=False)
    in_mix = {
        i: _tokens_and_logprobs(o) for (kind, i, _), o in zip(mixed, outs) if kind == "target"
    }
    metrics = llm.get_metrics()
    ranks = metrics.get("ranks", [metrics])
    assert sum(r["num_preemptions"] for r in ranks) == 0  # recompute is not covered
    return alone, [in_mix[i] for i in range(len(targets))]


def _ids(results) -> list[list[list[int]]]:
    return [[ids for ids, _ in samples] for samples in results]


def _llm(checkpoint_dir, name: str, **kwargs) -> LLM:
    return LLM(
        str(checkpoint_dir(name)),
        device="cpu",
        dtype="float32",
        kv_cache_memory_gb=0.5,
        max_model_len=512,
        **kwargs,
    )


CASES = {
    # Mixtral with the fused MoE kernel (the default CPU float32 path) and default limits.
    "mixtral": ("mixtral", {}, None),
    # The torch expert path (the fused kernel off): per-expert GEMMs and SiLU in torch.
    "mixtral_torch_experts": ("mixtral", {}, "invariant_linear,paged_decode_attention"),
    # Prompts cut into chunks of 64 (chunked prefill; attention micro-batches of 64 tokens).
    "mixtral_chunked": ("mixtral", {"max_num_batched_tokens": 64}, None),
    # Classic continuous batching: one group per step, no coalescing.
    "mixtral_lockstep": ("mixtral", {"scheduler_policy": "lockstep"}, None),
    # Dense float32 layers: Llama's gated MLP; Qwen2-MoE's shared expert and dense layer.
    "llama": ("llama", {}, None),
    "qwen2_moe": ("qwen2_moe", {}, None),
    # MLA attention (absorbed decode on the torch path), sigmoid routing with correction bias.
    "deepseek_v3": ("deepseek_v3", {}, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_batch_invariant_mode_gives_identical_tokens_alone_and_mixed(
    monkeypatch, checkpoint_dir, case
):
    name, kwargs, kernels = CASES[case]
    if kernels is not None:
        monkeypatch.setenv("BATCHGEN_CPU_KERNELS", kernels)
    llm = _llm(checkpoint_dir, name, batch_invariant=True, **kwargs)
    alone, mixed = _alone_and_mixed(llm)
    assert _ids(mixed) == _ids(alone)  # token ids
    assert mixed == alone  # and log-probabilities, bit for bit


def test_update_weights_reaches_the_packed_weights(checkpoint_dir, tmp_path):
    """RL rollouts update the policy between generate calls: the mode's packed copies of the
    linear weights must follow, or the engine would keep generating with the old policy."""
    arch, overrides = CHECKPOINTS["mixtral"]
    other = make_model(arch, tmp_path / "mixtral_b", seed=4321, **overrides)
    sp = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True, logprobs=0)
    prompt = {"prompt_token_ids": list(range(3, 40))}

    def run(llm: LLM):
        return _tokens_and_logprobs(llm.generate(prompt, sp, use_tqdm=False)[0])

    fresh_b = run(LLM(str(other), device="cpu", batch_invariant=True, kv_cache_memory_gb=0.05))
    llm = _llm(checkpoint_dir, "mixtral", batch_invariant=True)
    assert run(llm) != fresh_b
    llm.update_weights(str(other))
    assert run(llm) == fresh_b


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["expert_parallel", "data_parallel_offload"])
def test_batch_invariant_mode_on_two_expert_parallel_ranks(checkpoint_dir, strategy):
    """Data-parallel attention on 2 ranks, experts split between them (all-to-all; with
    ``data_parallel_offload`` a prefill's experts are streamed to its own rank): which rank
    serves a request and which rank runs its experts change with the batch."""
    llm = _llm(
        checkpoint_dir,
        "mixtral",
        batch_invariant=True,
        data_parallel_size=2,
        enable_expert_parallel=True,
        prefill_strategy=strategy,
        prefill_stream_min_tokens=1,  # stream in every step with a prefill
    )
    try:
        alone, mixed = _alone_and_mixed(llm)
    finally:
        llm.shutdown()
    assert _ids(mixed) == _ids(alone)
    assert mixed == alone


@pytest.mark.xfail(
    strict=False,
    reason="default mode: MKL's SGEMM (F.linear) rounds a row differently with the number of "
    "rows in the call, so a request's log-probabilities change in the last bits with its batch "
    "mates (its tokens did not change in this workload, but may in others)",
)
def test_default_mode_is_not_bitwise_batch_invariant(checkpoint_dir):
    alone, mixed = _alone_and_mixed(_llm(checkpoint_dir, "mixtral"))
    assert _ids(mixed) == _ids(alone)
    assert mixed == alone
