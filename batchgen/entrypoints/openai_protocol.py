"""OpenAI API requests and responses <-> BatchGen requests and outputs. Pure functions, no I/O.

Shared by ``batchgen run`` (OpenAI Batch API files) and the HTTP service. Two layers:

* **Bodies** (`parse_request_body`): the JSON body of a ``/v1/completions`` or
  ``/v1/chat/completions`` request -> `ApiRequest` (prompt or messages + `SamplingParams`).
  `completion_response_body` / `chat_response_body` (in `batchgen.entrypoints.openai_responses`,
  re-exported here) turn a finished `RequestOutput` back into the OpenAI ``text_completion`` /
  ``chat.completion`` object.
* **Batch lines** (`parse_batch_line`): one line of an OpenAI Batch input file, either the
  envelope ``{"custom_id", "method": "POST", "url", "body"}`` or a plain body such as
  ``{"prompt": "..."}`` (a completion; with ``"messages"`` a chat completion) whose
  ``custom_id`` defaults to ``line-<N>``. `success_line` / `error_line` build output lines.

Errors are `ProtocolError` (a ValueError) carrying an OpenAI-style ``code`` and the offending
``param``; batch-line errors are `BatchLineError`, which adds the ``custom_id`` (None when the
line has none) and the 1-based line number.

This module holds no code: it re-exports the names of the modules that do, so callers import
from one place. Request side: `batchgen.entrypoints.request_body` (bodies, the field policy),
`batchgen.entrypoints.chat_messages` (``messages``), `batchgen.entrypoints.batch_lines` (batch
input lines, blank lines), `batchgen.entrypoints.openai_errors` (error codes, the errors, JSON
type checks, `rejected_error`); response side: `batchgen.entrypoints.openai_responses`
(response bodies, output lines, `error_line_from`).
"""

from __future__ import annotations

from batchgen.entrypoints.batch_lines import (  # noqa: F401
    BatchRequest,
    BlankLines,
    batch_line_custom_id,
    parse_batch_line,
)
from batchgen.entrypoints.chat_messages import CHAT_ROLES, parse_messages  # noqa: F401
from batchgen.entrypoints.openai_errors import (  # noqa: F401
    CONTEXT_LENGTH_EXCEEDED,
    DUPLICATE_CUSTOM_ID,
    INVALID_JSON_LINE,
    INVALID_METHOD,
    INVALID_PROMPT,
    INVALID_REQUEST,
    INVALID_URL,
    MISSING_REQUIRED_PARAMETER,
    REQUEST_FAILED,
    UNSUPPORTED_PARAMETER,
    BatchLineError,
    ProtocolError,
    rejected_error,
)
from batchgen.entrypoints.openai_responses import (  # noqa: F401
    MIN_LOGPROB,
    chat_logprobs,
    chat_response_body,
    completion_logprobs,
    completion_response_body,
    dumps_line,
    duplicate_custom_id_line,
    error_line,
    error_line_from,
    response_body,
    success_line,
    usage,
)
from batchgen.entrypoints.request_body import (  # noqa: F401
    CHAT_COMPLETIONS_URL,
    COMPLETIONS_URL,
    SUPPORTED_URLS,
    ApiRequest,
    parse_request_body,
)
