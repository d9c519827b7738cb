"""Numerical proof against `transformers` on the same checkpoints: teacher-forced logits position
by position, and greedy continuations token by token (also under chunked prefill and preemption).
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from batchgen import LLM, SamplingParams
from tests.conftest import CHECKPOINTS

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "a",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Batch inference 批处理推理 🚀 with mixtures of experts, many many tokens long enough",
]


def _hf(path) -> torch.nn.Module:
    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


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
def test_teacher_forced_logits_match_transformers(checkpoint_dir, name, max_num_batched_tokens):
    path = checkpoint_dir(name)
    llm = LLM(
        str(path),
        device="cpu",
        dtype="float32",
        max_num_batched_tokens=max_num_batched_tokens,
        kv_cache_memory_gb=0.05,
    )
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    ours = _teacher_forced_logits(llm, ids)
    ref = _hf(path)
    for prompt_ids, got in zip(ids, ours):
        with torch.no_grad():
            want = ref(torch.tensor([prompt_ids])).logits[0]
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _hf_greedy(ref, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    out = ref.generate(
        torch.tensor([prompt_ids]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
    )
    return out[0, len(prompt_ids) :].tolist()


GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_greedy_matches_transformers_generate(checkpoint_dir, name):
    path = checkpoint_dir(name)
    llm = LLM(str(path), device="cpu", kv_cache_memory_gb=0.05)
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], GREEDY, use_tqdm=False)
    ref = _hf(path)
    for prompt_ids, out in zip(ids, outs):
        assert out.outputs[0].token_ids == _hf_greedy(ref, prompt_ids, 32)
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "name", ["mixtral", "llama_mqa_bias_llama3", "mistral_sliding", "qwen3_moe", "deepseek_v3"]
)
def test_greedy_under_preemption_and_chunked_prefill(checkpoint_dir, name):
    path = checkpoint_dir(name)
    # 6 blocks of 16 tokens: two sequences of ~45 tokens cannot both fit, so the scheduler must
    # preempt (and recompute) while 8-token steps chunk every prompt.
    llm = LLM(
        str(path), device="cpu", num_gpu_blocks_override=6, block_size=16, max_num_batched_tokens=8
    )
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], GREEDY, use_tqdm=False)
    assert llm.llm_engine.stats.num_preemptions > 0
    ref = _hf(path)
    for prompt_ids, out in zip(ids, outs):
        assert out.outputs[0].token_ids == _hf_greedy(ref, prompt_ids, 32)


def test_hub_style_rope_config_is_read(checkpoint_dir, tmp_path):
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
    llm = LLM(str(dst), device="cpu", kv_cache_memory_gb=0.05)
    assert llm.llm_engine.model_config.rope_parameters["rope_type"] == "llama3"
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPTS[3])
    out = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == _hf_greedy(_hf(src), ids, 32)
