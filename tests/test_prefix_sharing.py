"""Parallel sampling shares the prompt's KV blocks among a request's samples: outputs must be
token-identical to prefilling every sample, with and without preemption, and every block must
be free again at the end."""

from __future__ import annotations

import pytest

from batchgen import LLM, SamplingParams

PROMPTS = [
    [1],  # one token: nothing to share
    [1, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24],  # 17 = a block + 1
    [1] + list(range(30, 62)),  # 33 tokens
    [1] + list(range(100, 106)),  # shorter than a block: the partial block is copied
]


def _generate(path, sharing: bool, policy: str, **kw) -> tuple[list, dict, LLM]:
    llm = LLM(
        path,
        device="cpu",
        block_size=16,
        enable_prefix_sharing=sharing,
        enable_prefix_caching=False,  # sharing alone (tests/test_prefix_caching.py: both)
        scheduler_policy=policy,
        **kw,
    )
    params = [
        SamplingParams(n=4, temperature=1.0, seed=11 + i, max_tokens=24, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    params.append(SamplingParams(n=3, temperature=0.0, max_tokens=24, ignore_eos=True))
    prompts = [{"prompt_token_ids": p} for p in [*PROMPTS, PROMPTS[2]]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [[o.token_ids for o in out.outputs] for out in outs]
    return tokens, llm.get_metrics(), llm


@pytest.mark.parametrize("policy", ["coalesce", "lockstep"])
@pytest.mark.parametrize(
    "kw",
    [
        dict(kv_cache_memory_gb=0.05),
        dict(num_gpu_blocks_override=12, max_num_batched_tokens=16),  # forces preemption
    ],
    ids=["roomy", "preempting"],
)
def test_shared_prompt_outputs_equal_unshared(checkpoint_dir, policy, kw):
    path = str(checkpoint_dir("mixtral"))
    base, base_metrics, _ = _generate(path, False, policy, **kw)
    shared, metrics, llm = _generate(path, True, policy, **kw)
    assert shared == base
    assert base_metrics["shared_prefix_tokens"] == 0
    # Every sample after the first skips prompt_len - 1 positions (more after a preemption).
    assert metrics["shared_prefix_tokens"] >= 3 * (16 + 32 + 6) + 2 * 32
    assert metrics["prefill_tokens"] < base_metrics["prefill_tokens"]
    if "num_gpu_blocks_override" in kw:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    greedy = shared[-1]
    assert greedy[0] == greedy[1] == greedy[2]
    kv = llm.llm_engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
