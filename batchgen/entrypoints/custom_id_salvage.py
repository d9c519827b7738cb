"""The custom_id of a batch line that is not valid JSON, found in its raw text.

A line cut short or mangled (``{"custom_id": "req-7", "body": {"prompt": "x"``) still names
its request plainly; its error line carries that custom_id so that it can be matched like any
other result (and ``--resume`` skips it by id). The search is conservative: exactly one
``"custom_id": "<string>"`` that opens the line's object or follows a comma, a valid JSON
string, non-empty, storable as UTF-8; anything else gives None (the error line then names the
line number only, as before).
"""

from __future__ import annotations

import json
import re

# `"custom_id"` as a key: at the start of the object or after a comma, not inside a string
# (a quote inside a JSON string is escaped, so `\"custom_id\"` never matches), then its value:
# a JSON string literal with escapes.
_CUSTOM_ID_KEY = re.compile(r'(?:^\s*\{|,)\s*"custom_id"\s*:\s*("(?:[^"\\\x00-\x1f]|\\.)*")')


def salvage_custom_id(text: str) -> str | None:
    """The one custom_id written in a batch line's raw ``text``, or None.

    Args:
        text: the line as text (invalid UTF-8 decoded with U+FFFD replacements, which then
            disqualify an id containing one).

    Returns:
        The decoded custom_id when exactly one ``"custom_id": "<string>"`` key is found and
        its value is a non-empty JSON string without lone surrogates or U+FFFD; else None.
    """
    found = _CUSTOM_ID_KEY.findall(text)
    if len(found) != 1:
        return None
    try:
        value = json.loads(found[0])
        value.encode("utf-8")  # a lone surrogate escape such as "\ud800" cannot be stored
    except (ValueError, UnicodeEncodeError):
        return None
    if not value or "\ufffd" in value:
        return None
    return value
