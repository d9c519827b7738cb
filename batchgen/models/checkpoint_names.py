"""Checkpoint names to engine parameters: the declarative rules the loader and
`update_weights` share. `checkpoint_rules` maps each Hugging Face checkpoint tensor name to a
`Target` (a parameter, a piece of it, an optional expert index and row range); `find_target`
applies them, `target_view` is the part of a parameter a target fills, `expected_pieces` what
must all be filled for a parameter to be complete."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from batchgen.models.model_config import ModelConfig

_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.rotary_emb\.cos_cached|\.rotary_emb\.sin_cached)$")


@dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor goes: a parameter, an optional expert index (dim 0) and an
    optional row range ``[row_start, row_start + rows)`` along the next dim."""

    param: str
    piece: object
    expert: int | None = None
    row_start: int | None = None
    rows: int | None = None


def find_target(name: str, rules: list[tuple[re.Pattern, object]]) -> tuple[bool, Target | None]:
    """``(known, target)`` for checkpoint tensor ``name`` under `checkpoint_rules`: ``known``
    is False when no rule matches; ``target`` is None for a tensor ignored on purpose (rotary
    caches, the ``lm_head`` of a model with tied embeddings)."""
    if _IGNORED.search(name):
        return True, None
    for pattern, fn in rules:
        match = pattern.match(name)
        if match:
            return True, fn(match)
    return False, None


def target_view(param: torch.Tensor, target: Target, expert: int | None) -> torch.Tensor:
    """The part of ``param`` (through ``.data``) that ``target`` fills: expert slot ``expert``
    (dim 0; `Target.expert`, or its held slot under expert parallelism), then the rows
    ``[row_start, row_start + rows)``."""
    dest = param.data
    if expert is not None:
        dest = dest[expert]
    if target.row_start is not None:
        dest = dest.narrow(0, target.row_start, target.rows)
    return dest


def expected_pieces(name: str, param: torch.Tensor, cfg: ModelConfig) -> set:
    """The pieces that must all be filled for parameter ``name`` (expert weights: one per held
    slot, see `SparseMoeBlock.expert_ids`)."""
    if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
        return {"q", "k", "v"}
    if name.endswith("gate_up_proj.weight") or name.endswith("gate_up_proj.bias"):
        return {"gate", "up"}
    if name.endswith("w13_weight"):
        return {(e, s) for e in range(param.shape[0]) for s in ("gate", "up")}
    if name.endswith("w2_weight"):
        return set(range(param.shape[0]))
    return {"all"}


_LAYER = r"model\.layers\.(\d+)\."


