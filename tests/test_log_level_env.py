"""`BATCHGEN_LOG_LEVEL` in a Python program (not only the commands): the `batchgen` logger's
level at import, a bad value warned about and ignored. Subprocesses: the level is set once, at
import."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = "import logging, batchgen; print(logging.getLogger('batchgen').level)"


def _probe(value: str | None) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ)
    env.pop("BATCHGEN_LOG_LEVEL", None)
    if value is not None:
        env["BATCHGEN_LOG_LEVEL"] = value
    return subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("value", "level"), [(None, 0), ("error", 40), (" Warning ", 30), ("DEBUG", 10)]
)
def test_the_env_sets_the_batchgen_loggers_level_at_import(value, level):
    proc = _probe(value)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(level)
    assert proc.stderr == ""


def test_a_bad_value_is_a_warning_naming_the_allowed_values():
    proc = _probe("loud")
    assert proc.returncode == 0
    assert proc.stdout.strip() == "0"
    assert "BATCHGEN_LOG_LEVEL='loud' ignored: expected one of DEBUG, INFO, WARNING" in proc.stderr
