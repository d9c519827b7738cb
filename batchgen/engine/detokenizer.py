"""Incremental, UTF-8-safe detokenization and stop-string matching for one sample.

Decoding the whole output after every step costs O(length) per step. Instead, like vLLM's
``detokenize_incrementally`` (``vllm/transformers_utils/detokenizer_utils.py``) and Hugging
Face's ``TextStreamer``, we decode only a small window of recent ids and emit the part of its
text that is new (the prefix-offset / read-offset technique):

    ids:    ... | prefix_offset ... read_offset | read_offset ... end |
    prefix_text = decode(ids[prefix_offset:read_offset])   (text already emitted)
    new_text    = decode(ids[prefix_offset:])               (window text)
    emit new_text[len(prefix_text):], then prefix_offset, read_offset = read_offset, end

Decoding from ``prefix_offset`` rather than ``read_offset`` gives tokenizers whose decode
depends on the previous token (SentencePiece's leading-space handling) the context they need.
When the window text ends in U+FFFD, the last token(s) hold an incomplete UTF-8 sequence
(e.g. the first two of an emoji's four bytes): nothing is emitted and the offsets stay, so the
next token completes the character. For valid UTF-8 the window is a few tokens (longer only
while successive tokens keep ending mid-character, as merges across CJK characters can), so a
step costs O(window), independent of the output length.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    """The part of a ``transformers`` tokenizer this module uses."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def fast_decode(tokenizer: Tokenizer) -> Callable[[list[int], bool], str] | None:
    """The Rust ``tokenizers.Tokenizer.decode`` behind a ``transformers`` fast tokenizer, when
    calling it directly gives exactly ``tokenizer.decode(ids, skip_special_tokens=...)``;
    else None.

    That holds when the class keeps ``transformers``' own ``decode`` and ``_decode``
    (`TokenizersBackend`: ``_decode`` is the backend's decode, then the optional clean-up) and
    ``clean_up_tokenization_spaces`` is off. ``transformers``' ``decode`` first converts the
    ids with ``to_py_obj``, an ``isinstance`` per id: about 1.5 us per decode plus 0.1 us per
    id, against 2 us for the whole Rust decode of a few ids, so per-token detokenization of a
    70-row decode step spent more time in that wrapper than in decoding.
    """
    try:
        from transformers import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # not a transformers tokenizer stack we know
        return None
    cls = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if (
        not isinstance(tokenizer, TokenizersBackend)
        or cls.decode is not PreTrainedTokenizerBase.decode
        or cls._decode is not TokenizersBackend._decode
        or getattr(tokenizer, "clean_up_tokenization_spaces", True)
        or backend is None
    ):
        return None
    return backend.decode


