"""Turns a group of scheduled coroutines into flat tensors and attention metadata.

Owns the KV cache tensors: per layer a tuple of ``[num_blocks * block_size, *token_shape]``
tensors (key and value for GQA, latent and rope key for MLA: `kv_cache_token_shapes`).
"""

from __future__ import annotations

import math

import torch

from batchgen.engine.scheduler import ScheduledSeq
from batchgen.models.decoder import CausalLM, kv_cache_token_shapes
from batchgen.models.layers.attention import AttentionMetadata, PrefillSpan
from batchgen.models.model_config import ModelConfig


def kv_cache_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of KV cache per token over all layers: ``2 * L * Hkv * D * itemsize`` for GQA,
    ``L * (kv_lora_rank + qk_rope_head_dim) * itemsize`` for MLA."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_layer = sum(math.prod(shape) for shape in kv_cache_token_shapes(cfg))
    return cfg.num_hidden_layers * per_layer * itemsize


class ModelRunner:
    """Executes one engine step on the device.

    Args:
        model: the loaded model.
        num_blocks: KV cache blocks; block_size: tokens per block.
    """

    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        cfg = model.config
        num_slots = num_blocks * block_size
        shapes = kv_cache_token_shapes(cfg)
        self.kv_caches = [
            tuple(torch.zeros((num_slots, *s), dtype=dtype, device=device) for s in shapes)
            for _ in range(cfg.num_hidden_layers)
        ]

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def prepare(
        self, scheduled: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, AttentionMetadata, list[ScheduledSeq], torch.Tensor]:
        """Flatten a step: decode tokens first, then prefill chunks.

        Returns ``input_ids [T]``, the metadata, the scheduled entries in flat order, and
        ``sample_indices [B]`` (flat index of the last token of each entry that samples,
        in flat order).
        """
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
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
            prefills=spans,
        )
        if decodes:
            kv_lens = [s.seq.num_computed_tokens + 1 for s in decodes]
            max_blocks = max(len(s.seq.block_table) for s in decodes)
            tables = torch.tensor(
                [s.seq.block_table + [0] * (max_blocks - len(s.seq.block_table)) for s in decodes],
                dtype=torch.long,
                device=dev,
            )  # [B, max_blocks]
            max_len = max(kv_lens)
            pos = torch.arange(max_len, device=dev)
            meta.decode_kv_slots = tables[:, pos // self.block_size] * self.block_size + (
                pos % self.block_size
            )  # [B, max_len]
            meta.decode_kv_lens = torch.tensor(kv_lens, dtype=torch.long, device=dev)
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        return ids, meta, ordered, torch.tensor(sample_indices, dtype=torch.long, device=dev)
