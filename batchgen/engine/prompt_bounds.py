"""How long a prompt text may be before it certainly cannot fit ``max_model_len``: a bound that
costs ``len(text)``, checked before the tokenizer runs.

Tokenizing is the expensive part of admitting a request (a 10 MB prompt took 9-14 s and about
400 MB of transient memory per request through `transformers`), so a prompt that cannot fit is
refused by its character count first. The bound has to be *sound*: it may only refuse a text
that really has ``max_model_len`` tokens or more. Characters and tokens are not related in
general (no "a prompt of N characters yields at least N / 4 tokens"):

* a normalizer may delete characters (``Strip``, ``StripAccents``, BERT's control-character
  cleaning, a ``Replace`` with empty content), and a pre-tokenizer may drop whitespace
  (``Whitespace``, ``BertPreTokenizer``): a million spaces can be zero tokens;
* WordPiece turns a whole unknown word, of any length, into one ``[UNK]``; BPE or Unigram
  without byte fallback fuse runs of unknown characters into one ``unk`` (``fuse_unk``) or,
  without an ``unk`` token, drop them;
* an added token with ``lstrip`` / ``rstrip`` swallows the whitespace beside it.

A bound exists when none of that can happen: every character of the (normalized) text ends up
inside some token, and a token stands for at most ``K`` characters, ``K`` the longest vocabulary
or added-token string (byte-level vocabularies spell one byte per character, and a character is
at least one byte). Normalization can still shrink the text: NFC / NFKC compose at most 4 code
points into one (the longest canonical decomposition in Unicode, e.g. U+1F87), a ``Replace`` of
a string by a shorter one shrinks by their length ratio. So ``tokens >= len(text) / (S * K)``
with ``S`` the product of those factors, and a text longer than ``(max_model_len - 1) * S * K``
characters cannot fit. That covers the byte-level BPE tokenizers of Llama 3, Qwen, DeepSeek and
GPT-2 (ByteLevel pre-tokenizer) and the SentencePiece-style ones of Llama 2, Mistral and Mixtral
(byte fallback).

For any other tokenizer `chars_per_token_bound` returns None and the engine applies a *policy*
limit instead (`POLICY_CHARS_PER_TOKEN` characters per token of ``max_model_len``), said so in
its error message: such a prompt might fit, but tokenizing arbitrarily long text to find out is
refused.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# Characters per token of max_model_len allowed when no sound bound exists (generous: English
# text averages about 4 characters per token).
POLICY_CHARS_PER_TOKEN = 64
# Most code points that canonical composition (NFC / NFKC) turns into one: the longest NFD
# decomposition in Unicode 15 (e.g. U+1F87 = 4 code points).
MAX_COMPOSITION = 4

# Pre-tokenizers that keep every character (Split and Punctuation unless behavior "Removed").
_KEEPING_PRE_TOKENIZERS = frozenset(
    {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}
)


@dataclass(frozen=True)
class PromptBound:
    """The longest prompt text (in characters) that may still fit ``max_model_len``.

    Attributes:
        max_chars: longer texts are refused before tokenizing.
        chars_per_token: ``S * K`` of the module docstring, or `POLICY_CHARS_PER_TOKEN`.
        sound: True when every refused text provably has ``max_model_len`` tokens or more;
            False for the policy limit.
    """

    max_chars: int
    chars_per_token: int
    sound: bool

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, max_model_len: int) -> PromptBound:
        """The bound for a `transformers` tokenizer and a context of ``max_model_len``."""
        per_token = chars_per_token_bound(tokenizer)
        sound = per_token is not None
        per_token = per_token if sound else POLICY_CHARS_PER_TOKEN
        return cls(max(max_model_len - 1, 0) * per_token, per_token, sound)

    def message(self, num_chars: int, max_model_len: int) -> str:
        """Why a text of ``num_chars`` characters is refused."""
        if self.sound:
            least = -(-num_chars // self.chars_per_token)
            return (
                f"prompt has {num_chars} characters, so at least {least} tokens (this model's "
                f"tokenizer makes one token of at most {self.chars_per_token} characters), "
                f"which leaves no room to generate within max_model_len={max_model_len} "
                "(prompt must be < max_model_len tokens)"
            )
        return (
            f"prompt has {num_chars} characters; BatchGen refuses prompts longer than "
            f"{self.max_chars} characters for this model ({self.chars_per_token} per token of "
            f"max_model_len={max_model_len}) without tokenizing them, because its tokenizer "
            "can drop characters, so the text's length does not bound its token count"
        )


def chars_per_token_bound(tokenizer: Any) -> int | None:
    """``S * K`` (see the module docstring): the most characters of input text that one token
    of ``tokenizer`` can stand for, or None when the tokenizer's pipeline can make arbitrarily
    many characters into one token or none (or is not a `tokenizers` fast tokenizer)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except (AttributeError, TypeError, ValueError):
        return None
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _keeps_characters(spec.get("pre_tokenizer")):
        return None
    model = spec.get("model") or {}
    longest = _model_longest_token(model, byte_level=_has_byte_level(spec.get("pre_tokenizer")))
    if longest is None:
        return None
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    longest = max([longest, *(len(t.get("content", "")) for t in added)])
    return shrink * max(longest, 1)