class IncrementalDetokenizer:
    """Turns one sample's generated token ids into text, step by step, and finds stop strings.

    The emitted text always equals ``tokenizer.decode(output_ids, ...)`` once finalized (when no
    stop string matched): decoding uses the output ids only, never the prompt, so the result
    matches a one-shot decode exactly (including a SentencePiece first token's stripped leading
    space). Stop strings are searched in the generated text only; a step checks only the newly
    emitted text plus the last ``max(len(stop)) - 1`` characters before it, so it also stays
    O(window). Source: vLLM ``Detokenizer`` / ``StopChecker.check_stop_strings``.

    Args:
        tokenizer: a ``transformers`` tokenizer (anything with ``decode(ids,
            skip_special_tokens=...)``). It should not clean up tokenization spaces.
        prompt_token_ids: the prompt's ids; kept for the caller (``prompt_token_ids``) but not
            decoded, so stop strings in the prompt never trigger.
        skip_special_tokens: drop special tokens (BOS, EOS, ``<|im_end|>``...) from the text.
        stop: stop strings; empty strings are ignored.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        min_tokens: stop strings are not looked for while fewer than this many ids were
            generated (vLLM's ``SamplingParams.min_tokens``: text completed by the step that
            reaches ``min_tokens`` is checked, earlier text is not).
        detokenize: False keeps the ids only: no decode, the text stays empty
            (``SamplingParams.detokenize``; ``stop`` must then be empty).

    Raises:
        ValueError: stop strings with ``detokenize=False``.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        detokenize: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.detokenize = detokenize
        self._backend_decode = fast_decode(tokenizer)  # None: through `tokenizer.decode`
        self.prompt_token_ids = prompt_token_ids
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in (stop or []) if s]
        if self.stop and not detokenize:
            raise ValueError(f"stop strings need detokenize=True, got stop={self.stop!r}")
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.output_token_ids: list[int] = []
        self.stop_str: str | None = None  # the stop string that matched, if any
        self.finished = False
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""  # decode(output_token_ids[prefix_offset:read_offset])
        self._pieces: list[str] = []  # emitted text; joined lazily by `output_text`
        self._text_len = 0
        self._joined: str | None = ""
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self._tail = ""  # the last `_max_stop_len - 1` emitted characters

    @property
    def output_text(self) -> str:
        """Text emitted so far: no trailing incomplete character; after a stop match, cut
        before the stop string (or just after it with ``include_stop_str_in_output``).

        Built on demand from the emitted pieces: reading it after new text arrived costs
        O(length), so streaming callers should read it only when they need it."""
        if self._joined is None:
            self._joined = "".join(self._pieces)
            self._pieces = [self._joined]
        return self._joined

    def add_tokens(self, new_token_ids: list[int]) -> str | None:
        """Append generated ids and emit their text.

        Args:
            new_token_ids: ids generated since the last call (usually one).

        Returns:
            The stop string that matched (the sample must finish; ``output_text`` is already
            truncated), or None.

        Raises:
            RuntimeError: the sample already finished (stop string matched or ``finalize``).
        """
        if self.finished:
            raise RuntimeError("add_tokens() called after the sample finished")
        if not new_token_ids:
            return None
        self.output_token_ids.extend(new_token_ids)
        if not self.detokenize:
            return None
        window = self._decode(self.output_token_ids[self._prefix_offset :])
        if len(window) <= len(self._prefix_text) or window.endswith(REPLACEMENT_CHAR):
            # Nothing new (e.g. a skipped special token) or an incomplete UTF-8 sequence:
            # keep the offsets so the next token is decoded together with these.
            return None
        new_text = window[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.output_token_ids)
        self._prefix_text = self._decode(
            self.output_token_ids[self._prefix_offset : self._read_offset]
        )
        return self._emit(new_text)

    def finalize(self) -> str:
        """Flush text held back for an incomplete character and return the final text.

        Without a stop match this equals ``tokenizer.decode(output_token_ids,
        skip_special_tokens=...)`` exactly (a truly invalid byte sequence at the end shows as
        U+FFFD, as in the one-shot decode). Idempotent; ``add_tokens`` may not follow.
        """
        if not self.finished:
            self.finished = True
            if not self.detokenize:
                return self.output_text
            window = self._decode(self.output_token_ids[self._prefix_offset :])
            if len(window) > len(self._prefix_text):
                self._append(window[len(self._prefix_text) :])
        return self.output_text

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _append(self, text: str) -> None:
        self._pieces.append(text)
        self._text_len += len(text)
        self._joined = None

    def _emit(self, new_text: str) -> str | None:
        """Append ``new_text`` and look for the stop string that completes first in it."""
        if not self.stop:
            self._append(new_text)
            return None
        # Only matches that end inside new_text are new; earlier ones were found before.
        search = self._tail + new_text
        # (end, start, stop): the stop that completes first wins; on a tie, the longer one.
        best: tuple[int, int, str] | None = None
        stops = self.stop if len(self.output_token_ids) >= self.min_tokens else []
        for s in stops:
            start = search.find(s, max(0, len(self._tail) - len(s) + 1))
            if start != -1:
                candidate = (start + len(s), start, s)
                if best is None or candidate < best:
                    best = candidate
        if best is None:
            self._append(new_text)
            self._tail = search[-(self._max_stop_len - 1) :] if self._max_stop_len > 1 else ""
            return None
        end, start, stop_str = best
        cut = end if self.include_stop_str_in_output else start
        # `cut` indexes `search`; convert to the emitted text, which may shrink (the stop
        # string can begin in text emitted by earlier steps).
        keep = self._text_len - len(self._tail) + cut
        text = self.output_text + new_text
        self._pieces, self._joined = [text[:keep]], None
        self._text_len = keep
        self.stop_str = stop_str
        self.finished = True
        return stop_str


@functools.lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode`` table (used by every ByteLevel BPE tokenizer):
    printable bytes map to themselves, the other 68 to code points 256 and up."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    codes, extra = list(printable), 0
    byte_values = list(printable)
    for b in range(256):
        if b not in printable:
            byte_values.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(byte_values, codes, strict=True)}


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The raw bytes one token stands for, even when they are not valid UTF-8 on their own
    (half an emoji from a byte-level BPE), as OpenAI's chat ``logprobs[].bytes`` reports them.

    Byte-level BPE pieces are mapped back through the GPT-2 byte table; SentencePiece byte
    fallback pieces ``<0xE6>`` give their byte; anything else falls back to the UTF-8 of the
    decoded text.
    """
    to_piece = getattr(tokenizer, "convert_ids_to_tokens", None)
    piece = to_piece(int(token_id)) if to_piece is not None else None
    if isinstance(piece, str):
        match = _BYTE_FALLBACK.fullmatch(piece)
        if match:
            return bytes([int(match[1], 16)])
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = type(getattr(backend, "decoder", None)).__name__
        table = _byte_level_decoder()
        if (
            decoder == "ByteLevel"
            and piece not in tokenizer.all_special_tokens
            and all(ch in table for ch in piece)
        ):
            return bytes(table[ch] for ch in piece)
    return tokenizer.decode([int(token_id)]).encode("utf-8")
