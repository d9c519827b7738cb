"""The fused MoE CPU kernel through the engine (`LLM`) on tiny random Mixtral checkpoints with
sizes the kernel's blocking does not divide (H 80, I 40: not multiples of 32 / 64), top-1 and
top_k = num_experts, one-token and empty prompts: greedy tokens equal `transformers`' in
float32, token for token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchgen import LLM, SamplingParams
from batchgen.kernels import fused_moe as fm
from batchgen.models.layers.moe import SparseMoeBlock

tf = pytest.importorskip("transformers")

needs_kernel = pytest.mark.skipif(
    not fm.fused_moe_available(
        torch.zeros(1, 16), torch.zeros(1, 16, 16), torch.zeros(1, 16, 8), F.silu
    ),
    reason="the fused MoE kernel is not built here (no compiler or no AVX2/FMA)",
)
ODD = dict(
    hidden_size=80,  # 5 heads of 16
    intermediate_size=40,  # 2I = 80
    num_hidden_layers=2,
    num_attention_heads=5,
    num_key_value_heads=1,
    initializer_range=0.1,
    num_local_experts=4,
)


@pytest.fixture(scope="module")
def odd_checkpoint(tmp_path_factory):
    from batchgen.models.make_model import make_model

    root = tmp_path_factory.mktemp("odd_moe")
    cache = {}

    def make(top_k):
        if top_k not in cache:
            cache[top_k] = make_model(
                "mixtral", root / f"top{top_k}", seed=99, num_experts_per_tok=top_k, **ODD
            )
        return cache[top_k]

    return make


def _hf_greedy(ref, prompt_ids, max_new_tokens):
    out = ref.generate(
        torch.tensor([prompt_ids]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
    )
    return out[0, len(prompt_ids) :].tolist()


@needs_kernel
@pytest.mark.parametrize("top_k", [1, 4])
def test_odd_sizes_top1_and_top_all_match_transformers(odd_checkpoint, top_k):
    path = odd_checkpoint(top_k)
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_memory_gb=0.05)
    blocks = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == 2
    assert all(b.uses_kernel(torch.zeros(1, 80)) for b in blocks)  # the kernel serves H 80
    prompts = [[7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4], [11, 12]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ref = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(ref, prompt, 10), prompt


@needs_kernel
def test_an_empty_prompt_fails_alone_and_the_one_token_prompt_beside_it_runs(odd_checkpoint):
    """0 tokens: that prompt's output carries the error (`LLM.generate` fails prompts one by
    one); the 1-token prompt in the same call still generates (top-1: 3 of 4 experts get no
    row at every decode step)."""
    path = odd_checkpoint(1)
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_memory_gb=0.05)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    empty, one = llm.generate([{"prompt_token_ids": []}, {"prompt_token_ids": [9]}], params)
    assert empty.error is not None and "prompt is empty" in empty.error
    ref = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert one.error is None and one.outputs[0].token_ids == _hf_greedy(ref, [9], 4)
