"""Turns a group of scheduled coroutines into flat tensors and attention metadata.

Owns the KV cache tensors: per layer a tuple of ``[num_blocks * block_size, *token_shape]``
tensors (key and value for GQA, latent and rope key for MLA: `kv_cache_token_shapes`).
"""

from __future__ import annotations

import math
from itertools import chain

import numpy as np
import torch

from batchgen.engine.host_allocator import advise_huge_pages
from batchgen.engine.host_staging import HostStaging
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
from batchgen.models.layers.kv_cache_dtype import write_kv
from batchgen.models.model_config import ModelConfig


def kv_cache_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of KV cache per token over all layers: ``2 * L * Hkv * D * itemsize`` for GQA,
    ``L * (kv_lora_rank + qk_rope_head_dim) * itemsize`` for MLA."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_layer = sum(math.prod(shape) for shape in kv_cache_token_shapes(cfg))
    return cfg.num_hidden_layers * per_layer * itemsize


# CPU: the most bytes one decode bucket gathers from one cache tensor (counted in the model's
# dtype when the cache is narrower: the torch path converts the gather to it). glibc serves larger
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
        staging: turns the step's host lists into device tensors (default `HostStaging` of
            ``device``: pinned buffers and asynchronous copies on CUDA, plain
            ``torch.tensor`` on CPU).
        kv_cache_dtype: the cache tensors' dtype (None: ``dtype``; a narrower one under
            ``kv_cache_dtype``, `batchgen.models.layers.kv_cache_dtype.resolve_kv_cache_dtype`).

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
        staging: HostStaging | None = None,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.staging = staging or HostStaging(device)
        self.dummy_block = num_blocks if reserve_dummy_block else None
        self.batch_invariant = batch_invariant
        self.device = device
        self.block_size = block_size
        cfg = model.config
        num_slots = (num_blocks + reserve_dummy_block) * block_size
        shapes = kv_cache_token_shapes(cfg)
        self.kv_cache_dtype = cache_dtype = kv_cache_dtype or dtype
        self.kv_caches = [
            tuple(_new_cache((num_slots, *s), cache_dtype, device) for s in shapes)
            for _ in range(cfg.num_hidden_layers)
        ]
        # Caches whose decode backend reads them in place (GQA: the CPU kernel, the Triton
        # kernel, `decode_attention_backend`; MLA: the Triton kernel, `mla_decode_backend`)
        # take all decode rows in one bucket. Otherwise (the torch paths) buckets bound each
        # gather.
        # GQA's decode backend, chosen once here (None for MLA); the step metadata carries it.
        self.decode_backend = (
            decode_attention_backend(device, dtype, cache_dtype) if cfg.mla is None else None
        )
        if cfg.mla is None:
            in_place = self.decode_backend != "torch"
        else:  # MLA's absorbed einsums around the kernel take a bucket's rows as one GEMM,
            # so the batch-invariant mode keeps one bucket per row
            in_place = mla_decode_backend(device, dtype) == "triton" and not batch_invariant
        self.decode_in_place = in_place
        # The torch path gathers a bucket and converts it to the model's dtype (a narrower
        # kv_cache_dtype): the bound is on the wider of the two, what is allocated and read.
        itemsize = max(dtype.itemsize, cache_dtype.itemsize)
        block_bytes = max(c[0].numel() * itemsize * block_size for c in self.kv_caches[0])
        self.max_bucket_blocks = (
            max(1, CPU_DECODE_GATHER_BYTES // block_bytes) if device.type == "cpu" else None
        )

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks ``src -> dst`` in every layer's cache tensors (a shared prompt's
        partly filled last block, see `KVCacheManager.share_prefix`)."""
        src = self.staging.to_device("copy_src", [c[0] for c in copies])
        dst = self.staging.to_device("copy_dst", [c[1] for c in copies])
        for layer in self.kv_caches:
            for cache in layer:
                blocks = as_blocks(cache, self.block_size)
                write_kv(blocks, dst, blocks.index_select(0, src))

    def prepare(
        self, scheduled: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, AttentionMetadata, list[ScheduledSeq], torch.Tensor]:
        """Flatten a step: decode tokens first (sorted by context length, cut into
        `DecodeBucket`s), then prefill chunks.

        Returns ``input_ids [T]``, the metadata, the scheduled entries in flat order, and
        ``sample_indices [B]`` (flat index of the last token of each entry that samples,
        in flat order). The per-row work is one pass over the entries reading a few
        attributes; everything else (slot mapping, padded block tables, the checks) is numpy
        over the whole step (`_DecodeRows`), and every tensor is built from those arrays
        through ``staging`` (one asynchronous copy per field on CUDA, none on CPU). The decode
        rows' context lengths and block ids are checked here, on the host, before any tensor
        is built (as `check_decode_context_lists`): the kernels skip their own check
        (``DecodeBucket.checked_num_blocks``), so the step does not sync with the host for it.

        Raises:
            ValueError: a decode row's block table that does not cover its context or holds a
                block id outside the cache (naming ``block_tables``).
        """
        bs = self.block_size
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        decodes.sort(key=_num_computed_tokens)  # stable: ties keep the scheduled order
        prefills = [s for s in scheduled if s.num_new_tokens > 1]
        ordered = decodes + prefills
        num_cache_blocks = self.kv_caches[0][0].shape[0] // bs
        rows = _DecodeRows(decodes, bs, num_cache_blocks)
        ids_parts, pos_parts, slot_parts = [rows.token_ids], [rows.positions], [rows.slots]
        sample_indices = np.flatnonzero(rows.samples)  # decode rows are one token each
        extra_samples: list[int] = []
        span_slots: list[np.ndarray] = []  # every prefill span's kv_slots, in order
        span_args: list[tuple[int, int, int]] = []
        token_start = len(decodes)
        for entry in prefills:
            seq, start = entry.seq, entry.seq.num_computed_tokens
            num_new = entry.num_new_tokens
            end = start + num_new
            table = np.asarray(seq.block_table, dtype=np.int64)
            kv_positions = np.arange(end, dtype=np.int64)  # a span attends to [0, end)
            kv_slots = table[kv_positions // bs] * bs + kv_positions % bs
            ids_parts.append(np.asarray(seq.token_ids_slice(start, end), dtype=np.int64))
            pos_parts.append(np.arange(start, end, dtype=np.int64))
            slot_parts.append(kv_slots[start:])
            if entry.samples_next_token:
                extra_samples.append(token_start + num_new - 1)
            span_slots.append(kv_slots)
            span_args.append((token_start, num_new, end))
            token_start += num_new
        if extra_samples:
            sample_indices = np.concatenate([sample_indices, np.array(extra_samples)])
        stage = self.staging
        meta = AttentionMetadata(
            positions=stage.array_to_device("positions", np.concatenate(pos_parts)),
            slot_mapping=stage.array_to_device("slot_mapping", np.concatenate(slot_parts)),
            num_decode_tokens=len(decodes),
            block_size=bs,
            decode_backend=self.decode_backend,
        )
        if span_args:
            # [sum kv_len], one copy
            all_slots = stage.array_to_device("kv_slots", np.concatenate(span_slots))
            offset = 0
            for token_start, num_tokens, kv_len in span_args:
                kv_slots = all_slots[offset : offset + kv_len]
                meta.prefills.append(PrefillSpan(token_start, num_tokens, kv_len, kv_slots))
                offset += kv_len
        num_blocks = rows.num_blocks
        if self.decode_in_place:  # the kernel reads each context in place: one bucket
            plan = [(0, len(decodes))] if decodes else []
        elif self.batch_invariant:
            plan = [(i, i + 1) for i in range(len(decodes))]
        else:
            plan = plan_decode_buckets(
                num_blocks.tolist(), max_bucket_blocks=self.max_bucket_blocks
            )
        for start, end in plan:
            width = int(num_blocks[end - 1])
            bucket = DecodeBucket(
                start,
                end,
                # [b, width], padded with block 0
                stage.array_to_device("block_tables", rows.block_tables[start:end, :width]),
                stage.array_to_device("kv_lens", rows.positions[start:end] + 1),  # [b]
            )
            bucket.checked_num_blocks = num_cache_blocks
            meta.decode_buckets.append(bucket)
        ids = stage.array_to_device("input_ids", np.concatenate(ids_parts))
        return ids, meta, ordered, stage.array_to_device("sample_indices", sample_indices)


def _num_computed_tokens(entry: ScheduledSeq) -> int:
    return entry.seq.num_computed_tokens


class _DecodeRows:
    """The decode rows of a step (``entries``: one new token each, sorted by context) as
    numpy arrays, built with one pass over the entries and vectorised arithmetic after it
    (vLLM's ``InputBatch`` keeps such arrays persistent; here the sequences' Python block
    tables stay the source of truth and are flattened once per step).

    Attributes (B = rows, W = the widest row's blocks):
        positions: ``[B]`` int64, each row's position (``num_computed_tokens``); its context
            length is ``positions + 1``.
        token_ids: ``[B]`` int64, the token at that position.
        samples: ``[B]`` bool, the row reaches its sequence's end (a token is sampled).
        num_blocks: ``[B]`` int64, ``ceil((positions + 1) / block_size)``.
        block_tables: ``[B, W]`` int64, each row's first ``num_blocks`` block ids, then 0.
        slots: ``[B]`` int64, the cache slot of each row's new token.

    Raises:
        ValueError: as `check_decode_context_lists`, for the first row that fails it.
    """

    def __init__(self, entries: list[ScheduledSeq], block_size: int, num_cache_blocks: int):
        b = len(entries)
        positions, tokens, samples, tables = [], [], [], []
        for entry in entries:
            seq = entry.seq
            pos = seq.num_computed_tokens
            prompt, output = seq.request.prompt_token_ids, seq.output_token_ids
            n_prompt = len(prompt)
            positions.append(pos)
            tokens.append(prompt[pos] if pos < n_prompt else output[pos - n_prompt])
            samples.append(pos + 1 == n_prompt + len(output))
            tables.append(seq.block_table)
        self.positions = np.array(positions, dtype=np.int64).reshape(b)
        self.token_ids = np.array(tokens, dtype=np.int64).reshape(b)
        self.samples = np.array(samples, dtype=bool).reshape(b)
        self.num_blocks = self.positions // block_size + 1
        lens = np.fromiter(map(len, tables), np.int64, b)
        longest = int(lens.max()) if b else 0
        flat = np.fromiter(chain.from_iterable(tables), np.int64, int(lens.sum()))
        full = np.zeros((b, longest), dtype=np.int64)
        full[np.arange(longest) < lens[:, None]] = flat  # row-major: each table in order
        width = int(self.num_blocks.max()) if b else 0
        tables_w = np.zeros((b, width), dtype=np.int64)
        covered = min(width, longest)
        tables_w[:, :covered] = full[:, :covered]
        tables_w[np.arange(width) >= self.num_blocks[:, None]] = 0  # past a row's context
        short = lens < self.num_blocks
        outside = ((tables_w < 0) | (tables_w >= num_cache_blocks)).any(axis=1)
        bad = np.flatnonzero(short | outside)
        if bad.size:
            i = int(bad[0])
            n = int(self.num_blocks[i])
            check_decode_context_lists([tables[i][:n]], [n], num_cache_blocks, first_row=i)
            raise AssertionError("unreachable: the row's check raises")  # pragma: no cover
        self.block_tables = tables_w
        rows = np.arange(b)
        if b:
            self.slots = (
                tables_w[rows, self.num_blocks - 1] * block_size + self.positions % block_size
            )
        else:
            self.slots = np.zeros(0, dtype=np.int64)


def check_decode_context_lists(
    tables: list[list[int]], num_blocks: list[int], num_cache_blocks: int, first_row: int = 0
) -> None:
    """`batchgen.kernels.paged_attention.check_decode_context` on the host lists a step is
    built from, so that the device never syncs for it: each decode row's block table
    ``tables[i]`` (its first ``num_blocks[i]`` entries, ``ceil(kv_len / block_size)``) must
    have ``num_blocks[i]`` entries, all in ``[0, num_cache_blocks)``. Context lengths are
    ``num_computed_tokens + 1 >= 1`` and the bucket width is the widest row's blocks by
    construction, so the kernels' other checks hold. ``first_row``: the step row of
    ``tables[0]`` (for the message).

    Raises:
        ValueError: naming ``block_tables``, the row, and what is wrong.
    """
    for i, (table, n) in enumerate(zip(tables, num_blocks, strict=True), start=first_row):
        if len(table) != n:
            raise ValueError(
                f"block_tables: decode row {i} needs {n} blocks for its context, "
                f"its block table has {len(table)}"
            )
        if table and (min(table) < 0 or max(table) >= num_cache_blocks):
            raise ValueError(
                f"block_tables: decode row {i} holds a block id outside [0, {num_cache_blocks})"
            )
