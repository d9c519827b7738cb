"""The input side of ``batchgen run``: streaming passes over a batch input file before the
run (its request count for the progress bar, and the result keys it can have, which decide
what a snapshot may restore and which results of a resumed output are another input's). Lines
are parsed and validated by `batchgen.entrypoints.batch_lines.parse_batch_line` as the run
admits them.
"""

from __future__ import annotations

import os

from batchgen.entrypoints.batch_output import ResumeState
from batchgen.entrypoints.openai_protocol import batch_line_custom_id


def count_request_lines(path: str | os.PathLike) -> int:
    """Number of non-blank lines of a file, read in a streaming pass."""
    with open(path, "rb") as f:
        return sum(1 for raw in f if raw.strip())


def input_result_keys(path: str | os.PathLike) -> tuple[int, ResumeState]:
    """(non-blank lines, the keys of the results the input can have) in one streaming pass.

    The keys are what `result_key` gives the result line `run_batch_file` writes for each
    request line: its custom_id, or its line number and custom_id (None) for a line without a
    usable custom_id and for a duplicate (`ResumeState`). Memory: the set of custom_ids (which
    the run holds anyway).
    """
    keys = ResumeState()
    count = 0
    with open(path, "rb") as f:
        for line, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            count += 1
            custom_id = batch_line_custom_id(raw, line)
            if custom_id is None or custom_id in keys.done_ids:
                keys.done_lines.add((line, custom_id))
            else:
                keys.done_ids.add(custom_id)
    return count, keys
