"""`SnapshotWriter`: a run's result lines, buffered, stored as segments of its snapshot.

A segment is written every N results or T seconds (``--snapshot-interval-results``,
``--snapshot-interval-s``), after the stored manifest is checked to still be this
job's; `progress.json` is rewritten after each. A write that fails mid-run is a
`SnapshotWriteError` telling the user to rerun with ``--resume``. The store itself (layout,
atomic writes, the manifest's checks): `batchgen.entrypoints.snapshot_store`.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING

from batchgen.entrypoints.snapshot_manifest import SnapshotTakenOverError
from batchgen.parallel_config import SEGMENT_MAX_AGE_S, SEGMENT_MAX_RESULTS

if TYPE_CHECKING:
    from batchgen.entrypoints.snapshot_store import SnapshotStore


class SnapshotWriteError(OSError):
    """The snapshot could not be written mid-run (message for the user: the output file holds
    every result so far, rerun with ``--resume``)."""


class SnapshotWriter:
    """Buffers result lines and stores them as segments of a `SnapshotStore`.

    A segment is written when ``max_results`` lines are buffered or the oldest buffered line
    is ``max_age_s`` old (checked by `maybe_flush`), and by `flush`. `progress.json` is
    rewritten after each segment.

    Args:
        store: a store bound to its job (`SnapshotStore.open_job`).
        stored_results: result lines the store already held when the run started.
        total: the input's request lines, where known (for progress only).
    """

    DEFAULT_MAX_RESULTS = SEGMENT_MAX_RESULTS
    DEFAULT_MAX_AGE_S = SEGMENT_MAX_AGE_S

    def __init__(
        self,
        store: SnapshotStore,
        *,
        max_results: int = SEGMENT_MAX_RESULTS,
        max_age_s: float = SEGMENT_MAX_AGE_S,
        stored_results: int = 0,
        total: int | None = None,
    ) -> None:
        self.store = store
        self.max_results = max_results
        self.max_age_s = max_age_s
        self.run_id = uuid.uuid4().hex[:8]
        self.sequence = store.next_sequence()
        self.stored_results = stored_results
        self.total = total
        self.segments_written = 0
        self.last_segment: str | None = None
        self._lines: list[bytes] = []
        self._oldest = 0.0
        self._taken_over: SnapshotTakenOverError | None = None

    def add(self, line: bytes) -> None:
        """Buffer one result line (ending with a newline)."""
        if not self._lines:
            self._oldest = time.monotonic()
        self._lines.append(line)

    @property
    def pending(self) -> int:
        return len(self._lines)

    def maybe_flush(self) -> None:
        """Write a segment when the buffer is full or old enough."""
        if self._lines and (
            len(self._lines) >= self.max_results
            or time.monotonic() - self._oldest >= self.max_age_s
        ):
            self.flush()

    def flush(self, *, finished: bool = False) -> None:
        """Write the buffered lines as one segment (none when empty), then the progress.

        The stored manifest is checked first (one small read): a run whose manifest another
        job replaced writes nothing more.

        Raises:
            SnapshotTakenOverError: another job replaced this job's manifest (and every later
                call raises it again).
            SnapshotWriteError: the store could not be read or written (the URI and the cause
                named, with what to do).
        """
        if self._taken_over is not None:
            raise self._taken_over
        if not self._lines and not finished:
            return
        try:
            self._flush(finished)
        except SnapshotTakenOverError as err:
            self._taken_over = err
            raise
        except OSError as err:
            raise SnapshotWriteError(
                f"could not write the snapshot at {self.store.uri} ({type(err).__name__}: "
                f"{err}); every result finished so far is in the output file: rerun with "
                "--resume once the snapshot URI is writable again (or with another "
                "--snapshot-storage-uri)"
            ) from err

    def _flush(self, finished: bool) -> None:
        self.store.check_job()
        if self._lines:
            name = self.store.write_segment(self.sequence, self.run_id, self._lines)
            self.sequence += 1
            self.segments_written += 1
            self.stored_results += len(self._lines)
            self.last_segment = name
            self._lines = []
        self.store.write_progress(
            {
                "job_id": self.store.manifest.job_id,
                "run_id": self.run_id,
                "results": self.stored_results,
                "total_requests": self.total,
                "last_segment": self.last_segment,
                "segments_this_run": self.segments_written,
                "finished": finished,
                "updated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
        )
