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

Readers list only final names, so a temporary left by a killed writer is ignored; should a
backend still expose a truncated segment, its incomplete last line is dropped with a warning
(the results it held run again). ``manifest.json`` is written when a job first opens the
store (before any model loads, so a store that cannot be written fails at once) and read back
to verify it; a restart compares it with its own job and refuses, naming each difference, to
mix the results of two jobs (a manifest with no results stored under it is replaced). Without
locks, two jobs started at once are told apart by the manifest's job id: a writer checks it
before each segment and stops when another job replaced it, and segments carry it in their
names, so one job's segments are never restored into another's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from batchgen.parallel_config import SEGMENT_MAX_AGE_S, SEGMENT_MAX_RESULTS

logger = logging.getLogger(__name__)

FORMAT = "batchgen-snapshot/1"
MANIFEST = "manifest.json"
PROGRESS = "progress.json"
RESULTS = "results"
# seg-<sequence>-<run id>-<job id>.jsonl; segments written before job ids have no third part.
SEGMENT = re.compile(r"^seg-(\d{8})-([0-9a-f]+)(?:-([0-9a-f]+))?\.jsonl$")
# Protocols whose single PUT is atomic (the object appears whole or not at all).
ATOMIC_PUT_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "memory"})


class SnapshotError(ValueError):
    """The snapshot URI cannot be used for this job (message for the user)."""


class SnapshotTakenOverError(SnapshotError):
    """Another job replaced the manifest this run started under: it stores nothing more."""


class SnapshotWriteError(OSError):
    """The snapshot could not be written mid-run (message for the user: the output file holds
    every result so far, rerun with ``--resume``)."""


# ---------------------------------------------------------------------------------------------
# The manifest: which job a snapshot belongs to


@dataclass(frozen=True)
class Manifest:
    """What makes two runs the same job.

    Attributes:
        input_sha256 / input_size: the input file's bytes (its name and path may differ
            between machines; its content may not).
        model: the model's served name (a local directory's name, not its path, or the hub
            id), as result bodies report it.
        settings: the engine settings that change a result (`OUTPUT_SETTINGS`), resolved
            where that is cheap (`resolved_settings`: ``dtype`` "auto" as the device makes
            it, ``max_model_len`` None as the model's, ``tokenizer`` by name, None for the
            model's own); the batching, memory and parallel settings may differ between runs
            (another machine may have other devices).
        model_fingerprint: what identifies the checkpoint without reading its weights
            (`model_fingerprint`); None where it cannot be known without a download (a hub id
            not in the local cache, the embedded default model) or in manifests written
            before fingerprints, and then not compared.
        input_name: the input file's name, for people (not compared).
        job_id: a random id given when the manifest is written (not compared): the writer of a
            job checks it before every segment, and its segments carry it in their names, so a
            job whose manifest another job replaced stops, and its segments are never read as
            the other job's (None in manifests written before job ids).
        created_at: when the manifest was written, for people (not compared).
    """

    input_sha256: str
    input_size: int
    model: str
    settings: dict[str, Any] = field(default_factory=dict)
    input_name: str = ""
    model_fingerprint: dict[str, Any] | None = None
    job_id: str | None = field(default=None, compare=False)
    created_at: str = field(default="", compare=False)

    def describe(self) -> str:
        """The job in a few words, for messages: its input, model and id."""
        when = f", started {self.created_at}" if self.created_at else ""
        return f"input {self.input_name!r}, model {self.model!r}, job id {self.job_id}{when}"

    def to_json(self) -> bytes:
        body = {"format": FORMAT, **asdict(self)}
        return (json.dumps(body, indent=2, sort_keys=True) + "\n").encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        try:
            body = json.loads(data)
            if body.pop("format") != FORMAT:
                raise ValueError("unknown format")
            return cls(**body)
        except (ValueError, TypeError, KeyError, AttributeError) as err:
            raise SnapshotError(
                f"{where} is not a batchgen snapshot manifest ({err}); use another "
                "snapshot URI, or remove it to start over"
            ) from None

    def differences(self, other: Manifest) -> list[str]:
        """``"what: snapshot X, this run Y"`` for every compared field that differs."""
        out = []
        if (self.input_sha256, self.input_size) != (other.input_sha256, other.input_size):
            out.append(
                f"input file: snapshot {self.input_name!r} ({self.input_size} bytes, sha256 "
                f"{self.input_sha256[:12]}...), this run {other.input_name!r} "
                f"({other.input_size} bytes, sha256 {other.input_sha256[:12]}...)"
            )
        if self.model != other.model:
            out.append(f"model: snapshot {self.model!r}, this run {other.model!r}")
        if self.model_fingerprint is not None and other.model_fingerprint is not None:
            out += _fingerprint_differences(self.model_fingerprint, other.model_fingerprint)
        for name in sorted(set(self.settings) | set(other.settings)):
            mine, theirs = self.settings.get(name), other.settings.get(name)
            if mine != theirs:
                out.append(f"{name}: snapshot {mine!r}, this run {theirs!r}")
        return out


