"""Turns a group of scheduled coroutines into flat tensors and attention metadata.

Owns the KV cache tensors: per layer a tuple of ``[num_blocks * block_size, *token_shape]``
tensors (key and value for GQA, latent and rope key for MLA: `kv_cache_token_shapes`).
"""

from __future__ import annotations

import math

import torch

from batchgen.engine.host_allocator import advise_huge_pages
from batchgen.engine.scheduler import ScheduledSeq
from batchgen.models.decoder import CausalLM, kv_cache_token_shapes
from batchgen.models.layers.attention import (
    AttentionMetadata,
    DecodeBucket,
    PrefillSpan,
    as_blocks,
    plan_decode_buckets,
)
from batchgen.models.layers.attention_backend import decode_attention_backend, mla_decode_backend
from batchgen.models.model_config import ModelConfig


def kv_cache_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of KV cache per token over all layers: ``2 * L * Hkv * D * itemsize`` for GQA,
    ``L * (kv_lora_rank + qk_rope_head_dim) * itemsize`` for MLA."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_layer = sum(math.prod(shape) for shape in kv_cache_token_shapes(cfg))
    return cfg.num_hidden_layers * per_layer * itemsize


# CPU: the most bytes one decode bucket gathers from one cache tensor. glibc serves larger
# allocations with fresh mmap pages (page faults and zeroing on every gather: 117 MB took 74 ms
# against 16 ms into reused memory), and a smaller gather is still in cache when attention reads
# it. Measured on 512 decode rows x 448 positions (2 KV heads x 64, fp32): 224 ms per layer
# in one bucket, 90 ms in buckets of <= 29 MB. GPUs gather in one bucket (None).
CPU_DECODE_GATHER_BYTES = 16 << 20


def _new_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV cache tensor; on CPU backed by transparent huge pages where the OS gives
    them (`advise_huge_pages`: decode attention reads blocks scattered over the whole cache)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    cache = torch.empty(shape, dtype=dtype)
    advise_huge_pages(cache)
    return cache.zero_()


