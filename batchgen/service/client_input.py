"""Batch input files on the client side: the endpoint of a line (`line_endpoint`) and a file's
lines grouped by endpoint (`split_by_endpoint`), so that `BatchGenClient.submit_file_by_endpoint`
starts one batch per endpoint.

Pure Python (no httpx, no torch); `batchgen.service.client` re-exports every name here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

COMPLETIONS_URL = "/v1/completions"
CHAT_COMPLETIONS_URL = "/v1/chat/completions"
SUPPORTED_URLS = (COMPLETIONS_URL, CHAT_COMPLETIONS_URL)


@dataclass
class EndpointLines:
    """The lines of a batch input file that go to one endpoint (`split_by_endpoint`).

    Attributes:
        data: the file's bytes with every other endpoint's line blanked (an empty line), so
            line numbers stay those of the file.
        num_lines: how many lines (not blank) go to this endpoint.
    """

    data: bytes
    num_lines: int


def line_endpoint(raw: bytes) -> str | None:
    """The endpoint of one batch input line: its ``url`` when a string, else
    ``/v1/chat/completions`` for a line with ``messages``, else ``/v1/completions``; None for
    a line that is not a JSON object (the server reports its error)."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("url"), str):
        return obj["url"]
    return CHAT_COMPLETIONS_URL if "messages" in obj else COMPLETIONS_URL


def split_by_endpoint(path: str | os.PathLike) -> dict[str, EndpointLines]:
    """Group the lines of a batch input file by endpoint (`line_endpoint`), in order of first
    appearance. A line with no endpoint (not JSON) or with one BatchGen does not serve (say
    ``/v1/embeddings``) goes with the first served endpoint, whose batch reports its error
    line (``invalid_url`` for the latter, as ``batchgen run`` does) while the rest runs; a file
    of such lines only goes to ``/v1/completions``. Blank lines are kept in every group (the
    server skips them)."""
    lines = Path(path).read_bytes().splitlines(keepends=True)
    ends = [None if not raw.strip() else line_endpoint(raw) for raw in lines]
    ends = [e if e in SUPPORTED_URLS else None for e in ends]
    urls = list(dict.fromkeys(e for e in ends if e is not None))
    if not urls and any(raw.strip() for raw in lines):
        urls = [COMPLETIONS_URL]
    # Each non-blank line's batch: its own endpoint, or the first one for a line without.
    owners = [None if not raw.strip() else (e or urls[0]) for raw, e in zip(lines, ends)]
    groups = {}
    for url in urls:
        keep = [raw if owner in (None, url) else b"\n" for raw, owner in zip(lines, owners)]
        groups[url] = EndpointLines(b"".join(keep), owners.count(url))
    return groups
