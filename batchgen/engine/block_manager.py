"""Paged KV cache bookkeeping (pure Python, no torch): a free-list block allocator and
per-sequence block tables (vLLM's `BlockPool` / `KVCacheManager.allocate_slots`)."""

from __future__ import annotations

from collections import deque

from batchgen.engine.sequence import SequenceCoroutine


class BlockAllocator:
    """Hands out fixed-size KV blocks by id from a FIFO free list."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks. Raises RuntimeError when fewer are free (check first)."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, only {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)


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

    def free(self, seq: SequenceCoroutine) -> None:
        self.allocator.free(seq.block_table)
        seq.block_table = []
