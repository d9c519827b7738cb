"""A batch job's durable state at ``snapshot_storage_uri``: any fsspec URL or a plain path.

Layout under the URI (docs/snapshots.md)::

    manifest.json                      the job: input identity, model, output-changing settings
    progress.json                      counts and the last segment (informational, overwritten)
    results/seg-<seq:08d>-<run>-<job>.jsonl  finished result lines, exactly as `batchgen run`
                                             writes them

Object stores have neither append nor an atomic rename, so nothing is ever appended to: every
object is written whole, once, under a name no other write uses (``<run>`` is a random id per
process, so two processes can never overwrite each other's segment). Each write is atomic:

- On object stores (s3, gs, az, memory: `ATOMIC_PUT_PROTOCOLS`) one ``pipe_file`` is one PUT (or
  one multipart upload), and the object appears whole or not at all; their "rename" is a copy
  plus a delete, which would only double the traffic, so none is used.
- Everywhere else (the local file system, and any other fsspec backend) a write can be seen
  half done, so the bytes go to a hidden temporary name (``.<name>.tmp-<uuid>``), are fsync'ed
  where local, then ``mv``'ed to the final name (``rename(2)``: atomic on POSIX).

Readers list only final names, so a temporary left by a killed writer is ignored (a write
that raises, SIGTERM's orderly stop included, removes its own); should a backend still expose
a truncated segment, its incomplete last line is dropped with a warning (the results it held
run again). ``manifest.json`` is written when a job first opens the
store (before any model loads, so a store that cannot be written fails at once) and read back
to verify it; a restart compares it with its own job and refuses, naming each difference, to
mix the results of two jobs (a manifest with no results stored under it is replaced). Without
locks, two jobs started at once are told apart by the manifest's job id: a writer checks it
before each segment and stops when another job replaced it, and segments carry it in their
names, so one job's segments are never restored into another's.

This module is the storage (`SnapshotStore`: the URI, atomic writes, binding a job, segments,
progress). What a manifest holds and how a run's is made: `snapshot_manifest`; buffering a
run's results into segments: `snapshot_writer` (their names are importable from here too).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

# Re-exported: importable from here as before these moved to their own modules.
from batchgen.entrypoints.snapshot_manifest import (
    FINGERPRINT_CONFIG_KEYS,
    FORMAT,
    HUB_FILES,
    OUTPUT_SETTINGS,
    Manifest,
    SnapshotError,
    SnapshotTakenOverError,
    file_identity,
    job_manifest,
    local_model_dir,
    model_fingerprint,
    resolved_settings,
)
from batchgen.entrypoints.snapshot_writer import SnapshotWriteError, SnapshotWriter

__all__ = [
    "ATOMIC_PUT_PROTOCOLS",
    "FINGERPRINT_CONFIG_KEYS",
    "FORMAT",
    "HUB_FILES",
    "MANIFEST",
    "OUTPUT_SETTINGS",
    "PROGRESS",
    "RESULTS",
    "SEGMENT",
    "Manifest",
    "SnapshotError",
    "SnapshotStore",
    "SnapshotTakenOverError",
    "SnapshotWriteError",
    "SnapshotWriter",
    "file_identity",
    "job_manifest",
    "local_model_dir",
    "model_fingerprint",
    "resolved_settings",
]

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
PROGRESS = "progress.json"
RESULTS = "results"
# seg-<sequence>-<run id>-<job id>.jsonl; segments written before job ids have no third part.
SEGMENT = re.compile(r"^seg-(\d{8})-([0-9a-f]+)(?:-([0-9a-f]+))?\.jsonl$")
# Protocols whose single PUT is atomic (the object appears whole or not at all).
ATOMIC_PUT_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "memory"})


# ---------------------------------------------------------------------------------------------
# The store


class SnapshotStore:
    """One job's snapshot at a URI: the manifest, result segments and progress.

    Args:
        uri: any fsspec URL (``file:///dir``, ``s3://bucket/prefix``, ``gs://...``) or a plain
            path. Credentials and endpoints come from the backend's usual sources (for S3:
            ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``..., or fsspec's ``FSSPEC_S3_*``).
        storage_options: keyword arguments for the fsspec file system (over those sources).
        allow_memory: accept fsspec's ``memory://`` (for tests: it lives in this process only).

    Raises:
        SnapshotError: the URI names no usable file system (unknown protocol, or its package,
            such as ``s3fs`` or ``gcsfs``, is not installed), or it is ``memory://``, which is
            gone when the process exits and so can restore nothing.
    """

    def __init__(
        self, uri: str, storage_options: dict | None = None, *, allow_memory: bool = False
    ) -> None:
        from fsspec.core import url_to_fs

        self.uri = uri
        if "://" not in uri:
            uri = os.path.expanduser(uri)  # a path from a YAML file has met no shell
        try:
            self.fs, root = url_to_fs(uri, **(storage_options or {}))
        except ImportError as err:
            raise SnapshotError(
                f"snapshot_storage_uri {uri!r}: {err} (s3: pip install 'batchgen[s3]'; gs: "
                "pip install 'batchgen[gcs]')"
            ) from None
        except ValueError as err:
            raise SnapshotError(f"snapshot_storage_uri {uri!r}: {err}") from None
        self.root = root.rstrip("/")
        protocols = self.fs.protocol
        protocols = {protocols} if isinstance(protocols, str) else set(protocols)
        if "memory" in protocols and not allow_memory:
            raise SnapshotError(
                f"snapshot_storage_uri {self.uri!r}: memory:// keeps the snapshot in this "
                "process's memory, which is gone when it exits, so a restart could restore "
                "nothing; use a directory (a path or file://) or an object store (s3://, gs://)"
            )
        self.atomic_put = bool(protocols & ATOMIC_PUT_PROTOCOLS)
        self.local = bool(protocols & {"file", "local"})
        self.manifest: Manifest | None = None  # this job's, once `open_job` checked it

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def where(self, *parts: str) -> str:
        """A user-facing location: the URI and the object."""
        return self.uri.rstrip("/") + "/" + "/".join(parts) if parts else self.uri

    # ---- the manifest
    def read_manifest(self) -> Manifest | None:
        """The stored manifest; None when there is none."""
        try:
            data = self.fs.cat_file(self.path(MANIFEST))
        except FileNotFoundError:
            return None
        return Manifest.from_json(data, self.where(MANIFEST))

    def open_job(self, manifest: Manifest) -> None:
        """Bind the store to a job: check a stored manifest against it, or write it (then read
        it back), which also proves the store writable before any model loads. A manifest of
        another job that stored no result yet is replaced, with a warning; that job, if it is
        still running, stops at its next segment (`check_job`) and its segments are ignored.
        The bound manifest (``self.manifest``) carries the stored job id, or a new one.

        Raises:
            SnapshotError: the stored manifest is another job's that stored results (naming
                every difference), is unreadable, or the URI holds results without a manifest.
            OSError: the store cannot be read or written (missing bucket, credentials...).
        """
        stored = self.read_manifest()
        has_results = bool(self.segments())
        if stored is None and has_results:
            raise SnapshotError(
                f"{self.uri} holds result segments but no {MANIFEST}; use another snapshot "
                "URI, or remove it to start over"
            )
        diffs = stored.differences(manifest) if stored is not None else []
        if diffs and has_results:
            raise SnapshotError(
                f"{self.uri} holds the snapshot of another job; it differs in "
                + "; ".join(diffs)
                + ". Use another snapshot URI, or remove that one to start over"
            )
        if diffs:
            logger.warning(
                "%s: replacing the manifest of another job that stored no results (%s; it "
                "differs in %s); if that job is still running, it stops at its next segment "
                "write with an error, and nothing it writes is ever read as this job's",
                self.uri,
                stored.describe(),
                "; ".join(diffs),
            )
        if stored is not None and not diffs:
            # The same job again: keep its id (None for a manifest older than job ids: then
            # this run writes untagged segments, as that version did).
            self.manifest = replace(manifest, job_id=stored.job_id, created_at=stored.created_at)
            return
        bound = replace(
            manifest,
            job_id=uuid.uuid4().hex[:16],
            created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        )
        data = bound.to_json()
        self._put(self.path(MANIFEST), data)
        if self.fs.cat_file(self.path(MANIFEST)) != data:
            raise SnapshotError(f"{self.where(MANIFEST)} did not read back as written")
        self.manifest = bound

    def check_job(self) -> None:
        """Raise unless the stored manifest is still this job's (same job id and fields).

        Object stores have no locks, so two jobs started on one URI are told apart after the
        fact: the one whose manifest was replaced learns it here (before each segment it
        writes) and stops, and its segments carry its job id, so even one written between the
        other's replacement and this check is never restored into the other job.

        Raises:
            SnapshotTakenOverError: the manifest is gone or another job's.
        """
        self._check_open()
        mine = self.manifest
        stored = self.read_manifest()
        if stored is not None and stored.job_id == mine.job_id and not stored.differences(mine):
            return
        other = "was removed" if stored is None else f"is now another job's ({stored.describe()})"
        raise SnapshotTakenOverError(
            f"the snapshot manifest {self.where(MANIFEST)} this run started under (job id "
            f"{mine.job_id}) {other}: two jobs were started on one snapshot URI. This run "
            "stores nothing more there; every result it finished is in its output file: "
            "rerun it with --resume and another --snapshot-storage-uri"
        )

    def _check_open(self) -> None:
        if self.manifest is None:
            raise RuntimeError("SnapshotStore.open_job must come before writing results")

    # ---- result segments
    def segments(self) -> list[str]:
        """Final segment names (not paths) of every job in write order; temporaries are left
        out."""
        directory = self.path(RESULTS)
        self.fs.invalidate_cache(directory)
        try:
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(directory, detail=False)]
        except FileNotFoundError:
            return []
        return sorted(n for n in names if SEGMENT.match(n))

    def job_segments(self) -> list[str]:
        """The segments of this store's job (the bound manifest's, else the stored one's):
        those tagged with its job id, and untagged ones (written before job ids). Segments of
        another job (one whose manifest was replaced) are left out, with a warning."""
        job = self.manifest if self.manifest is not None else self.read_manifest()
        job_id = job.job_id if job is not None else None
        names, foreign = [], []
        for name in self.segments():
            tag = SEGMENT.match(name)[3]
            (names if tag is None or job_id is None or tag == job_id else foreign).append(name)
        if foreign:
            logger.warning(
                "%s: ignoring %d segments of another job (job ids %s), written under a "
                "manifest that was replaced",
                self.uri,
                len(foreign),
                ", ".join(sorted({SEGMENT.match(n)[3] for n in foreign})),
            )
        return names

    def next_sequence(self) -> int:
        """The sequence number after the last segment's (1 for an empty store)."""
        names = self.segments()
        return int(SEGMENT.match(names[-1])[1]) + 1 if names else 1

    def write_segment(self, sequence: int, run_id: str, lines: list[bytes]) -> str:
        """Store result lines (each ending with a newline) as one segment, tagged with the
        job id; returns its name."""
        self._check_open()
        job = f"-{self.manifest.job_id}" if self.manifest.job_id else ""
        name = f"seg-{sequence:08d}-{run_id}{job}.jsonl"
        self._put(self.path(RESULTS, name), b"".join(lines))
        return name

    def iter_result_lines(self) -> Iterator[bytes]:
        """Every complete result line of this job's segments (`job_segments`), in write
        order, each ending with a newline; one segment is held in memory at a time. An
        incomplete last line (a segment truncated by a backend without atomic writes) is
        dropped with a warning."""
        for name in self.job_segments():
            data = self.fs.cat_file(self.path(RESULTS, name))
            keep = data.rfind(b"\n") + 1
            if keep < len(data):
                logger.warning(
                    "%s: ignoring an incomplete last line (%d bytes); its result runs again",
                    self.where(RESULTS, name),
                    len(data) - keep,
                )
            for line in data[:keep].splitlines(keepends=True):
                if line.strip():
                    yield line

    # ---- progress
    def write_progress(self, progress: dict[str, Any]) -> None:
        self._check_open()
        data = (json.dumps(progress, indent=2, sort_keys=True) + "\n").encode("utf-8")
        self._put(self.path(PROGRESS), data)

    def read_progress(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.fs.cat_file(self.path(PROGRESS)))
        except FileNotFoundError:
            return None

    # ---- atomic writes (module docstring)
    def _put(self, path: str, data: bytes) -> None:
        if self.atomic_put:
            self.fs.pipe_file(path, data)
            return
        parent, name = path.rsplit("/", 1)
        self.fs.makedirs(parent, exist_ok=True)
        tmp = f"{parent}/.{name}.tmp-{uuid.uuid4().hex}"
        try:
            self.fs.pipe_file(tmp, data)
            if self.local:  # survive a machine crash, not only a killed process
                fd = os.open(tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            self.fs.mv(tmp, path)
        except BaseException:  # a failed write, or SIGTERM's orderly stop: no temporary left
            with contextlib.suppress(Exception):
                if self.fs.exists(tmp):
                    self.fs.rm(tmp)
            raise
