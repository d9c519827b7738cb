"""Decoder-only transformer exposed as stage functions.

One class covers every supported family: per layer the attention is GQA or MLA and the FFN a
`GatedMLP` or a `SparseMoeBlock`. The executor drives the model stage by stage:

    h = model.embed(input_ids)                              # [T, H]
    for layer in range(model.num_layers):
        h = model.attention_stage(layer, h, meta, kv_caches[layer])
        h = model.ffn_stage(layer, h)
    logits = model.compute_logits(h[sample_indices])        # [B, V] float32

Between stages the only state is the residual stream ``h [T, H]`` plus `AttentionMetadata`, so a
coroutine can yield at any stage boundary.
"""

from __future__ import annotations

import torch
from torch import nn

from batchgen.models.layers.attention import Attention, AttentionMetadata
from batchgen.models.layers.mlp import GatedMLP
from batchgen.models.layers.moe import SparseMoeBlock
from batchgen.models.layers.norm import RMSNorm, add_and_prenorm, prenormed
from batchgen.models.model_config import ModelConfig


def kv_cache_token_shapes(cfg: ModelConfig) -> tuple[tuple[int, ...], ...]:
    """Per-token shape of each KV cache tensor of one layer: ``((Hkv, D), (Hkv, D))`` for key
    and value, or for MLA the compressed latent and the shared rope key
    ``((kv_lora_rank,), (qk_rope_head_dim,))`` (DeepSeek-V2 paper, section 2.1.2)."""
    if cfg.mla is not None:
        return ((cfg.mla.kv_lora_rank,), (cfg.mla.qk_rope_head_dim,))
    return ((cfg.num_key_value_heads, cfg.head_dim),) * 2


def _make_attention(cfg: ModelConfig, layer_idx: int) -> nn.Module:
    if cfg.mla is not None:
        from batchgen.models.layers.mla import MLAAttention

        return MLAAttention.from_config(cfg)
    return Attention(
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.rope_parameters,
        qkv_bias=cfg.qkv_bias,
        o_bias=cfg.o_bias,
        sliding_window=cfg.layer_sliding_windows[layer_idx],
        qk_norm=cfg.qk_norm,
        clip_qkv=cfg.clip_qkv,
        rms_norm_eps=cfg.rms_norm_eps,
    )


def _make_ffn(cfg: ModelConfig, layer_idx: int, expert_ids: list[int] | None) -> nn.Module:
    if not cfg.layer_is_moe[layer_idx]:
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias)
    return SparseMoeBlock(
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        cfg.num_local_experts,
        cfg.num_experts_per_tok,
        cfg.router,
        cfg.hidden_act,
        shared_intermediate_size=cfg.shared_expert_intermediate_size,
        shared_gate=cfg.shared_expert_gate,
        correction_bias=cfg.router.topk_method == "noaux_tc",
        expert_ids=expert_ids,
    )


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h += attn(norm(h))`` (attention stage), ``h += ffn(norm(h))`` (FFN).

    The attention is GQA (`Attention`) or MLA (`MLAAttention`); the FFN a dense `GatedMLP` or
    a `SparseMoeBlock`, per layer as `ModelConfig.layer_is_moe` says.
    Each stage ends with the residual add fused with the next stage's norm where the CPU
    kernel serves (`add_and_prenorm`: the normed rows ride on the returned residual, and
    through the executor's concatenation and split of coalesced groups, `cat_prenormed` /
    `split_prenormed`; a stage that gets another tensor norms it itself, to the same bits).
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int, expert_ids: list[int] | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = _make_attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = _make_ffn(cfg, layer_idx, expert_ids)

    def attention_stage(
        self, h: torch.Tensor, meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        x = prenormed(h, self.input_layernorm)
        out = self.self_attn(x, meta, kv_cache)
        return add_and_prenorm(out, h, self.post_attention_layernorm)

    def ffn_stage(
        self,
        h: torch.Tensor,
        local_rows: torch.Tensor | None = None,
        next_norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        """``next_norm``: the next layer's input norm, fused with the residual add."""
        x = prenormed(h, self.post_attention_layernorm)
        out = self.mlp(x) if local_rows is None else self.mlp(x, local_rows)
        return add_and_prenorm(out, h, next_norm)


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head, as stage functions.

    Parameter names are this module's own; `batchgen.models.loader` maps checkpoint names onto
    them. With ``tie_word_embeddings`` the LM head shares ``embed_tokens.weight``.
    ``expert_ids``: the routed experts every MoE layer holds (logical ids; default all of them,
    an expert-parallel rank holds its shard).
    """

    def __init__(self, cfg: ModelConfig, expert_ids: list[int] | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, expert_ids) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [T]`` int64 -> ``[T, H]``."""
        return self.embed_tokens(input_ids)

    def attention_stage(
        self,
        layer: int,
        h: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        return self.layers[layer].attention_stage(h, meta, kv_cache)

    def ffn_stage(
        self, layer: int, h: torch.Tensor, local_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``h [T, H]`` -> ``[T, H]``; ``local_rows`` see `SparseMoeBlock.forward`."""
        following = layer + 1 < len(self.layers)
        next_norm = self.layers[layer + 1].input_layernorm if following else None
        return self.layers[layer].ffn_stage(h, local_rows, next_norm)

    def routed_expert_bytes(self) -> int:
        """Bytes of the routed expert parameters held (not counting the CPU kernel's packed
        copy, which doubles them once the kernel has run)."""
        return sum(
            p.numel() * p.element_size()
            for layer in self.layers
            if isinstance(layer.mlp, SparseMoeBlock)
            for p in (layer.mlp.w13_weight, layer.mlp.w2_weight)
        )

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """``h [B, H]`` (the rows to sample from) -> logits ``[B, V]`` float32."""
        return self.lm_head(self.norm(h)).float()

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """All stages in order (the lockstep path): ``input_ids [T]`` -> hidden ``[T, H]``."""
        h = self.embed(input_ids)
        for layer in range(self.num_layers):
            h = self.attention_stage(layer, h, meta, kv_caches[layer])
            h = self.ffn_stage(layer, h)
        return h
