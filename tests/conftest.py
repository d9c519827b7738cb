"""Shared fixtures: tiny random checkpoints written offline with `transformers` classes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without CUDA the Triton kernels' tests (tests/test_triton_kernels.py) run them under triton's
# interpreter. triton reads the variable when it is first imported (it decorates its own library
# functions then), and transformers' DeepSeek modules import triton while test modules are
# collected, so it is set here, before any test module. It lets a forced Triton path run on CPU
# (`auto` never picks Triton on CPU) and changes nothing else the tests run.
if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tiny shapes shared by the oracle tests: 2 layers, hidden 64, vocab 512 (the tokenizer's).
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.1,
)

# name -> (make_model arch, config overrides): one entry per code path worth proving.
CHECKPOINTS: dict[str, tuple[str, dict]] = {
    "mixtral": ("mixtral", dict(TINY, num_local_experts=4, num_experts_per_tok=2)),
    # 8 experts, top-4: on 2 expert-parallel ranks nearly every token has an expert on each,
    # so dispatch pads rows instead of exchanging counts (`pad_dispatch_rows`).
    "mixtral_top4": ("mixtral", dict(TINY, num_local_experts=8, num_experts_per_tok=4)),
    "llama": ("llama", dict(TINY)),
    "llama_mqa_bias_llama3": (
        "llama",
        dict(
            TINY,
            num_key_value_heads=1,
            attention_bias=True,
            mlp_bias=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=10000.0,
            max_position_embeddings=1024,
        ),
    ),
    "llama_linear_tied": (
        "llama",
        dict(TINY, tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 4.0}),
    ),
    "mistral_sliding": ("mistral", dict(TINY, sliding_window=8)),
    # The bench model's attention shape (8 query heads, 2 KV heads of 64) at hidden 128: the
    # bf16 decode attention kernel's AVX512-BF16 path (head size a multiple of 32).
    "llama_d64": ("llama", dict(TINY, hidden_size=128, num_attention_heads=8, head_dim=64)),
    "mixtral_d64": (
        "mixtral",
        dict(
            TINY,
            hidden_size=128,
            num_attention_heads=8,
            head_dim=64,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
    ),
    "qwen2": ("qwen2", dict(TINY, num_key_value_heads=1)),
    # Qwen2-MoE: shared expert with sigmoid gate, unnormalised top-k, layer 1 dense.
    "qwen2_moe": (
        "qwen2_moe",
        dict(
            TINY,
            num_experts=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
        ),
    ),
    # Qwen2-MoE: normalised top-k, sparse every 2nd layer (layer 0 dense).
    "qwen2_moe_step2": (
        "qwen2_moe",
        dict(
            TINY,
            num_experts=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=True,
            decoder_sparse_step=2,
        ),
    ),
    # Qwen3-MoE: per-head q/k norm, head_dim 24 != hidden/heads = 16, one KV head, layer 0 dense.
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            TINY,
            num_experts=4,
            moe_intermediate_size=32,
            head_dim=24,
            num_key_value_heads=1,
            mlp_only_layers=[0],
        ),
    ),
    "qwen3_moe_unnorm": (
        "qwen3_moe",
        dict(TINY, num_experts=4, moe_intermediate_size=32, norm_topk_prob=False),
    ),
    # OLMoE: q/k norm over the whole projection; one variant clips q, k, v.
    "olmoe": ("olmoe", dict(TINY, num_experts=4, intermediate_size=32)),
    "olmoe_clip_norm": (
        "olmoe",
        dict(TINY, num_experts=4, intermediate_size=32, clip_qkv=0.5, norm_topk_prob=True),
    ),
    # DeepSeek-V3: MLA with q_lora_rank, YaRN (+ softmax-scale correction), dense layer 0,
    # sigmoid routing with a random e_score_correction_bias, n_group 4 / topk_group 2,
    # normalised top-k, routed_scaling_factor, one shared expert.
    "deepseek_v3": (
        "deepseek_v3",
        dict(
            TINY,
            num_key_value_heads=4,
            n_routed_experts=8,
            moe_intermediate_size=32,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            max_position_embeddings=512,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        ),
    ),
    # DeepSeek-V3 without q_lora_rank, unnormalised weights, no group limit, all layers sparse.
    "deepseek_v3_plain": (
        "deepseek_v3",
        dict(
            TINY,
            num_key_value_heads=4,
            n_routed_experts=8,
            moe_intermediate_size=32,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            norm_topk_prob=False,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=0,
        ),
    ),
    # DeepSeek-V2: softmax routing, group-limited greedy, no q_lora_rank.
    "deepseek_v2": (
        "deepseek_v2",
        dict(
            TINY,
            num_key_value_heads=4,
            n_routed_experts=8,
            moe_intermediate_size=32,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
        ),
    ),
    # DeepSeek-V2 with q_lora_rank and plain greedy top-k.
    "deepseek_v2_greedy_lora": (
        "deepseek_v2",
        dict(
            TINY,
            num_key_value_heads=4,
            n_routed_experts=8,
            moe_intermediate_size=32,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            topk_method="greedy",
            n_group=1,
            topk_group=1,
        ),
    ),
}


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """Returns ``make(name) -> Path`` building (once per session) the named tiny checkpoint."""
    from batchgen.models.make_model import make_model

    root = tmp_path_factory.mktemp("ckpt")
    cache: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in cache:
            arch, overrides = CHECKPOINTS[name]
            cache[name] = make_model(arch, root / name, seed=1234, **overrides)
        return cache[name]

    return make


@dataclass(frozen=True)
class OracleTarget:
    """Where the model-vs-`transformers` oracle tests run: ``device`` ("cpu" or "cuda") and
    ``dtype`` (None: each test's own choice, float32 for the tiny checkpoints; "float32" or
    "bfloat16": engine and reference both in it). Read from ``BATCHGEN_TEST_DEVICE`` and
    ``BATCHGEN_TEST_DTYPE``; unset, the tests run as they always did (CPU, their dtypes)."""

    device: str = "cpu"
    dtype: str | None = None

    @property
    def bf16(self) -> bool:
        return self.dtype == "bfloat16"

    def llm_kwargs(self, dtype: str | None = None) -> dict:
        """``device`` and ``dtype`` for `LLM`: the target's dtype, else ``dtype`` if given."""
        chosen = self.dtype or dtype
        return {"device": self.device, **({"dtype": chosen} if chosen else {})}


