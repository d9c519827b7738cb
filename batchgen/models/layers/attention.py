"""Grouped-query attention over a paged KV cache.

Tokens are flat: a step's ``num_tokens`` query tokens from many sequences are concatenated,
decode tokens first (one per decoding sequence), then the prefill chunks. Batch structure lives
in `AttentionMetadata`, never in a padded batch dimension of the activations.

The KV cache of one layer is a pair of tensors ``[num_slots, num_kv_heads, head_dim]`` with
``num_slots = num_blocks * block_size``; slot ``block_table[p // block_size] * block_size +
p % block_size`` holds position ``p`` of a sequence (vLLM's `slot_mapping` convention).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.kernels.paged_attention import check_decode_context, paged_decode_attention
from batchgen.kernels.prefill_attention import (
    build_prefill_plan,
    paged_prefill_attention,
    use_prefill_kernel,
)
from batchgen.kernels.triton_paged_attention import triton_paged_decode_attention
from batchgen.models.layers.attention_backend import decode_attention_backend
from batchgen.models.layers.kv_cache_dtype import quantize_kv, write_kv
from batchgen.models.layers.norm import RMSNorm
from batchgen.models.layers.rotary import RotaryEmbedding


@dataclass
class PrefillSpan:
    """One sequence's prefill chunk inside the flat token batch.

    Attributes:
        token_start: index of the chunk's first token in the flat batch.
        num_tokens: chunk length (query tokens).
        kv_len: context length after this chunk (``num_computed_tokens + num_tokens``).
        kv_slots: ``[kv_len]`` int64 cache slots of positions ``0 .. kv_len-1``.
    """

    token_start: int
    num_tokens: int
    kv_len: int
    kv_slots: torch.Tensor
    _masks: dict = field(default_factory=dict, repr=False)

    @property
    def is_first_chunk(self) -> bool:
        return self.kv_len == self.num_tokens

    def mask(self, q_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
        """``[num_tokens, kv_len]`` bool, built once per step and shared by all layers."""
        if sliding_window not in self._masks:
            kv_pos = torch.arange(self.kv_len, device=q_pos.device)
            self._masks[sliding_window] = _window_mask(q_pos, kv_pos, self.kv_len, sliding_window)
        return self._masks[sliding_window]


@dataclass
class DecodeBucket:
    """Decode rows ``[start, end)`` of the flat batch whose contexts are gathered to one padded
    length, ``block_tables.shape[1] * block_size`` positions.

    Decode tokens are sorted by context length and cut into buckets so that padding stays
    small (see `plan_decode_buckets`); each bucket gathers whole KV blocks (one contiguous
    ``block_size`` row run per block, much faster than gathering slot by slot) and runs one
    attention call.

    Attributes:
        start / end: rows of the flat batch (within the first ``num_decode_tokens``).
        block_tables: ``[b, n]`` int64 block ids, padded with block 0 past each context.
        kv_lens: ``[b]`` int64 context lengths including the new token.
    """

    start: int
    end: int
    block_tables: torch.Tensor
    kv_lens: torch.Tensor
    _masks: dict = field(default_factory=dict, repr=False)
    # Cache blocks the decode kernel's `check_decode_context` passed for, once per step.
    checked_num_blocks: int | None = field(default=None, repr=False)

    def mask(
        self, positions: torch.Tensor, block_size: int, sliding_window: int | None
    ) -> torch.Tensor:
        """``[b, 1, 1, n * block_size]`` bool (``positions`` the bucket's ``[b]`` query
        positions), built once per step and shared by all layers."""
        if sliding_window not in self._masks:
            length = self.block_tables.shape[1] * block_size
            kv_pos = torch.arange(length, device=positions.device)
            mask = _window_mask(positions[:, None], kv_pos, self.kv_lens, sliding_window)
            self._masks[sliding_window] = mask[:, None]  # [b, 1, 1, L]
        return self._masks[sliding_window]

    def gather(self, cache: torch.Tensor, block_size: int) -> torch.Tensor:
        """Rows of ``cache [num_slots, *S]`` for the bucket's blocks: ``[b, n * block_size,
        *S]`` (positions past a context hold whatever block 0 holds; the mask hides them)."""
        b, n = self.block_tables.shape
        out = as_blocks(cache, block_size).index_select(0, self.block_tables.reshape(-1))
        return out.view(b, n * block_size, *cache.shape[1:])


def as_blocks(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """View a cache tensor ``[num_slots, *S]`` as ``[num_blocks, block_size * prod(S)]``: one
    contiguous row per KV block (no copy)."""
    return cache.view(-1, block_size * cache[0].numel())


def plan_decode_buckets(
    num_blocks: list[int], max_waste: float = 1.5, max_bucket_blocks: int | None = None
) -> list[tuple[int, int]]:
    """Cut decode rows, sorted by ascending context blocks, into ``(start, end)`` buckets.

    A bucket grows while its largest context is at most ``max_waste`` times its smallest (plus
    one block), so the gathered padding is bounded by about a third of the gather while the
    number of attention calls grows only with log(max context / min context). With
    ``max_bucket_blocks``, a bucket also stops before ``rows * widest context`` would exceed
    that many blocks (bounds the bytes one gather writes; a single row always fits).
    """
    buckets: list[tuple[int, int]] = []
    start = 0
    for i, n in enumerate(num_blocks):
        too_long = n > num_blocks[start] * max_waste + 1
        too_big = max_bucket_blocks is not None and (i - start + 1) * n > max_bucket_blocks
        if i > start and (too_long or too_big):
            buckets.append((start, i))
            start = i
    if num_blocks:
        buckets.append((start, len(num_blocks)))
    return buckets


@dataclass
class AttentionMetadata:
    """Per-step batch layout shared by every attention layer.

    Attributes:
        positions: ``[num_tokens]`` int64 absolute positions.
        slot_mapping: ``[num_tokens]`` int64 cache slot where each token's K/V is written.
        num_decode_tokens: the first ``num_decode_tokens`` tokens are single-token decodes.
        decode_buckets: those decode rows, cut into buckets of similar context length.
        block_size: tokens per KV block (the cache is ``[num_blocks * block_size, ...]``).
        prefills: the prefill chunks that follow the decode tokens.
        rope_cache: the rotary cos/sin at ``positions``, computed by the first layer and
            reused by the others (`RotaryEmbedding.forward`'s ``cache``).
        decode_backend: the decode attention backend for this cache, chosen once when the
            model runner starts (`ModelRunner.decode_backend`); None: every layer asks
            `decode_attention_backend` (an environment read and checks per call).
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    num_decode_tokens: int = 0
    decode_buckets: list[DecodeBucket] = field(default_factory=list)
    block_size: int = 1
    prefills: list[PrefillSpan] = field(default_factory=list)
    rope_cache: dict = field(default_factory=dict, repr=False)
    # The prefill spans packed for the CPU prefill kernel, built by the first layer of the step.
    prefill_plan: object = field(default=None, repr=False)
    decode_backend: str | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def decode_mask(self, bucket: DecodeBucket, sliding_window: int | None) -> torch.Tensor:
        """The bucket's ``[b, 1, 1, L]`` bool mask."""
        positions = self.positions[bucket.start : bucket.end]
        return bucket.mask(positions, self.block_size, sliding_window)


def _window_mask(
    q_pos: torch.Tensor,
    kv_pos: torch.Tensor,
    kv_len: torch.Tensor | int,
    sliding_window: int | None,
) -> torch.Tensor:
    """Boolean mask ``[..., q, kv]``: key j visible to query i iff ``j <= pos_i`` and
    ``j < kv_len`` (and ``pos_i - j < sliding_window`` when set, HF's sliding-window rule)."""
    mask = kv_pos[..., None, :] <= q_pos[..., :, None]
    if isinstance(kv_len, torch.Tensor):
        mask = mask & (kv_pos[..., None, :] < kv_len[..., None, None])
    if sliding_window is not None:
        mask = mask & (q_pos[..., :, None] - kv_pos[..., None, :] < sliding_window)
    return mask


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    kv_written: bool = False,
) -> torch.Tensor:
    """Write ``k, v`` to the cache (unless ``kv_written``: the caller already did, e.g.
    `RotaryEmbedding.rotate_and_cache_`), then attend.

    Args:
        q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]`` (Hq a multiple of Hkv: grouped-query attention).
        kv_cache: (key cache, value cache), each ``[num_slots, Hkv, D]``, of k's dtype or a
            narrower one (``kv_cache_dtype``, `batchgen.models.layers.kv_cache_dtype`): then
            k and v are quantised on the write and every attention, the prompt's own chunk
            included, reads the quantised values.
        meta: the step's layout (decode tokens first, then prefill chunks).
        scale: softmax scale, usually ``D ** -0.5``.
    Returns:
        ``[T, Hq, D]`` attention output.

    Decode rows run the backend `decode_attention_backend` picks (the CPU kernel or the Triton
    kernel reading the cache in place, or the torch gather + SDPA); prefill chunks run the CPU
    prefill kernel where `use_prefill_kernel` says so (reading the cache in place), else SDPA.
    """
    k_cache, v_cache = kv_cache
    mixed = k_cache.dtype != q.dtype  # a narrower cache: kv_cache_dtype
    if mixed:  # written here (the fused RoPE + cache write serves one dtype only)
        kq, vq = quantize_kv(k, k_cache.dtype), quantize_kv(v, v_cache.dtype)
        write_kv(k_cache, meta.slot_mapping, kq)
        write_kv(v_cache, meta.slot_mapping, vq)
    elif not kv_written:
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    backend = "torch"
    if meta.decode_buckets:
        backend = meta.decode_backend or decode_attention_backend(
            q.device, q.dtype, k_cache.dtype
        )
    kernel = {"cpu_kernel": paged_decode_attention, "triton": triton_paged_decode_attention}
    for bucket in meta.decode_buckets:
        rows = slice(bucket.start, bucket.end)
        if backend != "torch":  # attend straight from the paged cache
            num_blocks = k_cache.shape[0] // meta.block_size
            if bucket.checked_num_blocks != num_blocks:  # the first layer of the step checks
                check_decode_context(
                    bucket.block_tables, bucket.kv_lens, meta.block_size, num_blocks
                )
                bucket.checked_num_blocks = num_blocks
            kernel[backend](
                q[rows],
                k_cache,
                v_cache,
                bucket.block_tables,
                bucket.kv_lens,
                meta.block_size,
                scale,
                sliding_window,
                out[rows],
                context_checked=True,
            )
            continue
        kd = bucket.gather(k_cache, meta.block_size).to(q.dtype).transpose(1, 2)  # [b, Hkv, L, D]
        vd = bucket.gather(v_cache, meta.block_size).to(q.dtype).transpose(1, 2)
        b, hkv = kd.shape[0], kd.shape[1]
        # The Hq / Hkv query heads that share a KV head are that head's query rows: one
        # [G, L] score block per (sequence, KV head) instead of G separate [1, L] rows
        # (query head h reads KV head h // G, HF's `repeat_kv` order).
        od = F.scaled_dot_product_attention(
            q[rows].view(b, hkv, -1, q.shape[-1]),  # [b, Hkv, G, D]
            kd,
            vd,
            attn_mask=meta.decode_mask(bucket, sliding_window),  # [b, 1, 1, L]
            scale=scale,
        )
        out[rows] = od.reshape(b, -1, q.shape[-1])
    if meta.prefills and use_prefill_kernel(q.device, q.dtype, q.shape[-1], k_cache.dtype):
        if meta.prefill_plan is None or meta.prefill_plan.num_slots != k_cache.shape[0]:
            meta.prefill_plan = build_prefill_plan(meta.prefills, q.shape[0], k_cache.shape[0])
        paged_prefill_attention(q, k_cache, v_cache, meta.prefill_plan, scale, sliding_window, out)
        return out
    if mixed and meta.prefills:  # SDPA's first chunks attend to what the cache now holds
        k, v = kq.to(q.dtype), vq.to(q.dtype)
    for span in meta.prefills:
        sl = slice(span.token_start, span.token_start + span.num_tokens)
        # 4-D [1, H, n, D] inputs: torch's CPU flash kernel takes only 4-D; 3-D inputs fall
        # back to the math path (5.4 vs 22 ms for a 512-token chunk, 8 heads of 64, 2 cores).
        qs = q[sl].transpose(0, 1)[None]  # [1, Hq, n, D]
        if span.is_first_chunk:
            ks, vs = k[sl].transpose(0, 1)[None], v[sl].transpose(0, 1)[None]  # [1, Hkv, n, D]
        else:
            ks = k_cache.index_select(0, span.kv_slots).to(q.dtype).transpose(0, 1)[None]
            vs = v_cache.index_select(0, span.kv_slots).to(q.dtype).transpose(0, 1)[None]
        if span.is_first_chunk and sliding_window is None:
            os_ = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            mask = span.mask(meta.positions[sl], sliding_window)
            os_ = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True
            )
        out[sl] = os_[0].transpose(0, 1)
    return out


