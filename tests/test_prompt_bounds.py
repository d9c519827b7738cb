"""The character bound that refuses a prompt before tokenizing: proven sound on tokenizers of the
shapes real models use (adversarial texts never have fewer tokens than the bound says), absent
for tokenizers that can drop or swallow characters, and applied by `InputProcessor` without
running the tokenizer."""

from __future__ import annotations

import math
import unicodedata

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from batchgen.engine.input_processor import InputProcessor, load_tokenizer
from batchgen.engine.prompt_bounds import (
    MAX_COMPOSITION,
    POLICY_CHARS_PER_TOKEN,
    PromptBound,
    chars_per_token_bound,
)
from batchgen.models.tokenizer_factory import build_tokenizer, bytes_to_unicode


class Fast:
    """What `chars_per_token_bound` reads of a `transformers` fast tokenizer."""

    def __init__(self, backend: Tokenizer):
        self.backend_tokenizer = backend


# Texts built to make few tokens out of many characters.
ADVERSARIAL = [
    " " * 5000,
    "a" * 5000,
    "ab" * 2500,
    "\n" * 3000 + "\t" * 2000,
    "<|im_start|>" * 400,
    "é" * 2000,
    "\u03b1\u0314\u0342\u0345" * 1000,  # decomposed U+1F87: NFC makes 4 code points one
    "\U0001f600" * 1000,
    "x y z " * 800,
]


def _llama2_like() -> Tokenizer:
    """SentencePiece-style BPE as in Llama 2 / Mistral / Mixtral: "▁" for spaces, byte fallback,
    fused unk, merges up to a run of 16 "▁"."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    merges = []
    for piece in ["▁", "a", "b", "x", "y", "z"]:
        vocab.setdefault(piece, len(vocab))
    run = "▁"
    while len(run) < 16:
        merges.append((run, run))
        run += run
        vocab[run] = len(vocab)
    merges.append(("a", "b"))
    vocab["ab"] = len(vocab)
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    )
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback()])
    return tok


def _qwen_like() -> Tokenizer:
    """Byte-level BPE behind an NFC normalizer (Qwen2)."""
    tok = build_tokenizer(512)
    tok.normalizer = normalizers.NFC()
    return tok


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: build_tokenizer(512), None),  # the test models' byte-level BPE
        (_llama2_like, 16),
        (_qwen_like, None),
    ],
)
def test_sound_bound_never_exceeds_the_true_token_count(make, expected):
    tok = make()
    per_token = chars_per_token_bound(Fast(tok))
    assert per_token is not None
    if expected is not None:
        assert per_token == expected
    for text in ADVERSARIAL:
        tokens = len(tok.encode(text, add_special_tokens=False).ids)
        assert tokens >= math.ceil(len(text) / per_token), (text[:20], tokens, per_token)


def test_byte_level_bound_is_the_longest_token_and_nfc_multiplies_it():
    tok = build_tokenizer(512)
    longest = max(len(t) for t in tok.get_vocab(with_added_tokens=True))
    assert chars_per_token_bound(Fast(tok)) == longest
    assert chars_per_token_bound(Fast(_qwen_like())) == MAX_COMPOSITION * longest
    # MAX_COMPOSITION is the longest canonical decomposition Unicode has.
    assert MAX_COMPOSITION == max(
        len(unicodedata.normalize("NFD", chr(c)))
        for c in range(0x110000)
        if not 0xD800 <= c <= 0xDFFF
    )
    assert set(bytes_to_unicode().values()) <= set(tok.get_vocab())


def _wordpiece() -> Tokenizer:
    tok = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return tok


def _with(normalizer=None, pre_tokenizer=None) -> Tokenizer:
    tok = build_tokenizer(512)
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    return tok


def _rstrip_added_token() -> Tokenizer:
    tok = build_tokenizer(512)
    tok.add_special_tokens([AddedToken("<|end|>", rstrip=True)])
    return tok


def _bpe_dropping_unknowns() -> Tokenizer:
    return Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (_wordpiece, "a whole unknown word is one [UNK]; whitespace is dropped"),
        (lambda: _with(normalizer=normalizers.Strip()), "strips whitespace"),
        (lambda: _with(normalizer=normalizers.StripAccents()), "drops combining marks"),
        (lambda: _with(normalizer=normalizers.Replace(" ", "")), "deletes spaces"),
        (lambda: _with(pre_tokenizer=pre_tokenizers.Whitespace()), "drops whitespace"),
        (_rstrip_added_token, "an added token swallows the spaces after it"),
        (_bpe_dropping_unknowns, "characters outside the vocabulary are dropped"),
    ],
)
def test_no_bound_for_tokenizers_that_drop_or_swallow_characters(make, why):
    tok = make()
    assert chars_per_token_bound(Fast(tok)) is None, why
    # ... and that is real: many characters, (almost) no tokens.
    text = {
        "a whole unknown word is one [UNK]; whitespace is dropped": "q" * 1000,
        "an added token swallows the spaces after it": "<|end|>" + " " * 1000,
        "characters outside the vocabulary are dropped": "c" * 1000,
        "drops combining marks": "a" + "\u0301" * 1000,
    }.get(why, " " * 1000)
    assert len(tok.encode(text, add_special_tokens=False).ids) <= 2


def test_slow_or_foreign_tokenizers_get_the_policy_limit():
    bound = PromptBound.for_tokenizer(object(), max_model_len=100)
    assert bound == PromptBound(99 * POLICY_CHARS_PER_TOKEN, POLICY_CHARS_PER_TOKEN, False)
    assert "can drop characters" in bound.message(10**6, 100)


class CountingTokenizer:
    """A real byte-level tokenizer that counts its encode calls."""

    def __init__(self, path):
        self.inner = load_tokenizer(path)
        self.backend_tokenizer = self.inner.backend_tokenizer
        self.calls = 0

    def encode(self, text, add_special_tokens=True):
        self.calls += 1
        return self.inner.encode(text, add_special_tokens=add_special_tokens)


def test_oversized_prompts_are_refused_before_tokenizing(checkpoint_dir):
    from batchgen.sampling_params import SamplingParams

    tok = CountingTokenizer(checkpoint_dir("mixtral"))
    proc = InputProcessor(tok, vocab_size=512, max_model_len=256)
    per_token = proc.prompt_bound.chars_per_token
    assert proc.prompt_bound.sound and proc.prompt_bound.max_chars == 255 * per_token
    with pytest.raises(ValueError) as info:
        proc.process("x" * 10_000_000, SamplingParams())
    assert tok.calls == 0
    assert info.value.code == "context_length_exceeded"
    assert str(info.value) == (
        f"prompt has 10000000 characters, so at least {-(-10_000_000 // per_token)} tokens "
        f"(this model's tokenizer makes one token of at most {per_token} characters), which "
        "leaves no room to generate within max_model_len=256 (prompt must be < max_model_len "
        "tokens)"
    )
    with pytest.raises(ValueError, match="prompt has 20000000 tokens") as info:
        proc.process([10**9] * 20_000_000, SamplingParams())  # length first, not id by id
    assert info.value.code == "context_length_exceeded"
    # At the bound the text is tokenized and the exact count decides.
    out = proc.process("hello " * 10, SamplingParams())
    assert tok.calls == 1 and 0 < len(out.prompt_token_ids) < 256