ORACLE_DEVICES, ORACLE_DTYPES = ("cpu", "cuda"), ("float32", "bfloat16")


def read_oracle_target(env=os.environ) -> OracleTarget:
    """`OracleTarget` from the environment; ValueError naming the variable for a bad value."""
    device = env.get("BATCHGEN_TEST_DEVICE", "cpu") or "cpu"
    dtype = env.get("BATCHGEN_TEST_DTYPE") or None
    if device not in ORACLE_DEVICES:
        raise ValueError(f"BATCHGEN_TEST_DEVICE must be one of {ORACLE_DEVICES}, got {device!r}")
    if dtype is not None and dtype not in ORACLE_DTYPES:
        raise ValueError(f"BATCHGEN_TEST_DTYPE must be one of {ORACLE_DTYPES}, got {dtype!r}")
    return OracleTarget(device, dtype)


@pytest.fixture(scope="session")
def oracle_target() -> OracleTarget:
    """The oracle tests' `OracleTarget`. Fails (never skips) when CUDA is asked for and absent,
    so that a device run cannot pass by running nothing."""
    try:
        target = read_oracle_target()
    except ValueError as err:
        pytest.fail(str(err))
    if target.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            pytest.fail("BATCHGEN_TEST_DEVICE=cuda but torch.cuda.is_available() is False")
    return target