class ModelRunner:
    """Executes one engine step on the device.

    Args:
        model: the loaded model.
        num_blocks: KV cache blocks; block_size: tokens per block.
        batch_invariant: where decode attention runs on the torch path (MLA, or the kernel
            unavailable) or MLA runs the Triton kernel, one bucket per decode row, so a row's
            gathered context length and the shapes of its attention GEMMs depend only on its
            own context (`EngineConfig.batch_invariant`).
        reserve_dummy_block: allocate one KV block past ``num_blocks`` that no sequence owns,
            ``dummy_block``: a CUDA graph's padding rows write their K/V there
            (`batchgen.engine.cuda_graphs`). None without it.

    Attributes:
        decode_backend: GQA's decode attention backend (`decode_attention_backend`), chosen
            here once and carried by every step's `AttentionMetadata`; None for MLA.
    """

    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        batch_invariant: bool = False,
        reserve_dummy_block: bool = False,
    ) -> None:
        self.model = model
        self.dummy_block = num_blocks if reserve_dummy_block else None
        self.batch_invariant = batch_invariant
        self.device = device
        self.block_size = block_size
        cfg = model.config
        num_slots = (num_blocks + reserve_dummy_block) * block_size
        shapes = kv_cache_token_shapes(cfg)
        self.kv_caches = [
            tuple(_new_cache((num_slots, *s), dtype, device) for s in shapes)
            for _ in range(cfg.num_hidden_layers)
        ]
        # Caches whose decode backend reads them in place (GQA: the CPU kernel, the Triton
        # kernel, `decode_attention_backend`; MLA: the Triton kernel, `mla_decode_backend`)
        # take all decode rows in one bucket. Otherwise (the torch paths) buckets bound each
        # gather.
        # GQA's decode backend, chosen once here (None for MLA); the step metadata carries it.
        self.decode_backend = decode_attention_backend(device, dtype) if cfg.mla is None else None
        if cfg.mla is None:
            in_place = self.decode_backend != "torch"
        else:  # MLA's absorbed einsums around the kernel take a bucket's rows as one GEMM,
            # so the batch-invariant mode keeps one bucket per row
            in_place = mla_decode_backend(device, dtype) == "triton" and not batch_invariant
        self.decode_in_place = in_place
        block_bytes = max(c[0].numel() * c.element_size() * block_size for c in self.kv_caches[0])
        self.max_bucket_blocks = (
            max(1, CPU_DECODE_GATHER_BYTES // block_bytes) if device.type == "cpu" else None
        )

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks ``src -> dst`` in every layer's cache tensors (a shared prompt's
        partly filled last block, see `KVCacheManager.share_prefix`)."""
        src = torch.tensor([c[0] for c in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.long, device=self.device)
        for layer in self.kv_caches:
            for cache in layer:
                blocks = as_blocks(cache, self.block_size)
                blocks.index_copy_(0, dst, blocks.index_select(0, src))

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def prepare(
        self, scheduled: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, AttentionMetadata, list[ScheduledSeq], torch.Tensor]:
        """Flatten a step: decode tokens first (sorted by context length, cut into
        `DecodeBucket`s), then prefill chunks.

        Returns ``input_ids [T]``, the metadata, the scheduled entries in flat order, and
        ``sample_indices [B]`` (flat index of the last token of each entry that samples,
        in flat order).
        """
        bs = self.block_size
        decodes = sorted(
            (s for s in scheduled if s.num_new_tokens == 1),
            key=lambda s: s.seq.num_computed_tokens,
        )
        prefills = [s for s in scheduled if s.num_new_tokens > 1]
        ordered = decodes + prefills
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        sample_indices: list[int] = []
        spans: list[PrefillSpan] = []
        for entry in ordered:
            seq, start = entry.seq, entry.seq.num_computed_tokens
            end = start + entry.num_new_tokens
            token_start = len(input_ids)
            input_ids.extend(seq.token_ids_slice(start, end))
            positions.extend(range(start, end))
            slot_mapping.extend(self._slots(seq.block_table, start, end))
            if entry.samples_next_token:
                sample_indices.append(len(input_ids) - 1)
            if entry.num_new_tokens > 1:
                kv_slots = (
                    slot_mapping[-entry.num_new_tokens :]
                    if start == 0
                    else self._slots(seq.block_table, 0, end)
                )
                spans.append(
                    PrefillSpan(
                        token_start,
                        entry.num_new_tokens,
                        end,
                        torch.tensor(kv_slots, device=self.device),
                    )
                )
        dev = self.device
        meta = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=dev),
            num_decode_tokens=len(decodes),
            block_size=bs,
            prefills=spans,
            decode_backend=self.decode_backend,
        )
        kv_lens = [s.seq.num_computed_tokens + 1 for s in decodes]
        num_blocks = [-(-n // bs) for n in kv_lens]
        if self.decode_in_place:  # the kernel reads each context in place: one bucket
            plan = [(0, len(decodes))] if decodes else []
        elif self.batch_invariant:
            plan = [(i, i + 1) for i in range(len(decodes))]
        else:
            plan = plan_decode_buckets(num_blocks, max_bucket_blocks=self.max_bucket_blocks)
        for start, end in plan:
            width = num_blocks[end - 1]
            tables = [
                s.seq.block_table[:n] + [0] * (width - n)
                for s, n in zip(decodes[start:end], num_blocks[start:end])
            ]
            meta.decode_buckets.append(
                DecodeBucket(
                    start,
                    end,
                    torch.tensor(tables, dtype=torch.long, device=dev),  # [b, width]
                    torch.tensor(kv_lens[start:end], dtype=torch.long, device=dev),
                )
            )
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        return ids, meta, ordered, torch.tensor(sample_indices, dtype=torch.long, device=dev)
