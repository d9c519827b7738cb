"""The names of the files kept beside a ``batchgen run`` output (`sidecar_path`)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

# The longest file name most file systems take (ext4, xfs, btrfs, tmpfs: 255 bytes).
NAME_MAX = 255


def sidecar_path(output_path: str | os.PathLike, suffix: str) -> Path:
    """``.<name><suffix>`` beside the file ``output_path`` names (symlinks resolved).

    A name that would pass `NAME_MAX` bytes is shortened to its first characters plus a hash
    of the whole name, so that a long output name still gets a sidecar and two long names
    sharing a prefix get different ones.
    """
    real = Path(os.path.realpath(output_path))
    name = f".{real.name}{suffix}"
    if len(os.fsencode(name)) > NAME_MAX:
        digest = hashlib.sha256(os.fsencode(real.name)).hexdigest()[:16]
        head = os.fsencode(real.name)[:100].decode("utf-8", "ignore")
        name = f".{head}-{digest}{suffix}"
    return real.with_name(name)
