"""OpenAI object shapes of stored rows: ``file``, ``batch`` and ``list`` objects."""

from __future__ import annotations

import json
import logging
from typing import Any

logger = logging.getLogger(__name__)


def file_object(row: dict) -> dict[str, Any]:
    """The OpenAI ``file`` object of a stored file row."""
    return {
        "id": row["id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": row["created_at"],
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


def batch_object(row: dict, model: str) -> dict[str, Any]:
    """The OpenAI ``batch`` object of a stored batch row (plus ``model`` and ``usage``)."""
    prompt, completion = row["prompt_tokens"], row["completion_tokens"]
    return {
        "id": row["id"],
        "object": "batch",
        "endpoint": row["endpoint"],
        "model": model,
        "errors": _stored_json(row["errors"], row["id"], "errors"),
        "input_file_id": row["input_file_id"],
        "completion_window": row["completion_window"],
        "status": row["status"],
        "output_file_id": row["output_file_id"],
        "error_file_id": row["error_file_id"],
        "created_at": row["created_at"],
        "in_progress_at": row["in_progress_at"],
        "expires_at": row["expires_at"],
        "finalizing_at": row["finalizing_at"],
        "completed_at": row["completed_at"],
        "failed_at": row["failed_at"],
        "expired_at": row["expired_at"],
        "cancelling_at": row["cancelling_at"],
        "cancelled_at": row["cancelled_at"],
        "request_counts": {
            "total": row["total"],
            "completed": row["completed"],
            "failed": row["failed"],
        },
        "metadata": _stored_json(row["metadata"], row["id"], "metadata"),
        "usage": {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        },
    }


def list_object(data: list[dict], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def _stored_json(text: str | None, batch_id: str, column: str) -> Any:
    """A JSON column of a stored batch, such that reading it never fails: strings that hold a
    lone surrogate (stored by versions that let ``"\\ud800"`` through) come back with the
    surrogate spelled as a ``\\ud800`` escape, and unreadable JSON as None (logged)."""
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        logger.warning("batch %s: stored %s is not JSON; shown as null", batch_id, column)
        return None
    return _encodable(value)


def _encodable(value: Any) -> Any:
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {_encodable(k): _encodable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_encodable(v) for v in value]
    return value