def _normalizer_shrink(spec: dict | None) -> int | None:
    """How many input characters may become one normalized character; None: unbounded."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers", []):
            sub = _normalizer_shrink(part)
            if sub is None:
                return None
            factor *= sub
        return factor
    if kind in ("NFC", "NFKC"):
        return MAX_COMPOSITION
    if kind in ("NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"):
        return 1  # these only map a character to one or more characters
    if kind == "Replace":
        pattern, content = spec.get("pattern") or {}, spec.get("content") or ""
        if "String" in pattern and pattern["String"] and content:
            return -(-len(pattern["String"]) // len(content))
        return None  # a regex may match any length; empty content deletes
    return None  # Strip, StripAccents, BertNormalizer, NMT, Precompiled, unknown kinds


def _keeps_characters(spec: dict | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(p) for p in spec.get("pretokenizers", []))
    return kind in _KEEPING_PRE_TOKENIZERS and spec.get("behavior") != "Removed"


def _has_byte_level(spec: dict | None) -> bool:
    if spec is None:
        return False
    if spec.get("type") == "Sequence":
        return any(_has_byte_level(p) for p in spec.get("pretokenizers", []))
    return spec.get("type") == "ByteLevel"


def _model_longest_token(model: dict, *, byte_level: bool) -> int | None:
    """The longest vocabulary string, when every input character ends up in some token."""
    kind, vocab = model.get("type"), model.get("vocab")
    if kind == "BPE" and isinstance(vocab, dict):
        tokens = set(vocab)
    elif kind == "Unigram" and isinstance(vocab, list):
        tokens = {entry[0] for entry in vocab}
    else:
        return None  # WordPiece (a whole unknown word is one [UNK]), WordLevel, unknown kinds
    if byte_level:
        covered = _BYTE_LEVEL_ALPHABET <= tokens
    elif model.get("byte_fallback"):
        covered = all(f"<0x{b:02X}>" in tokens for b in range(256))
    else:
        covered = False
    # A character outside the vocabulary: dropped without an unk token, fused with its
    # neighbours into one unk with fuse_unk (Unigram always fuses).
    if not covered and (model.get("unk_token") is None or model.get("fuse_unk", kind == "Unigram")):
        return None
    return max((len(t) for t in tokens), default=0)


def _byte_level_alphabet() -> frozenset[str]:
    """The 256 characters GPT-2's ByteLevel pre-tokenizer spells bytes with."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = [b for b in range(256) if b not in printable]
    return frozenset(map(chr, printable + [256 + i for i in range(len(extra))]))


_BYTE_LEVEL_ALPHABET = _byte_level_alphabet()
