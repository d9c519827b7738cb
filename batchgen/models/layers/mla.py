"""Multi-head Latent Attention (DeepSeek-V2 paper, arXiv:2405.04434, section 2.1) over a paged
cache.

Shape legend: T = num_tokens, H = hidden_size, N = num_heads, C = kv_lora_rank,
Dn = qk_nope_head_dim, Dr = qk_rope_head_dim, Dq = Dn + Dr (qk_head_dim), Dv = v_head_dim,
B = decode sequences, L = context length.

Per token the cache holds only the normalised compressed latent ``c_kv [C]`` and the rotated
rope key ``k_pe [Dr]`` shared by all heads: ``C + Dr`` values instead of ``N * (Dq + Dv)`` for a
plain multi-head cache (DeepSeek-V3: 576 vs 40,960, 71x smaller; `MLADims.kv_bytes_per_token`).
Keys and values are rebuilt from the latent when attending:

    k_nope, v = split(kv_b_proj(c_kv))          # [L, N, Dn], [L, N, Dv]
    k = [k_nope, k_pe broadcast over heads]     # [L, N, Dq]
    q = [q_nope, rope(q_pe)]                    # [T, N, Dq]

Decode tokens use the "absorbed" form instead (DeepSeek-V2 paper section 2.1.2; DeepSeek-V3
``inference/model.py`` ``attn_impl="absorb"``): ``W_UK`` is folded into the query and ``W_UV``
into the output, so attention runs directly on the cached latent as multi-query attention with
one ``C + Dr`` wide key head and a ``C`` wide value head, and the context is never up-projected.
Per decode token that costs ``N * L * (2C + Dr)`` multiply-adds instead of ``L * C * N * (Dn + Dv)``
for the up-projection alone. Prefill chunks up-project (their queries are many, and the context is
mostly the chunk itself). Which implementation runs the absorbed decode (the torch path below,
or the Triton kernel reading the paged latent cache in place) is chosen by
`batchgen.models.layers.attention_backend.mla_decode_backend`.

Projections and the order of operations follow HF ``DeepseekV3Attention`` /
``DeepseekV2Attention`` (transformers 5) so that checkpoint names map 1:1 and fp32 outputs match.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.kernels.paged_attention import check_decode_context
from batchgen.kernels.triton_mla_decode import triton_mla_decode_attention
from batchgen.models.layers.attention import AttentionMetadata, DecodeBucket
from batchgen.models.layers.attention_backend import mla_decode_backend
from batchgen.models.layers.norm import RMSNorm
from batchgen.models.layers.rotary_yarn import ScaledRotaryEmbedding, deepseek_softmax_scale

if TYPE_CHECKING:
    from batchgen.models.model_config import ModelConfig


@dataclass(frozen=True)
class MLADims:
    """The head geometry of one MLA layer (HF `DeepseekV2Config` / `DeepseekV3Config` names).

    ``q_lora_rank`` None means a full-rank ``q_proj`` (DeepSeek-V2-Lite) instead of the
    ``q_a_proj -> q_a_layernorm -> q_b_proj`` low-rank query path.
    """

    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> dict[str, float]:
        """Per-token, per-layer KV-cache bytes of MLA vs the uncompressed multi-head layout.

        Returns ``{"mla": (C + Dr) * b, "mha": N * (Dq + Dv) * b, "ratio": mha / mla}``.
        DeepSeek-V3 in bf16: mla 1,152 B, mha 81,920 B, ratio 71.1.
        """
        mla = (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes
        mha = self.num_heads * (self.qk_head_dim + self.v_head_dim) * dtype_bytes
        return {"mla": float(mla), "mha": float(mha), "ratio": mha / mla}


class MLAAttention(nn.Module):
    """Multi-head Latent Attention with HF submodule names.

    Parameters (``N``, ``C``, ``Dq``, ``Dv`` as in the module legend):

    - ``q_proj.weight [N * Dq, H]`` when ``q_lora_rank`` is None, else
      ``q_a_proj.weight [q_lora_rank, H]`` (+ bias with ``attention_bias``),
      ``q_a_layernorm.weight [q_lora_rank]``, ``q_b_proj.weight [N * Dq, q_lora_rank]``;
    - ``kv_a_proj_with_mqa.weight [C + Dr, H]`` (+ bias with ``attention_bias``),
      ``kv_a_layernorm.weight [C]``, ``kv_b_proj.weight [N * (Dn + Dv), C]`` (per head: Dn
      key rows then Dv value rows);
    - ``o_proj.weight [H, N * Dv]`` (+ bias with ``attention_bias``).

    Both layer norms use eps 1e-6 whatever ``rms_norm_eps`` says: HF builds them as
    ``DeepseekV3RMSNorm(q_lora_rank)`` / ``DeepseekV3RMSNorm(kv_lora_rank)`` with the default eps.

    Args:
        rope_interleave: DeepSeek's interleaved rope layout. True for every DeepSeek-V2
            checkpoint (HF V2 always uses the complex-pair ``apply_rotary_emb``) and for V3 unless
            ``config.rope_interleave`` is False (its default is True).
        absorb_decode: attend decode tokens on the latent with ``kv_b_proj`` folded into the query
            and output (see module docstring); False up-projects the context like prefill does.
    """

    def __init__(
        self,
        hidden_size: int,
        dims: MLADims,
        rope_parameters: dict,
        max_position_embeddings: int,
        rope_interleave: bool = True,
        attention_bias: bool = False,
        absorb_decode: bool = True,
    ) -> None:
        super().__init__()
        self.dims = dims
        n, dq = dims.num_heads, dims.qk_head_dim
        self.absorb_decode = absorb_decode
        if dims.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, n * dq, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, dims.q_lora_rank, bias=attention_bias)
            self.q_a_layernorm = RMSNorm(dims.q_lora_rank)
            self.q_b_proj = nn.Linear(dims.q_lora_rank, n * dq, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            hidden_size, dims.kv_lora_rank + dims.qk_rope_head_dim, bias=attention_bias
        )
        self.kv_a_layernorm = RMSNorm(dims.kv_lora_rank)
        self.kv_b_proj = nn.Linear(
            dims.kv_lora_rank, n * (dims.qk_nope_head_dim + dims.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(n * dims.v_head_dim, hidden_size, bias=attention_bias)
        self.rotary_emb = ScaledRotaryEmbedding(
            dims.qk_rope_head_dim, rope_parameters, max_position_embeddings, rope_interleave
        )
        self.scale = deepseek_softmax_scale(dq, rope_parameters)

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> MLAAttention:
        """Build from a `ModelConfig` whose ``mla`` is set (``o_bias`` carries HF's
        ``attention_bias``)."""
        m = cfg.mla
        dims = MLADims(
            cfg.num_attention_heads,
            m.q_lora_rank,
            m.kv_lora_rank,
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
        )
        return cls(
            cfg.hidden_size,
            dims,
            cfg.rope_parameters,
            cfg.max_position_embeddings,
            rope_interleave=m.rope_interleave,
            attention_bias=cfg.o_bias,
        )

    @staticmethod
    def kv_cache_shapes(kv_lora_rank: int, qk_rope_head_dim: int) -> tuple[tuple[int], tuple[int]]:
        """Per-slot shapes of the layer's cache pair: ``((C,), (Dr,))``, i.e. the caller
        allocates ``latent_cache [num_slots, C]`` and ``rope_cache [num_slots, Dr]``."""
        return (kv_lora_rank,), (qk_rope_head_dim,)

    def forward(
        self,
        x: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """``x [T, H]`` -> ``[T, H]``.

        Args:
            meta: the step's layout (decode tokens first, then prefill chunks).
            kv_cache: ``(latent_cache [num_slots, C], rope_cache [num_slots, Dr])`` in x's dtype;
                this step's normalised latents and rotated rope keys are written at
                ``meta.slot_mapping`` before attending.
        """
        d = self.dims
        t = x.shape[0]
        if d.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, d.num_heads, d.qk_head_dim)  # [T, N, Dq]
        q_nope, q_pe = q.split([d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([d.kv_lora_rank, d.qk_rope_head_dim], -1)
        latent = self.kv_a_layernorm(latent)  # [T, C]
        q_pe, k_pe = self.rotary_emb(meta.positions, q_pe, k_pe[:, None, :])
        k_pe = k_pe[:, 0]  # [T, Dr]
        latent_cache, rope_cache = kv_cache
        latent_cache.index_copy_(0, meta.slot_mapping, latent)
        rope_cache.index_copy_(0, meta.slot_mapping, k_pe)

        out = x.new_empty(t, d.num_heads, d.v_head_dim)  # [T, N, Dv]
        attend = self._decode_absorbed if self.absorb_decode else self._decode_expanded
        backend = "torch"
        if meta.decode_buckets and self.absorb_decode and x.dtype == latent_cache.dtype:
            backend = mla_decode_backend(x.device, latent_cache.dtype)
        for bucket in meta.decode_buckets:
            rows = slice(bucket.start, bucket.end)
            if backend == "triton":  # attend straight from the paged latent cache
                out[rows] = self._decode_triton(q_nope[rows], q_pe[rows], kv_cache, meta, bucket)
                continue
            latent_ctx = bucket.gather(latent_cache, meta.block_size)  # [b, L, C]
            pe_ctx = bucket.gather(rope_cache, meta.block_size)  # [b, L, Dr]
            mask = meta.decode_mask(bucket, None)  # [b, 1, 1, L]
            out[rows] = attend(q_nope[rows], q_pe[rows], latent_ctx, pe_ctx, mask)
        q = torch.cat((q_nope, q_pe), dim=-1)  # [T, N, Dq]
        for span in meta.prefills:
            sl = slice(span.token_start, span.token_start + span.num_tokens)
            if span.is_first_chunk:
                ctx_latent, ctx_pe = latent[sl], k_pe[sl]  # [n, C], [n, Dr]
            else:
                ctx_latent = latent_cache.index_select(0, span.kv_slots)  # [L, C]
                ctx_pe = rope_cache.index_select(0, span.kv_slots)  # [L, Dr]
            k, v = self._expand_kv(ctx_latent, ctx_pe)  # [L, N, Dq], [L, N, Dv]
            causal = span.is_first_chunk
            # 4-D inputs: torch's CPU flash kernel takes only 4-D (see `paged_attention`).
            o = F.scaled_dot_product_attention(
                q[sl].transpose(0, 1)[None],  # [1, N, n, Dq]
                k.transpose(0, 1)[None],  # [1, N, L, Dq]
                v.transpose(0, 1)[None],  # [1, N, L, Dv]
                attn_mask=None if causal else span.mask(meta.positions[sl], None),
                is_causal=causal,
                scale=self.scale,
            )
            out[sl] = o[0].transpose(0, 1)  # [n, N, Dv]
        return self.o_proj(out.reshape(t, d.num_heads * d.v_head_dim))

    def _expand_kv(
        self, latent: torch.Tensor, k_pe: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Up-project ``latent [..., L, C]`` with ``kv_b_proj`` and join the shared ``k_pe
        [..., L, Dr]``: returns ``k [..., L, N, Dq]`` and ``v [..., L, N, Dv]`` (HF
        ``DeepseekV3Attention.expand_kv``)."""
        d = self.dims
        kv = self.kv_b_proj(latent).unflatten(-1, (d.num_heads, -1))  # [..., L, N, Dn + Dv]
        k_nope, v = kv.split([d.qk_nope_head_dim, d.v_head_dim], dim=-1)
        k_pe = k_pe.unsqueeze(-2).expand(*k_nope.shape[:-1], d.qk_rope_head_dim)  # [..., L, N, Dr]
        return torch.cat((k_nope, k_pe), dim=-1), v

    def _decode_expanded(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        k_pe: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Decode attention with the context up-projected: ``q_nope [B, N, Dn]``, ``q_pe [B, N,
        Dr]``, the gathered context ``latent [B, L, C]`` and ``k_pe [B, L, Dr]``, ``mask [B, 1,
        1, L]`` bool -> ``[B, N, Dv]``."""
        k, v = self._expand_kv(latent, k_pe)  # [B, L, N, Dq], [B, L, N, Dv]
        q = torch.cat((q_nope, q_pe), dim=-1)[:, :, None, :]  # [B, N, 1, Dq]
        o = F.scaled_dot_product_attention(
            q,
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            scale=self.scale,
        )
        return o[:, :, 0, :]  # [B, N, Dv]

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK [N, Dn, C]`` and ``W_UV [N, Dv, C]``: views of ``kv_b_proj.weight``."""
        d = self.dims
        w = self.kv_b_proj.weight.view(d.num_heads, d.qk_nope_head_dim + d.v_head_dim, -1)
        w_uk, w_uv = w.split([d.qk_nope_head_dim, d.v_head_dim], dim=1)
        return w_uk, w_uv

    def _decode_absorbed(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        k_pe: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Decode attention on the latent (``W_UK`` folded into q, ``W_UV`` into the output).

        ``q_nope . k_nope_j = q_nope . (W_UK c_j) = (W_UK^T q_nope) . c_j``, so with
        ``q_lat = W_UK^T q_nope [B, N, C]`` the scores are ``[q_lat, q_pe] . [c_j, k_pe_j]`` over
        one shared key head, and ``sum_j p_j W_UV c_j = W_UV (sum_j p_j c_j)``. Inputs as
        `_decode_expanded`; returns ``[B, N, Dv]``.
        """
        w_uk, w_uv = self._absorbed_weights()
        q_lat = torch.einsum("bnd,ndc->bnc", q_nope, w_uk)  # [B, N, C]
        o_lat = mla_decode_torch(q_lat, q_pe, latent, k_pe, mask, self.scale)  # [B, N, C]
        return torch.einsum("bnc,nvc->bnv", o_lat, w_uv)  # [B, N, Dv]

    def _decode_triton(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        bucket: DecodeBucket,
    ) -> torch.Tensor:
        """`_decode_absorbed` with the latent attention run by the Triton kernel on the paged
        cache in place (`triton_mla_decode_attention`): ``q_nope [b, N, Dn]``, ``q_pe [b, N,
        Dr]`` of the bucket's rows -> ``[b, N, Dv]``."""
        latent_cache, rope_cache = kv_cache
        num_blocks = latent_cache.shape[0] // meta.block_size
        if bucket.checked_num_blocks != num_blocks:  # the first layer of the step checks
            check_decode_context(bucket.block_tables, bucket.kv_lens, meta.block_size, num_blocks)
            bucket.checked_num_blocks = num_blocks
        w_uk, w_uv = self._absorbed_weights()
        q_lat = torch.einsum("bnd,ndc->bnc", q_nope, w_uk).contiguous()  # [b, N, C]
        o_lat = torch.empty_like(q_lat)  # [b, N, C]
        triton_mla_decode_attention(
            q_lat,
            q_pe.contiguous(),
            latent_cache,
            rope_cache,
            bucket.block_tables,
            bucket.kv_lens,
            meta.block_size,
            self.scale,
            o_lat,
            context_checked=True,
        )
        return torch.einsum("bnc,nvc->bnv", o_lat, w_uv)  # [b, N, Dv]


def mla_decode_torch(
    q_nope_absorbed: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The torch absorbed decode on gathered latents, the oracle of the Triton kernel
    (`triton_mla_decode_attention`).

    Args:
        q_nope_absorbed: ``[B, N, C]`` (``W_UK^T q_nope``); q_pe: ``[B, N, Dr]`` rotated.
        latent: ``[B, L, C]`` gathered latents; k_pe: ``[B, L, Dr]`` gathered rope keys; same
            dtype as the queries.
        mask: ``[B, 1, 1, L]`` bool, True where a position is visible.
        scale: softmax scale.
    Returns:
        ``[B, N, C]`` in the queries' dtype: ``softmax((q_lat . c_j + q_pe . k_pe_j) * scale)``
        weighted latents (DeepSeek-V2 paper section 2.1.2).
    """
    q = torch.cat((q_nope_absorbed, q_pe), dim=-1)  # [B, N, C + Dr]
    k = torch.cat((latent, k_pe), dim=-1)  # [B, L, C + Dr]: one key head shared by all N
    # Heads are the rows of one GEMM per sequence (no per-head copy of the key, unlike SDPA's
    # grouped-query path); softmax in float32 as in HF's eager attention.
    scores = torch.bmm(q, k.transpose(1, 2)).float() * scale  # [B, N, L]
    scores.masked_fill_(~mask[:, 0], float("-inf"))  # mask [B, 1, L]
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.bmm(probs, latent)  # [B, N, C]
