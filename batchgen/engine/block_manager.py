"""Paged KV cache bookkeeping (pure Python, no torch): a reference-counted free-list block
allocator and per-sequence block tables (vLLM's `BlockPool` / `KVCacheManager.allocate_slots`).

Blocks are reference-counted so that the ``n`` samples of one request can share the KV blocks
of their common prompt (`KVCacheManager.share_prefix`), and so that requests can share cached
prefixes (`batchgen.engine.prefix_cache`, with ``enable_caching``); a block returns to the free
list when its last holder frees it, or to the cache's LRU pool when its content is registered.
"""

from __future__ import annotations

from collections import deque

from batchgen.engine.prefix_cache import PrefixCache, block_hashes
from batchgen.engine.sequence import SequenceCoroutine


class BlockAllocator:
    """Hands out fixed-size KV blocks by id from a FIFO free list, with reference counts.

    With a ``cache``, a freed block whose content is registered goes to the cache's LRU pool
    instead of the free list; it still counts as free, and `allocate` evicts from the pool
    only when the free list is empty.
    """

    def __init__(self, num_blocks: int, cache: PrefixCache | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.cache = cache
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no one holds: the free list plus the cache's evictable blocks."""
        return len(self._free) + (self.cache.num_evictable if self.cache is not None else 0)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks, plain free ones first, then evicting cached ones (least recently
        freed first). Raises RuntimeError when fewer are free (check first)."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} KV blocks, only {self.num_free_blocks} free")
        blocks = [self._free.popleft() if self._free else self.cache.evict() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def touch(self, blocks: list[int]) -> None:
        """Add a holder to each of ``blocks``, cached ones that may be free (a cache hit):
        a free one leaves the LRU pool."""
        for b in blocks:
            if self._refs[b] == 0:
                self.cache.unpark(b)
            self._refs[b] += 1

    def share(self, blocks: list[int]) -> None:
        """Add a holder to each of ``blocks`` (which must be allocated)."""
        for b in blocks:
            if self._refs[b] < 1:
                raise RuntimeError(f"cannot share KV block {b}: it is free")
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one holder of each block; a block with no holder left becomes free (a cached
        one evictable). With a cache, blocks are released last first, so a sequence's tail
        is evicted before its head."""
        for b in reversed(blocks) if self.cache is not None else blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if self.cache is not None and self.cache.is_cached(b):
                    self.cache.park(b)
                else:
                    self._free.append(b)
            elif self._refs[b] < 0:
                raise RuntimeError(f"KV block {b} freed more often than allocated")

    def uncache_free_blocks(self) -> None:
        """Drop every hash; evictable blocks become plain free blocks."""
        if self.cache is not None:
            self._free.extend(self.cache.clear())

    def ref_count(self, block: int) -> int:
        return self._refs[block]


class KVCacheManager:
    """Grows and frees sequences' block tables.

    ``block_size`` tokens per block; a sequence holding ``t`` tokens needs
    ``ceil(t / block_size)`` blocks. ``enable_caching``: full computed blocks are registered
    by content (`cache_full_blocks`) and found again by later sequences (`find_cached_prefix`),
    see `batchgen.engine.prefix_cache`; ``prefix_cache`` is None without it.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        self.block_size = block_size
        self.prefix_cache = PrefixCache() if enable_caching else None
        self.allocator = BlockAllocator(num_blocks, self.prefix_cache)

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

    def find_cached_prefix(self, seq: SequenceCoroutine) -> tuple[list[int], list[bytes]]:
        """The longest run of cached full blocks that starts ``seq``'s tokens, leaving at least
        its last token to compute (a cached block has no logits): at most
        ``(num_tokens - 1) // block_size`` blocks, so a prompt cached whole recomputes its last
        block (vLLM's rule). Changes nothing; `take_cached_prefix` takes the blocks.

        Returns:
            ``(blocks, missing)``: the cached block ids, and the hashes of ``seq``'s later full
            blocks up to that limit (the first one is not cached). Both empty without a cache.
        """
        if self.prefix_cache is None:
            return [], []
        limit = (seq.num_tokens - 1) // self.block_size
        hashes = block_hashes(seq, limit, self.block_size)
        blocks: list[int] = []
        for block_hash in hashes:
            block = self.prefix_cache.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, hashes[len(blocks) :]

    def take_cached_prefix(self, seq: SequenceCoroutine, blocks: list[int]) -> None:
        """Give ``seq`` (holding no blocks) the cached ``blocks`` (from `find_cached_prefix`):
        they count as computed, ``num_computed_tokens = len(blocks) * block_size``."""
        if seq.block_table:
            raise ValueError("take_cached_prefix: the sequence already holds KV blocks")
        self.allocator.touch(blocks)
        seq.block_table = list(blocks)
        seq.num_computed_tokens = len(blocks) * self.block_size

    def cache_full_blocks(self, seq: SequenceCoroutine, start: int) -> None:
        """Register the blocks of ``seq`` that positions ``[start, num_computed_tokens)``
        (just computed) completed, so later sequences can find them. A no-op without a cache.
        Blocks before ``start`` are not registered here: they were already, or hold K/V
        imported from another engine (left unregistered)."""
        if self.prefix_cache is None:
            return
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        first = start // bs
        if full <= first:
            return
        hashes = block_hashes(seq, full, bs)
        for i in range(first, full):
            self.prefix_cache.register(seq.block_table[i], hashes[i])

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
        last = seq.block_table[keep - 1]
        if num_tokens % self.block_size:
            if self.allocator.ref_count(last) > 1:
                return False
            if self.prefix_cache is not None:  # ``heir`` overwrites its content
                self.prefix_cache.forget(last)
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
        weight update; vLLM's ``reset_prefix_cache``, SGLang's ``flush_cache``): every hash is
        dropped and the cached free blocks become plain free blocks.

        Returns False, changing nothing, while a sequence holds blocks (vLLM's rule too: a
        held block's hash could be registered again by its holder)."""
        if self.num_free_blocks != self.num_blocks:
            return False
        self.allocator.uncache_free_blocks()
        return True