def checkpoint_rules(cfg: ModelConfig) -> list[tuple[re.Pattern, object]]:
    """Regex rules from HF checkpoint names to `Target`s (or None for ignored tensors).

    Expert weights are accepted in every layout found in the wild: Mixtral's hub names
    ``block_sparse_moe.experts.{e}.w1/w2/w3``, the Qwen/OLMoE/DeepSeek names
    ``mlp.experts.{e}.gate_proj/up_proj/down_proj`` and transformers 5's fused
    ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``.
    """
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    qkv_offset = {"q": 0, "k": q, "v": q + kv}
    qkv_rows = {"q": q, "k": kv, "v": kv}
    up_offset = {
        "mlp": cfg.intermediate_size,
        "experts": cfg.moe_intermediate_size,
        "shared": cfg.shared_expert_intermediate_size,
    }

    def qkv(m):
        return Target(
            f"layers.{m[1]}.self_attn.qkv_proj.{m[3]}",
            m[2],
            row_start=qkv_offset[m[2]],
            rows=qkv_rows[m[2]],
        )

    def gate_up(m):
        return Target(
            f"layers.{m[1]}.mlp.gate_up_proj.{m[3]}",
            m[2],
            row_start=0 if m[2] == "gate" else up_offset["mlp"],
            rows=up_offset["mlp"],
        )

    def shared_gate_up(m):
        return Target(
            f"layers.{m[1]}.mlp.shared_experts.gate_up_proj.weight",
            m[2],
            row_start=0 if m[2] == "gate" else up_offset["shared"],
            rows=up_offset["shared"],
        )

    def expert(layer: str, e: int, which: str) -> Target:
        if which == "down":
            return Target(f"layers.{layer}.mlp.w2_weight", e, expert=e)
        return Target(
            f"layers.{layer}.mlp.w13_weight",
            (e, which),
            expert=e,
            row_start=0 if which == "gate" else up_offset["experts"],
            rows=up_offset["experts"],
        )

    w123 = {"1": "gate", "3": "up", "2": "down"}

    def plain(template):
        return lambda m: Target(template.format(*m.groups()), "all")

    if cfg.mla is not None:
        attention = [
            (
                _LAYER + r"self_attn\.(q_proj|q_a_proj|q_a_layernorm|q_b_proj|kv_a_proj_with_mqa"
                r"|kv_a_layernorm|kv_b_proj|o_proj)\.(weight|bias)",
                plain("layers.{}.self_attn.{}.{}"),
            ),
        ]
    else:
        attention = [
            (_LAYER + r"self_attn\.(q|k|v)_proj\.(weight|bias)", qkv),
            (_LAYER + r"self_attn\.o_proj\.(weight|bias)", plain("layers.{}.self_attn.o_proj.{}")),
            (
                _LAYER + r"self_attn\.(q_norm|k_norm)\.weight",
                plain("layers.{}.self_attn.{}.weight"),
            ),
        ]
    rules = [
        (r"model\.embed_tokens\.weight", plain("embed_tokens.weight")),
        (r"model\.norm\.weight", plain("norm.weight")),
        (
            r"lm_head\.weight",
            (lambda m: None) if cfg.tie_word_embeddings else plain("lm_head.weight"),
        ),
        (
            _LAYER + r"(input_layernorm|post_attention_layernorm)\.weight",
            plain("layers.{}.{}.weight"),
        ),
        *attention,
        (_LAYER + r"mlp\.(gate|up)_proj\.(weight|bias)", gate_up),
        (_LAYER + r"mlp\.down_proj\.(weight|bias)", plain("layers.{}.mlp.down_proj.{}")),
        (_LAYER + r"(?:block_sparse_moe|mlp)\.gate\.weight", plain("layers.{}.mlp.gate.weight")),
        (
            _LAYER + r"mlp\.gate\.e_score_correction_bias",
            plain("layers.{}.mlp.gate.e_score_correction_bias"),
        ),
        (
            _LAYER + r"block_sparse_moe\.experts\.(\d+)\.w(1|2|3)\.weight",
            lambda m: expert(m[1], int(m[2]), w123[m[3]]),
        ),
        (
            _LAYER + r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight",
            lambda m: expert(m[1], int(m[2]), m[3]),
        ),
        (_LAYER + r"mlp\.experts\.gate_up_proj", plain("layers.{}.mlp.w13_weight")),
        (_LAYER + r"mlp\.experts\.down_proj", plain("layers.{}.mlp.w2_weight")),
        (_LAYER + r"mlp\.shared_experts?\.(gate|up)_proj\.weight", shared_gate_up),
        (
            _LAYER + r"mlp\.shared_experts?\.down_proj\.weight",
            plain("layers.{}.mlp.shared_experts.down_proj.weight"),
        ),
        (
            _LAYER + r"mlp\.shared_expert_gate\.weight",
            plain("layers.{}.mlp.shared_expert_gate.weight"),
        ),
    ]
    return [(re.compile(pattern + "$"), fn) for pattern, fn in rules]


def is_expert_param(param: str) -> bool:
    """Whether engine parameter ``param`` is a stacked routed-expert weight ([E, ...])."""
    return param.endswith("mlp.w13_weight") or param.endswith("mlp.w2_weight")


def slot_piece(target: Target, slot_of: dict[int, int]):
    """A per-expert piece (``e`` or ``(e, "gate")``) renamed to the expert's held slot."""
    if isinstance(target.piece, tuple):
        return (slot_of[target.piece[0]], target.piece[1])
    return slot_of[target.piece]
