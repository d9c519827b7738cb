"""`BatchRunSummary`: what one ``batchgen run`` did (counts, tokens, time, prefix-cache hits),
and its one-line description printed at the end of the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class BatchRunSummary:
    """What `run_batch_file` did.

    Attributes:
        total: non-blank input lines seen.
        succeeded / failed: result lines written by this run (success / error).
        skipped: lines skipped because the output already held their result (``resume``) or
            the snapshot did.
        restored: results copied from the snapshot into the output (counted in ``skipped``).
        ignored: results in the snapshot for no request of this input (another job's), left
            out of the output.
        dropped_errors: error results dropped from the output before the run so that their
            lines ran again (``retry_failed``); those lines are counted in ``succeeded`` or
            ``failed``.
        blank_lines: blank lines between request lines, skipped (blank lines after the last
            request line are not counted).
        prompt_tokens / generated_tokens: over the requests that succeeded in this run
            (generated tokens summed over all ``n`` samples).
        elapsed_s: wall-clock seconds of the run (after counting lines and reading the old
            output).
        prefix_cache_queries / prefix_cache_hits: the engine's prefix cache over the run
            (`LLMEngine.get_metrics`): prompt tokens looked up, and those found cached.
    """

    total: int = 0
    succeeded: int = 0
    failed: int = 0
    skipped: int = 0
    restored: int = 0
    ignored: int = 0
    dropped_errors: int = 0
    blank_lines: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    elapsed_s: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @property
    def generated_tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def describe(self) -> str:
        """One human-readable line."""
        skipped = f", {self.skipped} skipped (already done)" if self.skipped else ""
        if self.restored:
            skipped += f", {self.restored} of them restored from the snapshot"
        if self.ignored:
            skipped += f", {self.ignored} snapshot results ignored (no such request in the input)"
        if self.dropped_errors:
            skipped += f", {self.dropped_errors} earlier error results dropped and run again"
        blank = ""
        if self.blank_lines:
            noun = "line" if self.blank_lines == 1 else "lines"
            blank = f"; {self.blank_lines} blank {noun} skipped"
        return (
            f"{self.succeeded} ok, {self.failed} failed{skipped} of {self.total} requests"
            f"{blank}; "
            f"{self.prompt_tokens} prompt + {self.generated_tokens} generated tokens in "
            f"{self.elapsed_s:.1f} s ({self.generated_tokens_per_s:.1f} generated tokens/s)"
            f"{self._prefix_cache_text()}"
        )

    def _prefix_cache_text(self) -> str:
        if not self.prefix_cache_queries:
            return ""
        rate = 100 * self.prefix_cache_hits / self.prefix_cache_queries
        return (
            f"; prefix cache: {self.prefix_cache_hits} of {self.prefix_cache_queries} prompt "
            f"tokens cached ({rate:.1f}%)"
        )


def note_prefix_cache(summary: BatchRunSummary, engine: Any) -> None:
    """Copy the engine's prefix-cache counters into ``summary`` (an engine without
    ``get_metrics``, as in tests, leaves them 0)."""
    get_metrics = getattr(engine, "get_metrics", None)
    if get_metrics is None:
        return
    metrics = get_metrics()
    summary.prefix_cache_queries = int(metrics.get("prefix_cache_queries", 0))
    summary.prefix_cache_hits = int(metrics.get("prefix_cache_hits", 0))
