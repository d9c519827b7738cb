"""The input side of the service's engine loop (a mixin of `EngineLoop`): admitted requests go
to a worker thread for input processing (parsing a stored batch line, the chat template,
tokenization, the length checks: `InputProcessor`), and the engine thread queues each processed
prompt (`LLMEngine.add_processed_request`) in hand-over order, or records why it cannot run.

It uses `EngineLoop`'s ``engine``, ``_preparing``, ``_online``, ``_sent``, ``_started``,
``_batch_in_flight``, ``_commands``, ``_online_worker``, ``_batch_worker`` and the
`LoopOutputs` methods ``_emit_error`` and ``_record_failure``. It logs under the engine loop's
logger name, as before the split.
"""

from __future__ import annotations

import logging
import uuid
from concurrent.futures import Future

from batchgen.engine.input_processor import ProcessedPrompt
from batchgen.entrypoints.openai_protocol import (
    REQUEST_FAILED,
    ApiRequest,
    BatchLineError,
    BatchRequest,
    error_line,
    error_line_from,
    parse_batch_line,
    rejected_error,
)
from batchgen.service import store as st
from batchgen.service.engine_loop_records import (
    BatchCursor,
    InFlightBatchRequest,
    OnlineEvent,
    OnlineRequest,
    PreparingRequest,
)

logger = logging.getLogger("batchgen.service.engine_loop")


class LoopInputs:
    """`EngineLoop`'s input methods (see the module docstring)."""

    def _admit_batch_request(self, cursor: BatchCursor, pending: st.PendingRequest) -> None:
        cursor.remaining = max(0, cursor.remaining - 1)
        cursor.in_flight += 1
        future = self._batch_worker.submit(self._prepare_batch, pending)
        self._hand_over(
            f"req_{uuid.uuid4().hex}", PreparingRequest(future, cursor=cursor, pending=pending)
        )

    def _admit_online(self, request: OnlineRequest) -> None:
        future = self._online_worker.submit(self._prepare, request.api)
        self._hand_over(request.request_id, PreparingRequest(future, online=request))

    def _hand_over(self, request_id: str, prep: PreparingRequest) -> None:
        self._preparing[request_id] = prep
        prep.future.add_done_callback(lambda _: self._commands.put(("wake",)))

    def _prepare(self, api: ApiRequest) -> ProcessedPrompt:
        """On a worker thread: chat template, tokenization, length checks (ValueError)."""
        processor = self.engine.input_processor
        prompt = processor.apply_chat_template(api.messages) if api.is_chat else api.prompt
        return processor.process(prompt, api.sampling_params, max_tokens_must_fit=True)

    def _prepare_batch(self, pending: st.PendingRequest) -> tuple[BatchRequest, ProcessedPrompt]:
        """On a worker thread: parse the stored line (`BatchLineError`), then `_prepare` it
        (its exceptions carry the parsed line in ``err.batch_request``)."""
        parsed = parse_batch_line(pending.input, pending.line)
        try:
            return parsed, self._prepare(parsed.request)
        except Exception as err:
            err.batch_request = parsed
            raise

    def _take_prepared(self) -> None:
        """Queue in the engine every request whose input processing has finished (in hand-over
        order), or record why it cannot run."""
        for request_id, prep in list(self._preparing.items()):
            if not prep.future.done():
                continue
            del self._preparing[request_id]
            if prep.online is not None:
                self._take_online(request_id, prep)
            else:
                self._take_batch(request_id, prep)

    def _take_online(self, request_id: str, prep: PreparingRequest) -> None:
        request = prep.online
        api = request.api
        exc = _exception(prep.future)
        if isinstance(exc, ValueError):
            code, param = rejected_error(api, exc)
            self._emit_error(request, 400, str(exc), code, param)
            return
        if exc is not None:  # a bug in input processing: this request fails, not the loop
            logger.error("input of online request %s failed", request_id, exc_info=exc)
            self._emit_error(request, 500, _input_failure(exc), REQUEST_FAILED)
            return
        processed = prep.future.result()
        self.engine.add_processed_request(request_id, processed, api.sampling_params)
        self._online[request_id] = request
        if request.stream:
            self._sent[request_id] = {}
            request.emit(OnlineEvent("admitted"))

    def _take_batch(self, request_id: str, prep: PreparingRequest) -> None:
        cursor, pending = prep.cursor, prep.pending
        exc = _exception(prep.future)
        if exc is not None:
            cursor.in_flight -= 1
            self._record_failure(pending.batch_id, pending.idx, _input_error_line(pending, exc))
            return
        parsed, processed = prep.future.result()
        api = parsed.request
        self.engine.add_processed_request(request_id, processed, api.sampling_params)
        self._started.append((pending.batch_id, pending.idx))
        self._batch_in_flight[request_id] = InFlightBatchRequest(
            pending.batch_id, pending.idx, pending.line, parsed.custom_id, api
        )


def _exception(future: Future) -> BaseException | None:
    """The exception a finished worker job raised, or None. Read with ``future.exception()``
    rather than by re-raising ``future.result()``: re-raised here, its traceback would take in
    the engine thread's frames, whose locals hold the future, a reference cycle that kept each
    failed request's prompt (megabytes for an oversized one) alive until a full GC."""
    return future.exception()


def _input_failure(exc: Exception) -> str:
    return f"the server failed while processing this request's input ({type(exc).__name__})"


def _input_error_line(pending: st.PendingRequest, exc: Exception) -> dict:
    """The error line of a batch request whose input processing raised ``exc``."""
    if isinstance(exc, BatchLineError):  # validated before; only if the protocol changed since
        return error_line_from(exc)
    parsed: BatchRequest | None = getattr(exc, "batch_request", None)
    custom_id = parsed.custom_id if parsed is not None else None
    if isinstance(exc, ValueError) and parsed is not None:  # the engine refused the prompt
        code, param = rejected_error(parsed.request, exc)
        message = f"line {pending.line}: {exc}"
        return error_line(custom_id, code, message, param=param, line=pending.line)
    logger.error("input of batch %s line %d failed", pending.batch_id, pending.line, exc_info=exc)
    message = f"line {pending.line}: {_input_failure(exc)}"
    return error_line(custom_id, REQUEST_FAILED, message, line=pending.line)