def _fingerprint_differences(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    out = []
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key), theirs.get(key)
        if a == b:
            continue
        if key == "weights" and isinstance(a, dict) and isinstance(b, dict):
            names = sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))

            def files(side: dict) -> str:
                held = [f"{n} ({side[n]} bytes)" for n in names if n in side]
                return ", ".join(held) or "none of them"

            out.append(f"model weights: snapshot {files(a)}, this run {files(b)}")
        elif key == "config_sha256":
            out.append(
                f"model config.json: snapshot sha256 {str(a)[:12]}..., this run sha256 "
                f"{str(b)[:12]}..."
            )
        else:
            out.append(f"model {key}: snapshot {a!r}, this run {b!r}")
    return out


# EngineConfig fields that change what a request's result is.
OUTPUT_SETTINGS = ("tokenizer", "dtype", "seed", "max_model_len")
# config.json keys shown in the fingerprint (readable; the config's sha256 covers all of it).
FINGERPRINT_CONFIG_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "vocab_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_local_experts",
    "num_experts",
    "n_routed_experts",
)
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]


def local_model_dir(model: str | None) -> Path | None:
    """The checkpoint directory of ``model`` without downloading anything: the directory
    itself, or a hub id's snapshot in the local Hugging Face cache; None for the embedded
    default model, a hub id not cached, or a directory without config.json."""
    if model is None:
        return None
    path = Path(model).expanduser()
    if path.is_dir():
        return path if (path / "config.json").is_file() else None
    if path.exists() or model.startswith(("/", "./", "../", "~")) or model.count("/") > 1:
        return None
    try:
        from huggingface_hub import snapshot_download

        local = Path(
            snapshot_download(repo_id=model, local_files_only=True, allow_patterns=HUB_FILES)
        )
    except Exception:  # not cached (or no such id): the engine will say so
        return None
    return local if (local / "config.json").is_file() else None


def model_fingerprint(model_dir: Path) -> dict[str, Any]:
    """What tells one checkpoint from another without reading its weights (hundreds of GB):
    the architecture and main sizes from ``config.json``, that file's sha256, and the name and
    size of each safetensors file. A copy of the directory (anywhere, under any name) has the
    same fingerprint."""
    raw = (model_dir / "config.json").read_bytes()
    try:
        config = json.loads(raw)
    except ValueError:
        config = {}
    config = config if isinstance(config, dict) else {}
    fingerprint: dict[str, Any] = {
        "architecture": ",".join(map(str, config.get("architectures") or [])) or None
    }
    fingerprint.update({key: config[key] for key in FINGERPRINT_CONFIG_KEYS if key in config})
    fingerprint["config_sha256"] = hashlib.sha256(raw).hexdigest()
    fingerprint["weights"] = {
        p.name: p.stat().st_size for p in sorted(model_dir.glob("*.safetensors"))
    }
    return fingerprint


