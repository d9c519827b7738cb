"""Paged KV cache bookkeeping (pure Python, no torch): a reference-counted free-list block
allocator and per-sequence block tables (vLLM's `BlockPool` / `KVCacheManager.allocate_slots`).

Blocks are reference-counted so that the ``n`` samples of one request can share the KV blocks
of their common prompt (`KVCacheManager.share_prefix`); a block returns to the free list when
its last holder frees it."""

from __future__ import annotations

from collections import deque

from batchgen.engine.sequence import SequenceCoroutine


class BlockAllocator:
    """Hands out fixed-size KV blocks by id from a FIFO free list, with reference counts."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks. Raises RuntimeError when fewer are free (check first)."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, only {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Add a holder to each of ``blocks`` (which must be allocated)."""
        for b in blocks:
            if self._refs[b] < 1:
                raise RuntimeError(f"cannot share KV block {b}: it is free")
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one holder of each block; a block with no holder left becomes free."""
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
            elif self._refs[b] < 0:
                raise RuntimeError(f"KV block {b} freed more often than allocated")

    def ref_count(self, block: int) -> int:
        return self._refs[block]


class KVCacheManager:
    """Grows and frees sequences' block tables.

    ``block_size`` tokens per block; a sequence holding ``t`` tokens needs
    ``ceil(t / block_size)`` blocks.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, seq: SequenceCoroutine, num_new_tokens: int) -> bool:
        """Make room for positions up to ``num_computed_tokens + num_new_tokens``.

        Returns False (allocating nothing) when not enough blocks are free.
        """
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.allocator.num_free_blocks:
            return False
        seq.block_table.extend(self.allocator.allocate(need))
        return True

    def share_prefix(
        self, seq: SequenceCoroutine, source: SequenceCoroutine, num_tokens: int
    ) -> list[tuple[int, int]] | None:
        """Give ``seq`` (holding no blocks) the cached K/V of ``source``'s first
        ``num_tokens`` positions, which the two must have in common (samples of one prompt).

        Whole blocks are shared (reference counted); a partly filled last block is copied into
        a new block, since ``seq`` will write its own positions after ``num_tokens`` into it.
        Sets ``seq.num_computed_tokens = num_tokens``.

        Returns:
            The ``(src_block, dst_block)`` copies the model runner must make before the step
            runs (empty or one pair), or None when no block is free for the copy (nothing
            changed then).
        Raises:
            ValueError: ``seq`` already holds blocks or ``source`` holds fewer than needed.
        """
        if seq.block_table:
            raise ValueError("share_prefix: the sequence already holds KV blocks")
        full, partial = divmod(num_tokens, self.block_size)
        if len(source.block_table) < full + (1 if partial else 0):
            raise ValueError(
                f"share_prefix: source holds {len(source.block_table)} blocks, "
                f"{num_tokens} tokens need {self.blocks_needed(num_tokens)}"
            )
        if partial and self.allocator.num_free_blocks < 1:
            return None
        shared = source.block_table[:full]
        self.allocator.share(shared)
        seq.block_table = list(shared)
        copies = []
        if partial:
            dst = self.allocator.allocate(1)[0]
            seq.block_table.append(dst)
            copies.append((source.block_table[full], dst))
        seq.num_computed_tokens = num_tokens
        return copies

    def hand_over(self, seq: SequenceCoroutine, heir: SequenceCoroutine, num_tokens: int) -> bool:
        """Move the blocks of ``seq`` (finished) holding its first ``num_tokens`` positions to
        ``heir`` (holding no blocks; a sample of the same prompt), free the rest and set
        ``heir.num_computed_tokens = num_tokens``. No copy is needed: ``heir`` may overwrite the
        positions after ``num_tokens`` of the last kept block, which ``seq`` no longer reads.

        Returns False (nothing changed) when ``seq`` has not computed ``num_tokens`` positions
        or shares that last, partly filled block with another holder.
        """
        keep = self.blocks_needed(num_tokens)
        if heir.block_table or seq.num_computed_tokens < num_tokens or keep < 1:
            return False
        if num_tokens % self.block_size and self.allocator.ref_count(seq.block_table[keep - 1]) > 1:
            return False
        heir.block_table = seq.block_table[:keep]
        self.allocator.free(seq.block_table[keep:])
        seq.block_table = []
        heir.num_computed_tokens = num_tokens
        return True

    def free(self, seq: SequenceCoroutine) -> None:
        self.allocator.free(seq.block_table)
        seq.block_table = []

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, so that no K/V computed before now is reused (after a
        weight update; vLLM's ``reset_prefix_cache``, SGLang's ``flush_cache``).

        Returns False, changing nothing, while a sequence holds blocks. Blocks are shared
        only between the samples of one request and go back to the free list with their last
        holder, so once no block is held nothing cached is left: a prefix cache across
        requests (content-hashed blocks kept after their requests end) must drop its hashes
        here."""
        return self.num_free_blocks == self.num_blocks
