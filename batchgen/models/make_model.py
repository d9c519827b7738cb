"""Write complete tiny random-weight checkpoints offline (`batchgen make-model`).

Each checkpoint is what a hub download would give: ``config.json``, ``model.safetensors``,
``generation_config.json`` (EOS ids ``</s>`` and ``<|im_end|>``), and a byte-level BPE tokenizer
with a chat template (`batchgen.models.tokenizer_factory`). The weights come from the
`transformers` model class itself, so `transformers.AutoModelForCausalLM` loads the directory
and serves as the numerical oracle in tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from batchgen.models.model_config import SUPPORTED_MAKE_ARCHS
from batchgen.models.tokenizer_factory import BOS_ID, EOS_ID, IM_END_ID, PAD_ID, write_tokenizer

# The files `make_model` writes into its directory: `save_pretrained`'s three, the tokenizer's.
# Written beside the checkpoint: what made it (arch, seed, overrides). A folder holding it is
# make-model's own output, which `batchgen make-model` replaces without ``--overwrite``.
MADE_BY_FILE = "batchgen_make_model.json"

CHECKPOINT_FILES: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)

_COMMON = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
    tie_word_embeddings=False,
    # A wider spread than HF's 0.02 default, so that greedy top-2 logits are rarely near-ties.
    initializer_range=0.08,
)


def _hf_config(arch: str, overrides: dict):
    import transformers as tf

    kwargs = dict(_COMMON)
    if arch == "mixtral":
        kwargs.update(
            num_local_experts=8, num_experts_per_tok=2, intermediate_size=192, rope_theta=1e6
        )
        cls = tf.MixtralConfig
    elif arch == "qwen2_moe":
        kwargs.update(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=128,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=False,
        )
        cls = tf.Qwen2MoeConfig
    elif arch == "qwen3_moe":
        kwargs.update(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            head_dim=48,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        cls = tf.Qwen3MoeConfig
    elif arch == "olmoe":
        kwargs.update(
            num_experts=8, num_experts_per_tok=2, intermediate_size=64, norm_topk_prob=False
        )
        cls = tf.OlmoeConfig
    elif arch in ("deepseek_v2", "deepseek_v3"):
        kwargs.update(
            num_key_value_heads=kwargs["num_attention_heads"],
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            n_shared_experts=1,
            first_k_dense_replace=1,
            kv_lora_rank=64,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=32,
        )
        if arch == "deepseek_v3":
            kwargs.update(
                q_lora_rank=96,
                n_group=4,
                topk_group=2,
                norm_topk_prob=True,
                routed_scaling_factor=2.5,
            )
            cls = tf.DeepseekV3Config
        else:
            kwargs.update(
                q_lora_rank=None,
                topk_method="group_limited_greedy",
                n_group=4,
                topk_group=2,
                routed_scaling_factor=1.0,
            )
            cls = tf.DeepseekV2Config
    elif arch == "llama":
        cls = tf.LlamaConfig
    elif arch == "mistral":
        kwargs.update(sliding_window=512)
        cls = tf.MistralConfig
    elif arch == "qwen2":
        kwargs.update(tie_word_embeddings=True)
        cls = tf.Qwen2Config
    else:
        raise ValueError(f"arch must be one of {SUPPORTED_MAKE_ARCHS}, got {arch!r}")
    kwargs.update(overrides)
    return cls(**kwargs)


def _perturb_norms_and_biases(model: torch.nn.Module, std: float = 0.1) -> None:
    """HF initialises norm weights to 1 and biases to 0, which would leave those code paths
    untested by an oracle comparison: give them random values, as a trained model has."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * std)
            elif name.endswith("e_score_correction_bias"):
                # DeepSeek-V3's expert-choice bias: wide enough to change which experts win.
                param.copy_(torch.randn_like(param) * 3 * std)
            elif name.endswith("bias"):
                param.copy_(torch.randn_like(param) * std)


def make_model(arch: str, out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """Write a random-weight checkpoint of ``arch`` to ``out_dir`` and return its path.

    Args:
        arch: one of `SUPPORTED_MAKE_ARCHS`.
        out_dir: created if missing; the `CHECKPOINT_FILES` already there are replaced
            (`batchgen make-model` refuses that without ``--overwrite`` unless the folder
            holds `MADE_BY_FILE`, i.e. is an earlier make-model output), other files are left.
        seed: torch seed for the weights (same seed, same bytes).
        overrides: HF config fields (e.g. ``num_hidden_layers=2``, ``rope_scaling={...}``).

    Raises:
        ValueError: unknown ``arch``.
    """
    import transformers as tf

    config = _hf_config(arch, overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_norms_and_biases(model)
    # transformers' "Writing model shards" bar would show through `--no-progress` on the first
    # use of a built-in model; a tiny checkpoint is written in about a second without it.
    bar_was_on = tf.utils.logging.is_progress_bar_enabled()
    tf.utils.logging.disable_progress_bar()
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if bar_was_on:
            tf.utils.logging.enable_progress_bar()
    gen = {
        "bos_token_id": BOS_ID,
        "eos_token_id": [EOS_ID, IM_END_ID],
        "pad_token_id": PAD_ID,
        "do_sample": False,
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    write_tokenizer(out, vocab_size=min(config.vocab_size, 512))
    made_by = {"arch": arch, "seed": seed, "overrides": overrides}
    (out / MADE_BY_FILE).write_text(json.dumps(made_by, indent=2, default=str) + "\n")
    return out