class Attention(nn.Module):
    """Multi-head attention with grouped-query KV heads, a fused QKV projection and RoPE.

    Covers Llama / Mistral / Qwen2 / Mixtral / Qwen-MoE / OLMoE: ``qkv_bias`` (Qwen2),
    ``o_bias`` (Llama's ``attention_bias``), ``num_kv_heads`` from 1 (multi-query) to
    ``num_heads``, ``qk_norm`` "head" (Qwen3: RMSNorm over each head's ``head_dim``) or "full"
    (OLMoE: RMSNorm over the whole q and k projections), ``clip_qkv`` (OLMoE: clamp q, k, v).
    Weights: ``qkv_proj.weight [(Hq + 2*Hkv) * D, hidden]``, ``o_proj.weight [hidden, Hq * D]``,
    ``q_norm.weight`` / ``k_norm.weight``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rope_parameters: dict,
        qkv_bias: bool = False,
        o_bias: bool = False,
        sliding_window: int | None = None,
        qk_norm: str | None = None,
        clip_qkv: float | None = None,
        rms_norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_sizes = [self.q_size, self.kv_size, self.kv_size]  # qkv_proj's output columns
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        self.qk_norm, self.clip_qkv = qk_norm, clip_qkv
        self.qkv_proj = nn.Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, hidden_size, bias=o_bias)
        self.rotary_emb = RotaryEmbedding(head_dim, rope_parameters)
        if qk_norm == "head":
            self.q_norm = RMSNorm(head_dim, rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, rms_norm_eps)
        elif qk_norm == "full":
            self.q_norm = RMSNorm(self.q_size, rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_size, rms_norm_eps)
        elif qk_norm is not None:
            raise ValueError(f"qk_norm must be None, 'head' or 'full', got {qk_norm!r}")

    def forward(
        self,
        x: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        # split_with_sizes directly: Tensor.split's Python wrapper costs ~2 us a layer call
        q, k, v = qkv.split_with_sizes(self.qkv_sizes, -1)
        if self.qk_norm == "full":  # OLMoE: norm, then clip (HF `OlmoeAttention`)
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q = q.clamp(-self.clip_qkv, self.clip_qkv)
            k = k.clamp(-self.clip_qkv, self.clip_qkv)
            v = v.clamp(-self.clip_qkv, self.clip_qkv)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":  # Qwen3: per-head norm before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        # RoPE and the KV cache write in one CPU kernel pass where it serves, else apart
        written = self.rotary_emb.rotate_and_cache_(
            meta.positions, q, k, v, meta.rope_cache, kv_cache, meta.slot_mapping
        )
        if not written:
            q, k = self.rotary_emb(meta.positions, q, k, meta.rope_cache, inplace=True)
        o = paged_attention(q, k, v, kv_cache, meta, self.scale, self.sliding_window, written)
        return self.o_proj(o.reshape(t, self.q_size))
