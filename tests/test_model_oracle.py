"""Numerical proof against `transformers` on the same checkpoints: teacher-forced logits position
by position, and greedy continuations token by token (also under chunked prefill and preemption).

By default on CPU in float32. ``BATCHGEN_TEST_DEVICE=cuda`` runs the same tests on CUDA (engine
and reference there), ``BATCHGEN_TEST_DTYPE=float32|bfloat16`` in that dtype (`OracleTarget` in
conftest.py; `benchmarks/gpu_check.sh` runs both). float32 keeps the float32 criteria (logits
within 1e-4, identical greedy tokens). bfloat16 compares against `transformers` in bfloat16 with
the criterion of `tests/test_paged_attention_bf16.py` (two bf16 implementations round
differently, so exact tokens are not a property): at every position our token's reference logit
is within 4 bf16 ulps at the largest logit of the reference's best, and at least 90% of the
positions are the reference's argmax.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from batchgen import LLM, SamplingParams
from tests.conftest import CHECKPOINTS
from tests.test_paged_attention_bf16 import assert_greedy_agrees_with_reference

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "a",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Batch inference 批处理推理 🚀 with mixtures of experts, many many tokens long enough",
]


# Why some DeepSeek-V3 cases are expected failures in bfloat16 (measured on CPU, the
# investigation of branch dsv3bf16): a near-tie in the ``noaux_tc`` expert choice (2 of 8
# experts, or 2 of 4 groups, on these random checkpoints) flips in one bf16 implementation and
# not in the other, and a changed expert moves that position's logits by about 1, far beyond
# the criterion's 4 ulps (about 0.1). Not a defect: our biased router scores are as close to
# float32's as HF bf16's (max error 3.5e-3 to 6.3e-3 vs 3.2e-3 to 7.1e-3), every failing
# position is a routing flip at a float32 margin of 0.0008 to 0.0033, in 3 of the 4 greedy
# failures HF bf16 is the one that flipped (ours routes as HF float32), and HF bf16's own greedy
# tokens fail this criterion against HF float32 (worst gap 1.25, delta 0.10).
DEEPSEEK_V3_BF16 = (
    "bf16 near-tie in DeepSeek-V3's noaux_tc expert choice flips in one implementation only; "
    "a changed expert moves the logits by ~1 >> 4 bf16 ulps (see the comment above)"
)
_BF16_ROUTING_NEAR_TIES = {
    ("test_teacher_forced_logits_match_transformers", "deepseek_v3_plain"),
    ("test_greedy_matches_transformers_generate", "deepseek_v3"),
    ("test_greedy_matches_transformers_generate", "deepseek_v3_plain"),
    ("test_greedy_under_preemption_and_chunked_prefill", "deepseek_v3"),
}


def _xfail_bf16_routing_near_tie(request, target, name: str) -> None:
    """Mark the measured DeepSeek-V3 bf16 cases xfail (bf16 only; a crash still fails)."""
    if target.bf16 and (request.function.__name__, name) in _BF16_ROUTING_NEAR_TIES:
        request.applymarker(
            pytest.mark.xfail(reason=DEEPSEEK_V3_BF16, raises=AssertionError, strict=False)
        )


def _hf(path, target=None) -> torch.nn.Module:
    """The `transformers` reference: float32 on CPU, or on ``target``'s device and dtype."""
    dtype = torch.bfloat16 if target is not None and target.bf16 else torch.float32
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return model.to(target.device) if target is not None else model


