"""The embedded default model: a small Mixtral-architecture checkpoint built deterministically
offline on first use (random weights, so its text is gibberish, but every code path is real).

Location: ``$BATCHGEN_CACHE_DIR/default-mixtral-v1`` (default ``~/.cache/batchgen``). The build
goes to a temporary directory that is renamed into place, so a crash never leaves a half-written
model behind and concurrent first uses are safe.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "default-mixtral-v1"
# The name results and /v1/models carry for it; ``--model`` / ``LLM(model=...)`` accept it too.
DEFAULT_MODEL_ID = f"batchgen/{DEFAULT_MODEL_NAME}"
# What `batchgen run` / `serve` / `LLM()` say when they run it: at start and in the run summary.
RANDOM_WEIGHTS_NOTE = (
    f"the default model batchgen/{DEFAULT_MODEL_NAME} has random weights, so its text is "
    "gibberish (every code path is real). For real text, point --model (LLM(model=...)) at a "
    "Hugging Face checkpoint directory or hub id, e.g. --model allenai/OLMoE-1B-7B-0924 "
    "(an MoE of 6.9B parameters: about 28 GB of memory in float32 on CPU, 14 GB in "
    "bfloat16; Mixtral-8x7B needs about 187 GB / 94 GB)"
)


def names_default_model(model: str) -> bool:
    """Whether ``model`` (a ``--model`` / ``LLM(model=...)`` value) names the default model:
    ``batchgen/default-mixtral-v1`` (the name it is served under) or ``default-mixtral-v1``
    (its folder's name), unless a local directory of that name exists (a directory wins, as
    it does over a hub id). `EngineConfig` then takes it as no model given."""
    return model in (DEFAULT_MODEL_ID, DEFAULT_MODEL_NAME) and not Path(model).is_dir()


def resolve_tokenizer(tokenizer: str | None, model_path: str) -> str:
    """Where the engine loads its tokenizer from: ``model_path`` (the model's folder) when
    ``tokenizer`` is None, the default model's folder (built on first use) when ``tokenizer``
    names the default model (`names_default_model`; `EngineConfig` keeps it as
    ``batchgen/default-mixtral-v1`` beside another model), else ``tokenizer`` as given."""
    if tokenizer is None:
        return model_path
    if names_default_model(tokenizer):
        return default_model_path()
    return tokenizer


def cache_dir() -> Path:
    return Path(os.environ.get("BATCHGEN_CACHE_DIR", Path.home() / ".cache" / "batchgen"))


def cached_model(name: str, arch: str, seed: int = 0, **overrides) -> str:
    """Path of checkpoint ``name`` in the cache dir, built by `make_model` on first use.

    The build goes to a temporary directory renamed into place: a crash never leaves a
    half-written model and concurrent first uses are safe. A build logs one line (INFO)
    naming the folder.
    """
    from batchgen.models.make_model import make_model

    target = cache_dir() / name
    if (target / "model.safetensors").is_file():
        return str(target)
    what = "the default model" if name == DEFAULT_MODEL_NAME else f"model {name!r}"
    logger.info("building %s into %s (first use, random weights)", what, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        make_model(arch, tmp, seed=seed, **overrides)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def default_model_path() -> str:
    """Path of the default model, building it on first use (a few seconds)."""
    return cached_model(DEFAULT_MODEL_NAME, "mixtral", seed=0)
