"""The benchmark's checkpoints (DESIGN.md's model and a DeepSeek-V3 one, built offline on first
use) and its memory budgets. The BatchGen modes run the engine's defaults of their policy
(`batchgen.config.EngineConfig`): what a user who changes nothing gets."""

from __future__ import annotations

# DESIGN.md's benchmark model: Mixtral architecture, 64 experts, top-8, hidden 512, 4 layers.
BENCH_MODEL = dict(
    num_local_experts=64,
    num_experts_per_tok=8,
    hidden_size=512,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=512,
)
BENCH_MODEL_NAME = "bench-mixtral-e64-top8-h512-l4-v1"
# The DeepSeek-V3 family at the same scale: 64 routed experts (8 groups, top-4 groups), top-8,
# one shared expert, hidden 512, 4 layers of which the first is dense, MLA with a latent of 128
# (+32 rope dims) instead of 8 x 2 x 64 KV values per token and layer.
BENCH_MODEL_DEEPSEEK_V3 = dict(
    n_routed_experts=64,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    n_shared_experts=1,
    first_k_dense_replace=1,
    hidden_size=512,
    moe_intermediate_size=256,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    kv_lora_rank=128,
    q_lora_rank=192,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    vocab_size=512,
)
BENCH_MODELS = {
    "mixtral": (BENCH_MODEL_NAME, BENCH_MODEL),
    "deepseek_v3": ("bench-deepseek-v3-e64-top8-h512-l4-v1", BENCH_MODEL_DEEPSEEK_V3),
}
KV_CACHE_GB = 8.0  # the KV budget of both BatchGen modes (4,096 rollouts need about 7.2 GB)
QUICK_KV_CACHE_GB = 1.0
# transformers' generate_batch: tokens per step of its continuous batching (its own setting; the
# BatchGen modes run the engine's defaults, `batchgen.config.EngineConfig`).
HF_BATCH_TOKENS = 512


def override_kwargs(overrides: dict | None) -> dict:
    """`LLM` keyword arguments for the engine settings the bench's flags override
    (``--expert-coalesce-threshold``, ``--kv-cache-dtype``: `ENGINE_OVERRIDES`): those not None
    (the engine's default stands for the others)."""
    return {k: v for k, v in (overrides or {}).items() if v is not None}


# The engine settings a bench flag (or the cluster file) may set in place of the defaults.
ENGINE_OVERRIDES = ("expert_coalesce_threshold", "kv_cache_dtype")


def engine_overrides(args) -> dict:
    """``{setting: value}`` of `ENGINE_OVERRIDES` from the parsed bench arguments."""
    return {name: getattr(args, name, None) for name in ENGINE_OVERRIDES}

def bench_model_path(arch: str = "mixtral") -> str:
    """The benchmark checkpoint of ``arch`` (a key of `BENCH_MODELS`), built offline on first
    use into BatchGen's cache dir. Raises ValueError for another ``arch``."""
    from batchgen.models.default_model import cached_model

    if arch not in BENCH_MODELS:
        raise ValueError(f"bench model arch must be one of {sorted(BENCH_MODELS)}, got {arch!r}")
    name, config = BENCH_MODELS[arch]
    return cached_model(name, arch, seed=0, **config)