def _assert_argmax_agrees(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 teacher-forced criterion on ``[L, V]`` logits (module docstring): our argmax's
    reference logit within 4 bf16 ulps (4 * 2^-7 * max|logit|) of the reference's best at every
    position, and at least 90% of positions the reference's argmax."""
    want = want.float()
    ours = got.float().argmax(-1)
    delta = 4 * 2.0**-7 * want.abs().max().item()
    chosen = want.gather(1, ours[:, None])[:, 0]
    assert (chosen >= want.max(-1).values - delta).all(), (name, ours.tolist())
    exact = int((want.argmax(-1) == ours).sum())
    assert exact >= 0.9 * len(ours), f"{name}: {exact}/{len(ours)} positions are the argmax"


def _teacher_forced_logits(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Run prompts through the engine's real step path (scheduler, paged cache, chunking) and
    collect the logits of every position, ``[len, V]`` per prompt."""
    eng = llm.llm_engine
    for i, ids in enumerate(prompts):
        eng.add_request(f"tf{i}", ids, SamplingParams(max_tokens=1))
    chunks: dict[str, list[torch.Tensor]] = {f"tf{i}": [] for i in range(len(prompts))}
    with torch.inference_mode():
        while any(
            s.num_computed_tokens < s.num_tokens for r in eng.requests.values() for s in r.seqs
        ):
            sched = eng.scheduler.schedule()
            input_ids, meta, ordered, _ = eng.runner.prepare(sched.scheduled)
            hidden = eng.runner.model(input_ids, meta, eng.runner.kv_caches)
            logits = eng.runner.model.compute_logits(hidden)
            offset = 0
            for entry in ordered:
                n = entry.num_new_tokens
                chunks[entry.seq.request.request_id].append(logits[offset : offset + n])
                entry.seq.num_computed_tokens += n
                offset += n
    for rid in list(chunks):
        eng.abort_request(rid)
    return [torch.cat(chunks[f"tf{i}"]) for i in range(len(prompts))]


@pytest.mark.parametrize("name", list(CHECKPOINTS))
@pytest.mark.parametrize("max_num_batched_tokens", [2048, 7])
def test_teacher_forced_logits_match_transformers(
    request, checkpoint_dir, oracle_target, name, max_num_batched_tokens
):
    _xfail_bf16_routing_near_tie(request, oracle_target, name)
    path = checkpoint_dir(name)
    llm = LLM(
        str(path),
        **oracle_target.llm_kwargs("float32"),
        max_num_batched_tokens=max_num_batched_tokens,
        kv_cache_memory_gb=0.05,
    )
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    ours = _teacher_forced_logits(llm, ids)
    ref = _hf(path, oracle_target)
    for prompt_ids, got in zip(ids, ours):
        with torch.no_grad():
            want = ref(torch.tensor([prompt_ids], device=oracle_target.device)).logits[0]
        assert got.shape == want.shape
        if oracle_target.bf16:
            _assert_argmax_agrees(name, got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _hf_greedy(ref, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    dev = next(ref.parameters()).device
    out = ref.generate(
        torch.tensor([prompt_ids], device=dev),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=dev),
    )
    return out[0, len(prompt_ids) :].tolist()


def _assert_greedy_matches(name, target, ref, ids, outs) -> None:
    """float32: token for token `transformers` generate; bfloat16: the bf16 criterion."""
    if target.bf16:
        assert_greedy_agrees_with_reference(name, ids, outs, ref)
        return
    for prompt_ids, out in zip(ids, outs):
        assert out.outputs[0].token_ids == _hf_greedy(ref, prompt_ids, 32)


GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_greedy_matches_transformers_generate(request, checkpoint_dir, oracle_target, name):
    _xfail_bf16_routing_near_tie(request, oracle_target, name)
    path = checkpoint_dir(name)
    llm = LLM(str(path), **oracle_target.llm_kwargs(), kv_cache_memory_gb=0.05)
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], GREEDY, use_tqdm=False)
    _assert_greedy_matches(name, oracle_target, _hf(path, oracle_target), ids, outs)
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * len(outs)


@pytest.mark.parametrize(
    "name", ["mixtral", "llama_mqa_bias_llama3", "mistral_sliding", "qwen3_moe", "deepseek_v3"]
)
def test_greedy_under_preemption_and_chunked_prefill(request, checkpoint_dir, oracle_target, name):
    _xfail_bf16_routing_near_tie(request, oracle_target, name)
    path = checkpoint_dir(name)
    # 6 blocks of 16 tokens: two sequences of ~45 tokens cannot both fit, so the scheduler must
    # preempt (and recompute) while 8-token steps chunk every prompt.
    llm = LLM(
        str(path),
        **oracle_target.llm_kwargs(),
        num_gpu_blocks_override=6,
        block_size=16,
        max_num_batched_tokens=8,
    )
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], GREEDY, use_tqdm=False)
    assert llm.llm_engine.stats.num_preemptions > 0
    _assert_greedy_matches(name, oracle_target, _hf(path, oracle_target), ids, outs)


def test_hub_style_rope_config_is_read(checkpoint_dir, oracle_target, tmp_path):
    """Hub checkpoints carry `rope_theta`/`rope_scaling` at the top level (transformers 4)."""
    import json
    import shutil

    src = checkpoint_dir("llama_mqa_bias_llama3")
    dst = tmp_path / "legacy"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    (dst / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(dst), **oracle_target.llm_kwargs(), kv_cache_memory_gb=0.05)
    assert llm.llm_engine.model_config.rope_parameters["rope_type"] == "llama3"
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPTS[3])
    out = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    _assert_greedy_matches("hub_rope", oracle_target, _hf(src, oracle_target), [ids], [out])
