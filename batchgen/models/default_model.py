"""The embedded default model: a small Mixtral-architecture checkpoint built deterministically
offline on first use (random weights, so its text is gibberish, but every code path is real).

Location: ``$BATCHGEN_CACHE_DIR/default-mixtral-v1`` (default ``~/.cache/batchgen``). The build
goes to a temporary directory that is renamed into place, so a crash never leaves a half-written
model behind and concurrent first uses are safe.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "default-mixtral-v1"


def cache_dir() -> Path:
    return Path(os.environ.get("BATCHGEN_CACHE_DIR", Path.home() / ".cache" / "batchgen"))


def default_model_path() -> str:
    """Path of the default model, building it on first use (about a second)."""
    from batchgen.models.make_model import make_model

    target = cache_dir() / DEFAULT_MODEL_NAME
    if (target / "model.safetensors").is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        make_model("mixtral", tmp, seed=0)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
