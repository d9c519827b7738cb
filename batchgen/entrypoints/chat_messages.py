"""Chat-completion ``messages``: checked and flattened to ``{role, content: str}`` for a chat
template (`parse_messages`). Pure functions, no I/O; shared by the HTTP service, batch lines and
`LLM.chat`.
"""

from __future__ import annotations

from typing import Any

from batchgen.entrypoints.openai_errors import (
    MISSING_REQUIRED_PARAMETER,
    UNSUPPORTED_PARAMETER,
    ProtocolError,
    describe_json,
    type_error,
)

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    """Check a chat request's ``messages`` and flatten each one's content to a string.

    Returns copies of the messages with role ``developer`` mapped to ``system`` and text parts
    joined with newlines. Raises `ProtocolError` (``param`` e.g. ``messages[1].role``): missing
    or empty, a message that is not an object, an unknown role, missing content (allowed for
    ``assistant``), a non-text content part.
    """
    if messages is None:
        raise ProtocolError(
            "missing 'messages' (a list of {role, content} objects)",
            code=MISSING_REQUIRED_PARAMETER,
            param="messages",
        )
    if not isinstance(messages, list) or not messages:
        raise type_error("messages", "a non-empty list of {role, content} objects", messages)
    return [_parse_message(m, i) for i, m in enumerate(messages)]


def _parse_message(message: Any, index: int) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise type_error(where, "an object with 'role' and 'content'", message)
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise ProtocolError(
            f"'{where}.role' must be one of {list(CHAT_ROLES)}, got {describe_json(role)}",
            param=f"{where}.role",
        )
    content = message.get("content")
    if content is None and role != "assistant":  # assistant turns may carry only tool calls
        raise ProtocolError(
            f"'{where}.content' is required for role '{role}'",
            code=MISSING_REQUIRED_PARAMETER,
            param=f"{where}.content",
        )
    parsed = dict(message)
    parsed["role"] = "system" if role == "developer" else role
    parsed["content"] = _flatten_content(content, f"{where}.content")
    return parsed


def _flatten_content(content: Any, where: str) -> str:
    """Message content as one string: text parts are joined with newlines (as vLLM does)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise type_error(where, "a string or a list of text parts", content)
    texts = []
    for i, part in enumerate(content):
        is_text = isinstance(part, dict) and part.get("type") == "text"
        if not is_text or not isinstance(part.get("text"), str):
            raise ProtocolError(
                f'\'{where}[{i}]\' must be a text part {{"type": "text", "text": ...}}; '
                f"BatchGen serves text-only models, got {describe_json(part)}",
                code=UNSUPPORTED_PARAMETER,
                param=f"{where}[{i}]",
            )
        texts.append(part["text"])
    return "\n".join(texts)