def resolved_settings(
    engine_config: Any, model_dir: Path | None, parallel: Any = None
) -> dict[str, Any]:
    """`OUTPUT_SETTINGS` as the engine will use them, where that is cheap to know, so that a
    setting spelled out as its default is the same job as the default:

    - ``dtype`` "auto": what `resolve_dtype` makes of it on this machine's device (float32 on
      CPU; the checkpoint's dtype on CUDA). Left "auto" where the device is not this
      machine's to know: Ray ranks with ``device`` "auto" and no CUDA here.
    - ``max_model_len`` None: the model's ``max_position_embeddings`` (the engine may lower it
      further to the KV cache's capacity, which memory settings decide, not the job).
    - ``tokenizer``: None when it is the model's own (unset, or the model's directory), a
      local directory's name (not its path), or the hub id.
    """
    settings = {name: getattr(engine_config, name) for name in OUTPUT_SETTINGS}
    config: dict[str, Any] = {}
    if model_dir is not None:
        with contextlib.suppress(OSError, ValueError):
            loaded = json.loads((model_dir / "config.json").read_bytes())
            config = loaded if isinstance(loaded, dict) else {}
    if settings["dtype"] == "auto":
        settings["dtype"] = _resolved_dtype(engine_config, config, model_dir, parallel)
    if settings["max_model_len"] is None and isinstance(
        config.get("max_position_embeddings"), int
    ):
        settings["max_model_len"] = config["max_position_embeddings"]
    settings["tokenizer"] = _tokenizer_name(settings["tokenizer"], engine_config.model)
    return settings


def _resolved_dtype(
    engine_config: Any, config: dict[str, Any], model_dir: Path | None, parallel: Any
) -> str:
    from types import SimpleNamespace

    from batchgen.engine.llm_engine import resolve_device
    from batchgen.models.loader import resolve_dtype

    backend = getattr(parallel, "distributed_executor_backend", "mp")
    if engine_config.device == "auto" and backend == "ray":
        import torch

        if not torch.cuda.is_available():
            return "auto"  # Ray may place the ranks on GPUs this machine does not have
    try:
        device = resolve_device(engine_config.device)
    except ValueError:
        return "auto"  # cuda asked for and absent: the engine will refuse it
    if device.type != "cpu" and model_dir is None:
        return "auto"  # the checkpoint's dtype decides, and it is not at hand
    checkpoint = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = resolve_dtype("auto", device, SimpleNamespace(torch_dtype=checkpoint))
    return str(dtype).removeprefix("torch.")


def _tokenizer_name(tokenizer: str | None, model: str | None) -> str | None:
    if tokenizer is None or tokenizer == model:
        return None
    path = Path(tokenizer).expanduser()
    if path.is_dir():
        if model is not None and Path(model).expanduser().is_dir():
            if path.resolve() == Path(model).expanduser().resolve():
                return None
        return path.resolve().name
    return tokenizer


def file_identity(path: str | os.PathLike) -> tuple[int, str]:
    """(size in bytes, sha256 hex) of a file, read in one streaming pass."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def job_manifest(
    input_path: str | os.PathLike, engine_config: Any, parallel: Any = None
) -> Manifest:
    """The manifest of running ``input_path`` with ``engine_config`` (an `EngineConfig`) and
    ``parallel`` (its `ParallelConfig`, for where the ranks run); reads the input once and the
    model's config.json, and loads no model.

    Raises:
        SnapshotError: the input is not a regular file (a pipe has no identity to record).
    """
    path = Path(input_path)
    if not path.is_file():
        raise SnapshotError(
            f"a snapshot needs a regular input file (its sha256 identifies the job); "
            f"{str(path)!r} is not one"
        )
    size, sha = file_identity(path)
    model = engine_config.served_model_name or _model_name(engine_config.model)
    model_dir = local_model_dir(engine_config.model)
    fingerprint = model_fingerprint(model_dir) if model_dir is not None else None
    settings = resolved_settings(engine_config, model_dir, parallel)
    return Manifest(
        sha, size, model, settings, input_name=path.name, model_fingerprint=fingerprint
    )


def _model_name(model: str | None) -> str:
    """The name result bodies carry (`LLMEngine.model_name` without loading anything)."""
    if model is None:
        from batchgen.models.default_model import DEFAULT_MODEL_NAME

        return f"batchgen/{DEFAULT_MODEL_NAME}"
    path = Path(model)
    return path.resolve().name if path.is_dir() else model


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
        self.fs.pipe_file(tmp, data)
        if self.local:  # survive a machine crash, not only a killed process
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self.fs.mv(tmp, path)


# ---------------------------------------------------------------------------------------------
# The writer: result lines -> segments, every N results or T seconds


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
