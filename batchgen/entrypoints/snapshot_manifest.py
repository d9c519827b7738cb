"""Which job a snapshot belongs to: the manifest (`Manifest`) and how a job's is made.

A job is its input file's bytes (size and sha256), the model's served name, a fingerprint of
the checkpoint read without its weights (`model_fingerprint`: config.json's sha256 and main
sizes, each safetensors file's name and size) and the engine settings that change a result
(`OUTPUT_SETTINGS`, resolved where that is cheap: `resolved_settings`). `job_manifest` builds
a run's manifest without loading a model; `Manifest.differences` names, field by field, what
sets two jobs apart, so that a restart refuses to mix their results
(`batchgen.entrypoints.snapshot_store.SnapshotStore.open_job`).

Where the manifest is stored, and the rest of a snapshot's layout:
`batchgen.entrypoints.snapshot_store`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "batchgen-snapshot/1"


class SnapshotError(ValueError):
    """The snapshot URI cannot be used for this job (message for the user)."""


class SnapshotTakenOverError(SnapshotError):
    """Another job replaced the manifest this run started under: it stores nothing more."""


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
            mine = self.settings.get(name, _SETTINGS_BEFORE.get(name))
            theirs = other.settings.get(name, _SETTINGS_BEFORE.get(name))
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

            def files(side: dict, names: list[str]) -> str:
                held = [f"{n} ({side[n]} bytes)" for n in names if n in side]
                return ", ".join(held) or "none of them"

            out.append(f"model weights: snapshot {files(a, names)}, this run {files(b, names)}")
        elif key == "config_sha256":
            out.append(
                f"model config.json: snapshot sha256 {str(a)[:12]}..., this run sha256 "
                f"{str(b)[:12]}..."
            )
        else:
            out.append(f"model {key}: snapshot {a!r}, this run {b!r}")
    return out


# EngineConfig fields that change what a request's result is.
OUTPUT_SETTINGS = ("tokenizer", "dtype", "seed", "max_model_len", "kv_cache_dtype")
# A setting a manifest written before it existed lacks: the value those jobs ran with.
_SETTINGS_BEFORE = {"kv_cache_dtype": "auto"}
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
      CPU, or a bfloat16 checkpoint's bfloat16 on a CPU with AMX-BF16 or avx512_bf16,
      `cpu_has_fast_bf16`; the checkpoint's dtype on
      CUDA). Left "auto" where the device is not this machine's to know (Ray ranks with
      ``device`` "auto" and no CUDA here), or the checkpoint's dtype decides and its config
      is not at hand.
    - ``max_model_len`` None: the model's ``max_position_embeddings`` (the engine may lower it
      further to the KV cache's capacity, which memory settings decide, not the job).
    - ``tokenizer``: None when it is the model's own (unset, or the model's directory), a
      local directory's name (not its path), or the hub id.
    - ``kv_cache_dtype``: by the format the cache stores (`_kv_cache_dtype_name`); manifests
      written before it was a setting compare as ``auto``.
    """
    settings = {name: getattr(engine_config, name) for name in OUTPUT_SETTINGS}
    config: dict[str, Any] = {}
    if model_dir is not None:
        with contextlib.suppress(OSError, ValueError):
            loaded = json.loads((model_dir / "config.json").read_bytes())
            config = loaded if isinstance(loaded, dict) else {}
    if settings["dtype"] == "auto":
        settings["dtype"] = _resolved_dtype(engine_config, config, model_dir, parallel)
    if settings["max_model_len"] is None and isinstance(config.get("max_position_embeddings"), int):
        settings["max_model_len"] = config["max_position_embeddings"]
    settings["tokenizer"] = _tokenizer_name(settings["tokenizer"], engine_config.model)
    kv = settings["kv_cache_dtype"]
    settings["kv_cache_dtype"] = _kv_cache_dtype_name(kv, settings["dtype"])
    return settings


def _kv_cache_dtype_name(kv_cache_dtype: str, dtype: str) -> str:
    """``kv_cache_dtype`` by the format it stores: ``auto`` for the model's own dtype by name
    (``bfloat16`` under a bfloat16 model), ``fp8_e4m3`` for ``fp8`` (vLLM's alias)."""
    if kv_cache_dtype == dtype:
        return "auto"
    return "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype


def _resolved_dtype(
    engine_config: Any, config: dict[str, Any], model_dir: Path | None, parallel: Any
) -> str:
    from types import SimpleNamespace

    from batchgen.engine.engine_setup import resolve_device
    from batchgen.models.loader import cpu_has_fast_bf16, resolve_dtype

    backend = getattr(parallel, "distributed_executor_backend", "mp")
    if engine_config.device == "auto" and backend == "ray":
        import torch

        if not torch.cuda.is_available():
            return "auto"  # Ray may place the ranks on GPUs this machine does not have
    try:
        device = resolve_device(engine_config.device)
    except ValueError:
        return "auto"  # cuda asked for and absent: the engine will refuse it
    if model_dir is None and (device.type != "cpu" or cpu_has_fast_bf16()):
        return "auto"  # the checkpoint's dtype decides, and it is not at hand
    checkpoint = config.get("dtype") or config.get("torch_dtype") or "float32"
    invariant = bool(getattr(engine_config, "batch_invariant", False))
    dtype = resolve_dtype("auto", device, SimpleNamespace(torch_dtype=checkpoint), invariant)
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
    return Manifest(sha, size, model, settings, input_name=path.name, model_fingerprint=fingerprint)


def _model_name(model: str | None) -> str:
    """The name result bodies carry (`LLMEngine.model_name` without loading anything)."""
    if model is None:
        from batchgen.models.default_model import DEFAULT_MODEL_NAME

        return f"batchgen/{DEFAULT_MODEL_NAME}"
    path = Path(model)
    return path.resolve().name if path.is_dir() else model
